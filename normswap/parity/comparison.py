"""The comparison: a model run on a reference's inputs, each recorded output compared block by block on its own
scale, non-finite values counted on either side, into one `Parity`."""
from __future__ import annotations

import math

import torch
from torch import nn

from normswap.io.spill import Spill
from normswap.parity.kl import nonnegative, token_kl
from normswap.parity.outputs import floating_outputs
from normswap.parity.reference import Reference, reading, reference_outputs, run, skipped
from normswap.parity.result import Parity
from normswap.parity.rows import blocks, mask_for


@torch.no_grad()
def compare_to(reference: Reference, model: nn.Module, skip: dict | None = None) -> Parity:
    """Run `model` on the reference's inputs; compare every recorded output, on the unpadded positions.

    Each output gets its own max |Δ| and relative error; the Parity's max_abs / max_rel are the worst
    output's. An output missing or of another shape counts as an infinite error. Non-finite outputs are
    counted on either side (Python's max would hide a NaN), never compared. Outputs `skip` names (name ->
    why) are not compared and are listed in the Parity's `excluded`.
    """
    tally = Tally(reference.output == "logits")
    for i, (batch, ref) in enumerate(zip(reference.inputs, reference.outputs)):
        got, _ = floating_outputs(run(model, batch, i))
        for name, a in ref.items():
            b = got.pop(name, None)   # each freed once compared: not all of a long row's outputs at once
            if not skipped(name, skip):
                with reading(a) as (values, drop):
                    tally.add(name, batch, values, b, drop)
            del b
    outputs = {n: {"max_abs": d.item(), "max_rel": rel(d.item(), r.item())} for n, (d, r) in tally.stats.items()}
    kl = nonnegative(torch.cat(tally.kls).mean().item()) if tally.kls else None
    if tally.bad_ref or tally.bad:
        kl = float("nan")
        outputs = {n: {"max_abs": float("nan"), "max_rel": float("nan")} for n in outputs}
    worst = max(outputs, key=lambda n: order(outputs[n]["max_rel"]), default=reference.output)
    w = outputs.get(worst, {"max_abs": 0.0, "max_rel": 0.0})
    excluded = {**reference.excluded, **{n: skipped(n, skip) for o in reference.outputs for n in o
                                         if skipped(n, skip)}}
    return Parity(w["max_abs"], w["max_rel"], kl, reference.output, tally.bad_ref, tally.bad, worst, outputs,
                  excluded)


class Tally:
    """What `compare_to` keeps as it goes: per output [max |Δ|, max |reference|] (fp64 scalars), the
    per-token KL of the main logits (`kl`: they are the main output), non-finite counts on either side."""

    def __init__(self, kl: bool):
        self.kl = kl
        self.stats: dict[str, list[torch.Tensor]] = {}
        self.kls: list[torch.Tensor] = []
        self.bad_ref = self.bad = 0

    def add(self, name: str, batch: dict, a: torch.Tensor, b: torch.Tensor | None, drop) -> None:
        """Compare output `name` of `batch`: `a` the reference's, `b` the model's (None: missing); `drop()`
        after each block (`reading`: a spilled reference's pages are not all resident at once)."""
        st = self.stats.setdefault(name, [torch.zeros((), dtype=torch.float64)] * 2)
        if b is None or b.shape != a.shape:
            st[0] = torch.tensor(math.inf, dtype=torch.float64)
            return
        for x, y in blocks(a, b.to(a.device), mask_for(name, batch, a)):
            self.bad_ref += int((~x.isfinite()).sum())
            self.bad += int((~y.isfinite()).sum())
            st[0] = torch.maximum(st[0], (x - y).abs().max().cpu())   # torch.maximum propagates NaN
            st[1] = torch.maximum(st[1], x.abs().max().cpu())
            if self.kl and name == "logits":
                self.kls.append(token_kl(x.log_softmax(-1), y.log_softmax(-1)).flatten())
            drop()


def rel(d: float, r: float) -> float:
    return d / max(r, 1e-30) if math.isfinite(d) else d


def order(v: float) -> float:
    return math.inf if v != v else v   # NaN sorts worst


def compare(reference: nn.Module, model: nn.Module, inputs: list[dict] | None = None,
            skip: dict | None = None, spill: Spill | None = None) -> Parity:
    """Run both models on the same inputs (default: `model_inputs(reference)`) and compare (but `skip`);
    the reference's outputs kept in `spill`, if given (`reference_outputs`)."""
    return compare_to(reference_outputs(reference, inputs, skip, spill), model)
