"""How far a converted model is from the original: max |Δ|, relative error, KL on sample inputs."""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn


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


def sample_inputs(model: nn.Module, batch: int = 2, seq: int = 16, seed: int = 0) -> list[dict]:
    """A few deterministic inputs for `model`: token ids (with a padded batch) or pixel values."""
    config = model.config
    g = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    if getattr(model, "main_input_name", "input_ids") == "pixel_values":
        shape = (batch, getattr(config, "num_channels", 3), config.image_size, config.image_size)
        dtype = next(model.parameters()).dtype
        return [{"pixel_values": torch.randn(shape, generator=g).to(device, dtype)}]
    vocab = config.vocab_size
    out = []
    for b, s in ((1, seq), (batch, seq * 2 + 1)):
        ids = torch.randint(0, vocab, (b, s), generator=g)
        mask = torch.ones(b, s, dtype=torch.long)
        if b > 1:
            mask[1:, s // 2:] = 0   # right-padded rows: padding must not matter
        out.append({"input_ids": ids.to(device), "attention_mask": mask.to(device)})
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
