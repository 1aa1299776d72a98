"""How far a converted model is from the original: max |Δ|, relative error, KL on sample inputs."""
from __future__ import annotations

import inspect
import math
from dataclasses import asdict, dataclass

import torch
from torch import nn

from normswap.errors import NormswapError


@dataclass
class Parity:
    max_abs: float       # max |Δ output| over all positions (NaN when either side is non-finite)
    max_rel: float       # max |Δ output| / max |reference output|
    kl: float | None     # mean KL(reference || converted) per token, for models with logits
    output: str          # which output was compared
    ref_nonfinite: int = 0   # NaN/inf values in the reference's outputs
    nonfinite: int = 0       # NaN/inf values in the compared model's outputs

    @property
    def finite(self) -> bool:
        return not (self.ref_nonfinite or self.nonfinite)

    def to_dict(self) -> dict:  # NaN -> None: the CLI's --json must stay valid JSON
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(self).items()}

    def __str__(self) -> str:
        if not self.finite:
            return (f"parity vs original ({self.output}): NON-FINITE outputs: {self.nonfinite} NaN/inf in the "
                    f"converted model, {self.ref_nonfinite} in the original; no comparison possible")
        kl = f", KL {self.kl:.3e}" if self.kl is not None else ""
        return f"parity vs original ({self.output}): max |Δ| {self.max_abs:.3e}, rel {self.max_rel:.3e}{kl}"


@dataclass
class Reference:
    """A model's main outputs on sample inputs, kept instead of a copy of the model (see `reference_outputs`)."""
    inputs: list[dict]
    outputs: list[torch.Tensor]
    output: str          # name of the main output

    @property
    def nonfinite(self) -> int:
        return sum(int((~o.isfinite()).sum()) for o in self.outputs)


def _cfg(config, key: str, default=None):
    """config.key, else the same key in its text/vision/encoder/decoder sub-configs."""
    for c in (config, *(getattr(config, k, None) for k in ("text_config", "vision_config", "encoder", "decoder"))):
        if c is not None and getattr(c, key, None) is not None:
            return getattr(c, key)
    return default


def _ids(config, shape, g, start: int | None = None) -> torch.Tensor:
    ids = torch.randint(0, _cfg(config, "vocab_size"), shape, generator=g)
    if start is not None:
        ids[:, 0] = start
    return ids


def _length(config, seq: int, *keys: str) -> int:
    limits = [v for k in keys if isinstance(v := _cfg(config, k), int) and v > 0]   # XLNet: -1, no limit
    return min([seq, *limits])


def sample_inputs(model: nn.Module, batch: int = 2, seq: int = 16, seed: int = 0) -> list[dict]:
    """A few deterministic inputs built from `model`'s signature and config: token ids (with a
    right-padded batch), pixel values, Whisper- or Speech2Text-style features, wav2vec2-style waveforms,
    and decoder ids for encoder-decoders (starting with decoder_start_token_id)."""
    config = model.config
    g = torch.Generator().manual_seed(seed)
    ref = next(model.parameters())
    device, dtype = ref.device, ref.dtype if ref.is_floating_point() else torch.float32
    params = inspect.signature(model.forward).parameters
    main = getattr(model, "main_input_name", "input_ids")
    if main not in ("input_ids", "pixel_values", "input_features", "input_values"):
        raise NormswapError(f"cannot build sample inputs for a model whose main input is '{main}'")
    if main == "input_values" and not (_cfg(config, "conv_kernel") and _cfg(config, "conv_stride")):
        raise NormswapError("cannot build sample inputs: input_values without conv_kernel/conv_stride "
                            "(not wav2vec2-like)")
    text = "input_ids" in params and main == "input_ids"
    # CLIP-like: text and image side by side (not a model that splices image tokens into the text)
    two_towers = ("pixel_values" in params and _cfg(config, "image_size") is not None
                  and all(getattr(config, k, None) is None for k in ("image_token_id", "image_token_index")))
    if main == "input_features" and _cfg(config, "num_mel_bins") is None and \
            _cfg(config, "input_feat_per_channel") is None:
        raise NormswapError("cannot build sample inputs: input_features without num_mel_bins (Whisper) or "
                            "input_feat_per_channel (Speech2Text)")
    seq2seq = bool(getattr(config, "is_encoder_decoder", False)) and "decoder_input_ids" in params
    n = _length(config, seq * 2 + 1, "max_position_embeddings", "n_positions")
    out = []
    # a single and a padded batch where there is text or a decoder; one batch of images or audio otherwise
    for b, s in ((1, seq), (batch, n)) if text or seq2seq else ((batch, seq),):
        s = min(s, n)
        x: dict = {}
        if text:
            x["input_ids"] = _ids(config, (b, s), g)
            x["attention_mask"] = torch.ones(b, s, dtype=torch.long)
            if b > 1:
                x["attention_mask"][1:, s // 2:] = 0   # right-padded rows: padding must not matter
        if main == "pixel_values" or two_towers:
            size = _cfg(config, "image_size")
            h, w = (size, size) if isinstance(size, int) else tuple(size)[-2:]
            x["pixel_values"] = torch.randn(b, _cfg(config, "num_channels", 3), h, w, generator=g).to(dtype)
        if main == "input_features" and _cfg(config, "num_mel_bins") is not None:
            # Whisper: (batch, mel bins, 2 * encoder positions)
            frames = 2 * _cfg(config, "max_source_positions", 1500)
            x["input_features"] = torch.randn(b, _cfg(config, "num_mel_bins"), frames, generator=g).to(dtype)
        elif main == "input_features":   # Speech2Text: (batch, frames, features), frames halved per conv
            frames = 2 ** _cfg(config, "num_conv_layers", 2) * _length(config, s, "max_source_positions")
            width = _cfg(config, "input_feat_per_channel") * _cfg(config, "input_channels", 1)
            x["input_features"] = torch.randn(b, frames, width, generator=g).to(dtype)
        if main == "input_values":   # wav2vec2: a waveform the conv feature encoder turns into s frames
            n = s
            for k, st in reversed(list(zip(_cfg(config, "conv_kernel"), _cfg(config, "conv_stride")))):
                n = (n - 1) * st + k
            x["input_values"] = torch.randn(b, n, generator=g).to(dtype)
        if seq2seq:   # as long as the encoder input: compare's mask then covers both
            start = getattr(config, "decoder_start_token_id", None)
            d = _length(config, s, "max_target_positions", "max_position_embeddings")
            x["decoder_input_ids"] = _ids(config, (b, d), g, start)
            if d != s:
                x.pop("attention_mask", None)
        out.append({k: v.to(device) for k, v in x.items()})
    return out


def main_output(out) -> tuple[str, torch.Tensor]:
    """(name, tensor) of a model's main output: logits, else last_hidden_state, else the first one."""
    for key in ("logits", "last_hidden_state"):
        if getattr(out, key, None) is not None:
            return key, getattr(out, key)
    return "output", out[0]


@torch.no_grad()
def reference_outputs(model: nn.Module, inputs: list[dict] | None = None) -> Reference:
    """Run `model` on `inputs` (default: `sample_inputs`) and keep its main outputs, detached.

    Take it before editing the weights; `compare_to` later needs only this, not a copy of the model.
    """
    inputs = inputs if inputs is not None else sample_inputs(model)
    name, outs, used = "output", [], []
    for batch in inputs:
        try:
            runs = [(batch, model(**batch))]
        except Exception:
            # Some heads take one row at a time (GPT-2 classifiers without a pad token): the rows alone
            rows = _rows(batch)
            if rows is None:
                raise
            runs = [(row, model(**row)) for row in rows]
        for x, result in runs:
            name, out = main_output(result)
            used.append(x)
            outs.append(out.detach().clone())  # clone: never a view into the model's own buffers
    return Reference(used, outs, name)


def _rows(batch: dict) -> list[dict] | None:
    """A batch of several rows as one-row batches; None if it is one row already."""
    sizes = {v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor) and v.dim()}
    if len(sizes) != 1 or (n := sizes.pop()) < 2:
        return None
    return [{k: v[i:i + 1] if isinstance(v, torch.Tensor) and v.dim() else v for k, v in batch.items()}
            for i in range(n)]


@torch.no_grad()
def compare_to(reference: Reference, model: nn.Module) -> Parity:
    """Run `model` on the reference's inputs; compare main outputs on the unpadded positions.

    Non-finite outputs are counted on either side (Python's max would hide a NaN), never compared.
    """
    max_abs = ref_max = torch.zeros((), dtype=torch.float64)
    kls: list[torch.Tensor] = []
    bad_ref = bad = 0
    for batch, ref in zip(reference.inputs, reference.outputs):
        _, out = main_output(model(**batch))
        out = out.to(ref.device)
        if "attention_mask" in batch and ref.dim() == 3:
            keep = batch["attention_mask"].bool().to(ref.device)
            ref, out = ref[keep], out[keep]
        # fp64 a few positions at a time: whole fp64 logits (and their softmax temporaries) would be
        # several times the size of a big-vocabulary model's largest weight.
        for a, b in zip(ref.split(8), out.split(8)):
            a, b = a.double(), b.double()
            bad_ref += int((~a.isfinite()).sum())
            bad += int((~b.isfinite()).sum())
            max_abs = torch.maximum(max_abs, (a - b).abs().max().cpu())   # torch.maximum propagates NaN
            ref_max = torch.maximum(ref_max, a.abs().max().cpu())
            if reference.output == "logits":
                la, lb = a.log_softmax(-1), b.log_softmax(-1)
                kls.append((la.exp() * (la - lb)).sum(-1).flatten())
    kl = torch.cat(kls).mean().item() if kls else None
    max_abs, ref_max = max_abs.item(), ref_max.item()
    if bad_ref or bad:
        max_abs = kl = float("nan")
    return Parity(max_abs, max_abs / max(ref_max, 1e-30) if math.isfinite(max_abs) else float("nan"), kl,
                  reference.output, bad_ref, bad)


def refuse_nonfinite(parity: Parity) -> None:
    """Never save a model that gives NaN/inf: one line saying how many, on both sides."""
    if parity.nonfinite:
        raise NormswapError(f"the converted model gives {parity.nonfinite} non-finite (NaN/inf) {parity.output} "
                            f"values on sample inputs (the original: {parity.ref_nonfinite}); nothing was saved")


def compare(reference: nn.Module, model: nn.Module, inputs: list[dict] | None = None) -> Parity:
    """Run both models on the same inputs (default: `sample_inputs(reference)`) and compare."""
    return compare_to(reference_outputs(reference, inputs), model)
