"""Verification of an exact conversion: the unedited model's outputs recorded, the converted model's compared
with them, and one rule for when the tolerance is enforced (`enforced`), in memory and lazily alike.

Both runs are in fp32 and eval mode: fp16/bf16 models are cast to fp32 in place and cast back (a lossless
round trip, no copy), so only the rounding of the rewritten weights counts (measured up to ~7e-4 / ~5e-3),
hence a tolerance of 1e-4 for fp32 models and 2e-3 / 2e-2 for fp16 / bf16 ones.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from normswap.errors import NormswapError
from normswap.models.inputs.examples import model_inputs
from normswap.models.modes import eval_mode
from normswap.norms import NormType
from normswap.parity import Parity, Reference, compare_to, grouped, reference_outputs
from normswap.surgery.labels import Cause, NotExact, Refusal

TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}
PARTIAL_WARNING = ("pRMSNorm estimates the RMS from a subset of features: biases are folded exactly but the "
                   "result is approximate (verification not enforced)")


class VerificationFailed(NotExact):
    """The edited model's outputs differ from the original's beyond tolerance (nothing may be saved): a refusal
    (`Cause.UNVERIFIED`) that comes after the edits, so `auto` falls back only where it can start again from the
    source (a checkpoint)."""

    def __init__(self, text: str):
        super().__init__(Refusal(Cause.UNVERIFIED, text))


def enforced(report) -> bool:
    """The one verification rule: a conversion to RMSNorm must match within TOLERANCE; pRMSNorm estimates the
    RMS from a subset of features, so its error is measured and reported, not enforced."""
    return report.to == NormType.RMSNORM


@contextmanager
def fp32_eval(model: nn.Module):
    """Run `model` with its fp16/bf16 tensors in fp32 and in eval mode, in place; restore dtypes and modes.

    fp16/bf16 -> fp32 -> fp16/bf16 is exact, so the model comes back bit-identical without a copy."""
    half = [t for t in [*model.parameters(), *model.buffers()] if t.dtype in (torch.float16, torch.bfloat16)]
    dtypes = [t.dtype for t in half]
    try:
        for t in half:
            t.data = t.data.float()
        with eval_mode(model):
            yield model
    finally:
        for t, dtype in zip(half, dtypes):
            t.data = t.data.to(dtype)


def broken_source(nonfinite: int, outputs: str, converted: str = "") -> NormswapError:
    """The refusal for a source model whose own outputs hold `nonfinite` NaN/inf values (in `outputs`): no
    conversion of it can be checked, whatever the converted model gives (`converted`: said after)."""
    return NormswapError(f"the source model gives {nonfinite} non-finite (NaN/inf) {outputs} values on sample "
                         f"inputs: it is broken, so no conversion of it can be checked{converted}")


def refuse_nonfinite(parity: Parity) -> None:
    """Never save a model compared with a source that gives NaN/inf (the source is at fault: said so), nor one that
    gives NaN/inf itself: one line saying how many, on both sides."""
    if parity.ref_nonfinite:
        raise broken_source(parity.ref_nonfinite, grouped(parity.outputs) or parity.output,
                            f" (the converted model: {parity.nonfinite}); nothing was saved")
    if parity.nonfinite:
        raise NormswapError(f"the converted model gives {parity.nonfinite} non-finite (NaN/inf) "
                            f"{grouped(parity.outputs) or parity.output} values on sample inputs (the original: "
                            "none); nothing was saved")


def reference(model: nn.Module, skip: dict | None = None, examples=None) -> Reference:
    """The unedited model's fp32 outputs on its samples and the user's `examples` (but the `skip` outputs:
    name -> why, reported as not preserved); a source that gives NaN/inf cannot be called exact."""
    with fp32_eval(model):
        ref = reference_outputs(model, model_inputs(model, examples), skip=skip)
    if ref.nonfinite:
        raise broken_source(ref.nonfinite, ref.output)
    return ref


def verify(reference: Reference, model: nn.Module, enforce: bool = True) -> dict:
    """Compare the converted model's outputs with the `reference` recorded before editing, in fp32 and
    eval mode (only the rounding of the rewritten weights counts); NormswapError beyond TOLERANCE (when
    `enforce`) and on any non-finite output (always)."""
    dtype = next(model.parameters()).dtype
    with fp32_eval(model):
        parity = compare_to(reference, model)
    if parity.nonfinite:
        raise VerificationFailed(f"exact conversion failed verification: the converted model gives {parity.nonfinite} "
                            f"non-finite (NaN/inf) {parity.output} values; nothing was saved")
    return judge(parity, dtype, enforce)


def judge(parity, dtype: torch.dtype, enforce: bool) -> dict:
    """The verification record of a finished comparison; NormswapError beyond TOLERANCE when `enforce`."""
    tol = TOLERANCE.get(dtype, 1e-4)
    if enforce and not parity.max_rel <= tol:  # also catches NaN
        raise VerificationFailed(f"exact conversion failed verification: max relative "
                                 f"{parity.worst or parity.output} error "
                            f"{parity.max_rel:.2e} > {tol:g} ({str(dtype)[6:]}); nothing was saved")
    return {**parity.to_dict(), "dtype": str(dtype)[6:], "tolerance": tol, "enforced": enforce}
