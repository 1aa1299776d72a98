"""Token inputs: ids (never a special id such as an image token by chance), padded attention masks, token
types, layout boxes, language ids, decoder ids, and ids of shape (batch x codebooks, length) for
multi-codebook audio."""
from __future__ import annotations

import torch
from torch import nn

from normswap.models.inputs.context import DECODER, TEXT, Ctx, nested_configs

# special ids sample text may contain; every other *_token_id / *_token_index (image, video, audio, boi...)
# switches a path on and is placed on purpose, never drawn by chance
ORDINARY = {"pad_token_id", "bos_token_id", "eos_token_id", "unk_token_id", "sep_token_id", "cls_token_id",
            "decoder_start_token_id", "mask_token_id"}
LONGEST = 512   # the cap on the longest sample row (`longest`; see `models.inputs`)


def special_ids(ctx: Ctx) -> set[int]:
    out = set()
    for c in nested_configs(ctx.config):
        for k, v in vars(c).items():
            if k.endswith(("_token_id", "_token_index", "_token_ids")) and k not in ORDINARY:
                out |= {i for i in (v if isinstance(v, (list, tuple)) else [v]) if isinstance(i, int)}
    return out


def vocab(ctx: Ctx, decoder: bool = False) -> int:
    v = ctx.integer("vocab_size", prefer=DECODER if decoder else TEXT)
    if v is None and ctx.integer("num_hash_buckets") is not None:   # CANINE reads code points: ASCII ones
        return 128
    if v is None:
        raise ctx.refuse("token ids need a vocabulary size (no `vocab_size` in the config)")
    return v


def ids(ctx: Ctx, shape, decoder: bool = False, n: int | None = None) -> torch.Tensor:
    """Random ids below the vocabulary size (or n), avoiding the ids that switch paths on (image tokens...)."""
    n = n or vocab(ctx, decoder)
    avoid = torch.tensor(sorted(i for i in special_ids(ctx) if 0 <= i < n), dtype=torch.long)
    allowed = torch.arange(n)[~torch.isin(torch.arange(n), avoid)] if len(avoid) else torch.arange(n)
    return allowed[ctx.randint(len(allowed), shape)]


def limits(ctx: Ctx, decoder: bool = False) -> list[int]:
    """The positions the text (or decoder) side can take, as its config states them (none: no stated limit)."""
    keys = ("max_target_positions", "max_position_embeddings", "n_positions", "max_text_len") if decoder else \
        ("max_position_embeddings", "n_positions", "max_text_len", "max_source_positions")
    return [v for k in keys if (v := ctx.integer(k, prefer=DECODER if decoder else TEXT)) is not None]


def length(ctx: Ctx, s: int, decoder: bool = False) -> int:
    """s, capped by the positions the text (or decoder) side can take."""
    return max(2, min([s, *limits(ctx, decoder)]))


def longest(ctx: Ctx) -> int | None:
    """The longest row the text side takes, up to LONGEST; None where its config states no limit. A position
    table with a padding row as large as the limit (RoBERTa's) numbers positions from padding_idx + 1, so
    that many fewer fit."""
    stated = limits(ctx)
    if not stated:
        return None
    n = min(stated)
    pads = [m.padding_idx for m in (ctx.module.modules() if ctx.module is not None else ())
            if isinstance(m, nn.Embedding) and m.num_embeddings == n and m.padding_idx is not None]
    return max(2, min(LONGEST, n - 1 - max(pads, default=-1)))


def padded_mask(b: int, s: int, padded: bool) -> torch.Tensor:
    """Ones; with `padded`, every row after the first is right-padded to half its length."""
    mask = torch.ones(b, s, dtype=torch.long)
    if padded and b > 1:
        mask[1:, max(1, s // 2):] = 0
    return mask


def codebooks(ctx: Ctx, decoder: bool) -> int:
    """Multi-codebook audio (MusicGen): ids of shape (batch x codebooks, length); else 1."""
    config = getattr(ctx.config, "decoder", None) if decoder else ctx.config
    k = getattr(config, "num_codebooks", None) if config is not None else None
    return k if isinstance(k, int) and k > 1 else 1


def text(ctx: Ctx, x: dict, b: int, s: int, padded: bool) -> None:
    """input_ids, attention_mask (right-padded rows), token_type_ids (two segments), bbox, as the forward
    takes them."""
    k = codebooks(ctx, decoder=False)
    x["input_ids"] = ids(ctx, (b * k, s))
    if ctx.has("attention_mask"):
        x["attention_mask"] = padded_mask(b, s, padded)
        pad = ctx.integer("pad_token_id", prefer=TEXT, minimum=0)
        if padded and pad is not None and pad < vocab(ctx) and k == 1:   # padded positions hold the pad id
            x["input_ids"] = x["input_ids"].masked_fill(x["attention_mask"] == 0, pad)
    types = ctx.integer("type_vocab_size", prefer=TEXT, default=0)
    if ctx.has("token_type_ids") and types > 1:   # a second segment from a random point in each row
        split = ctx.randint(max(2, s), (b, 1), low=1)
        x["token_type_ids"] = (torch.arange(s)[None] >= split).long()
    if ctx.has("bbox"):
        x["bbox"] = boxes(ctx, b, s)
    languages = ctx.value("languages")
    if ctx.has("lang_ids") and isinstance(languages, (list, tuple)) and languages:   # X-MOD: each row's adapter
        x["lang_ids"] = torch.arange(b) % len(languages)


def boxes(ctx: Ctx, b: int, s: int) -> torch.Tensor:
    """Layout boxes (LayoutLM family: integer x0, y0, x1, y1 with x0 <= x1, y0 <= y1; Bros: floats in [0, 1])."""
    dim = ctx.integer("dim_bbox", default=4)
    if dim != 4:
        return ctx.rand(b, s, dim)
    top = min(1000, ctx.integer("max_2d_position_embeddings", prefer=TEXT, default=1024))
    c = ctx.randint(top, (b, s, 2, 2)).sort(dim=-1).values    # (x, y) x (low, high)
    return torch.stack([c[..., 0, 0], c[..., 1, 0], c[..., 0, 1], c[..., 1, 1]], dim=-1)


def decoder(ctx: Ctx, x: dict, b: int, s: int) -> None:
    """decoder_input_ids starting with decoder_start_token_id, for encoder-decoders."""
    d = length(ctx, s, decoder=True)
    k = codebooks(ctx, decoder=True)
    x["decoder_input_ids"] = ids(ctx, (b * k, d), decoder=True)
    start = ctx.integer("decoder_start_token_id", prefer=DECODER, minimum=0)
    if start is not None and start < vocab(ctx, decoder=True):
        x["decoder_input_ids"][:, 0] = start


def side_text(ctx: Ctx, x: dict, b: int, s: int, padded: bool) -> None:
    """Required ids of a side model named by the input (`qformer_input_ids` from `qformer_config`)."""
    for name in ctx.required():
        side = getattr(ctx.config, name.removesuffix("_input_ids") + "_config", None)
        n = getattr(side, "vocab_size", None)
        if name.endswith("_input_ids") and name not in x and isinstance(n, int):
            x[name] = ids(ctx, (b, s), n=n)
            if ctx.has(mask := name.replace("_input_ids", "_attention_mask")):
                x[mask] = padded_mask(b, s, padded)
