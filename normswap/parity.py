"""How far a converted model is from the original: max |Δ|, relative error, KL on sample inputs."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import nn

from normswap.errors import NormswapError
from normswap.models.inputs import sample_inputs


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
            rows = batch_rows(batch)
            if rows is None:
                raise
            runs = [(row, model(**row)) for row in rows]
        for x, result in runs:
            name, out = main_output(result)
            used.append(x)
            outs.append(out.detach().clone())  # clone: never a view into the model's own buffers
    return Reference(used, outs, name)


def batch_rows(batch: dict) -> list[dict] | None:
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
