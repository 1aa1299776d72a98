"""Rows: a batch run one row at a time where a model takes no other (`by_rows`), and a pair of outputs walked
as fp64 blocks of rows, the padded positions left out (`mask_for`, `blocks`)."""
from __future__ import annotations

import torch

CHUNK = 8   # rows compared in fp64 at a time
SPAN = 1 << 15   # elements a block holds at least: a cache's narrow rows (64 wide) are not compared 8 at a time


def by_rows(fn, batch: dict) -> list[tuple[dict, object]]:
    """[(batch, fn(batch))]; where fn fails on a batch of several rows, [(row, fn(row))] for each row alone
    (some heads take one row at a time: GPT-2 classifiers without a pad token). The batch's own error is
    raised where it is one row already or a row fails too."""
    try:
        return [(batch, fn(batch))]
    except Exception as e:
        rows = batch_rows(batch)
        if rows is None:
            raise
        try:
            return [(row, fn(row)) for row in rows]
        except Exception:
            raise e from None


def batch_rows(batch: dict) -> list[dict] | None:
    """A batch of several rows as one-row batches; None if it is one row already."""
    sizes = {v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor) and v.dim()}
    if len(sizes) != 1 or (n := sizes.pop()) < 2:
        return None
    return [{k: v[i:i + 1] if isinstance(v, torch.Tensor) and v.dim() else v for k, v in batch.items()}
            for i in range(n)]


def mask_for(name: str, batch: dict, out: torch.Tensor) -> torch.Tensor | None:
    """The positions of `out` that hold real tokens, where its first two dims are the mask's (batch,
    length): an encoder-decoder's encoder outputs follow the attention mask, its decoder outputs the
    decoder mask. Outputs of other lengths (image tokens prepended: GIT, ViLT) are compared everywhere."""
    decoder = "decoder_input_ids" in batch and not name.startswith("encoder_")
    mask = batch.get("decoder_attention_mask" if decoder else "attention_mask")
    if mask is None or out.dim() < 3 or tuple(out.shape[:2]) != tuple(mask.shape):
        return None
    return mask.bool().to(out.device)


def blocks(a: torch.Tensor, b: torch.Tensor, keep: torch.Tensor | None):
    """(a, b), same shape, as fp64 blocks of CHUNK rows of their last dim (more where rows are narrow: SPAN
    elements; or one position's rows), in order; where `keep` masks their first two dims (`mask_for`), the
    kept positions only, taken block by block. No fp64 or masked copy of a whole output: fp64 logits (and
    their softmax temporaries) would be several times a big vocabulary's largest weight, and masked copies
    of both sides' logits of a 512-token row are 0.2 GB on GPT-2-medium. An empty output (a cache or router
    slot of width 0) gives none: equal if shaped alike."""
    if not a.numel():
        return
    rows = max(CHUNK, SPAN // a.shape[-1]) if a.dim() else 1
    if keep is None:
        rows_a = a.reshape(-1, a.shape[-1]) if a.dim() > 1 else a.reshape(1, -1)
        pairs = zip(rows_a.split(rows), b.reshape(rows_a.shape).split(rows))
    else:
        flat_a, flat_b = a.flatten(0, 1), b.flatten(0, 1)
        per = max(1, rows // (flat_a[0].numel() // a.shape[-1]))   # positions per block
        where = keep.flatten().nonzero().squeeze(1)
        pairs = ((flat_a[i].reshape(-1, a.shape[-1]), flat_b[i].reshape(-1, a.shape[-1])) for i in where.split(per))
    for x, y in pairs:
        if x.numel():
            yield x.double(), y.double()
