"""How far a converted model is from the original: max |Δ|, relative error, KL on sample inputs."""
from __future__ import annotations

import inspect
from dataclasses import asdict, dataclass

import torch
from torch import nn

from normswap.errors import NormswapError


@dataclass
class Parity:
    max_abs: float       # max |Δ output| over all positions
    max_rel: float       # max |Δ output| / max |reference output|
    kl: float | None     # mean KL(reference || converted) per token, for models with logits
    output: str          # which output was compared

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        kl = f", KL {self.kl:.3e}" if self.kl is not None else ""
        return f"parity vs original ({self.output}): max |Δ| {self.max_abs:.3e}, rel {self.max_rel:.3e}{kl}"


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
    limits = [v for k in keys if isinstance(v := _cfg(config, k), int)]
    return min([seq, *limits])


def sample_inputs(model: nn.Module, batch: int = 2, seq: int = 16, seed: int = 0) -> list[dict]:
    """A few deterministic inputs built from `model`'s signature and config: token ids (with a
    right-padded batch), pixel values, Whisper-style log-mel features, and decoder ids for
    encoder-decoders (starting with decoder_start_token_id)."""
    config = model.config
    g = torch.Generator().manual_seed(seed)
    ref = next(model.parameters())
    device, dtype = ref.device, ref.dtype if ref.is_floating_point() else torch.float32
    params = inspect.signature(model.forward).parameters
    main = getattr(model, "main_input_name", "input_ids")
    if main not in ("input_ids", "pixel_values", "input_features"):
        raise NormswapError(f"cannot build sample inputs for a model whose main input is '{main}'")
    text = "input_ids" in params and main == "input_ids"
    # CLIP-like: text and image side by side (not a model that splices image tokens into the text)
    two_towers = ("pixel_values" in params and _cfg(config, "image_size") is not None
                  and all(getattr(config, k, None) is None for k in ("image_token_id", "image_token_index")))
    if main == "input_features" and _cfg(config, "num_mel_bins") is None:
        raise NormswapError("cannot build sample inputs: input_features without num_mel_bins (not Whisper-like)")
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
        if main == "input_features":   # Whisper: (batch, mel bins, 2 * encoder positions)
            frames = 2 * _cfg(config, "max_source_positions", 1500)
            x["input_features"] = torch.randn(b, _cfg(config, "num_mel_bins"), frames, generator=g).to(dtype)
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
def compare(reference: nn.Module, model: nn.Module, inputs: list[dict] | None = None) -> Parity:
    """Run both models on the same inputs; compare main outputs on the unpadded positions."""
    inputs = inputs if inputs is not None else sample_inputs(reference)
    max_abs = ref_max = 0.0
    kls: list[torch.Tensor] = []
    name = "output"
    for batch in inputs:
        name, a = main_output(reference(**batch))
        _, b = main_output(model(**batch))
        a, b = a.double(), b.double()
        if "attention_mask" in batch and a.dim() == 3:
            keep = batch["attention_mask"].bool()
            a, b = a[keep], b[keep]
        max_abs = max(max_abs, (a - b).abs().max().item())
        ref_max = max(ref_max, a.abs().max().item())
        if name == "logits":
            la, lb = a.log_softmax(-1), b.log_softmax(-1)
            kls.append((la.exp() * (la - lb)).sum(-1).flatten())
    kl = torch.cat(kls).mean().item() if kls else None
    return Parity(max_abs, max_abs / max(ref_max, 1e-30), kl, name)
