"""Exact LayerNorm -> RMSNorm conversion for pre-LN models: methods "exact" and "auto".

Why it is exact. LN(x) = g*(x - mean x)/sqrt(var x + eps) + b. If every term summed into a norm's input
has zero mean over the normalised dim, the input has mean 0, so var x = mean(x^2) and
LN(x) = RMSNorm_g(x) + b with the same eps. Centring a source changes the norm's input by a constant along
each of its rows, which LN ignores: so each row must hold whole centred groups of every source (not a
concatenation of parts centred apart). What to edit is discovered, not declared: forwards on every sample
input, traced and merged (`trace`), find each norm's sources and readers, and `plan.derive` turns them into
steps:
1. centre the sources along their output dim (per group of channels each norm row covers: per head for
   q/k norms, only the q and k slices of a fused q/k/v projection): Linear (out, in) along dim 0, Conv1D
   (in, out) along dim 1, untied Embedding rows, ConvNd output channels (not grouped ones), parameters
   added to the stream along their last dim (or the dim a product makes channels: stacked expert
   weights), biases included; a per-channel scale (LayerScale, `lambda * x`) folded into its layer first;
2. fold each norm bias into the layers reading that norm, c' = c + W b, creating a zero bias where there
   is none (listed in added_biases); where a reader is not linear, also reads something else, or the
   norm's output is returned, the bias is kept after the norm as an output fix instead.
Arithmetic in float64, results stored in the model's dtype.

Tied embeddings. If lm_head.weight is E, centring E's rows changes the logits by -m_v * sum(y_t)
(m_v: mean of row v, y_t: final norm output): it depends on the vocabulary entry, so it is not a
softmax-invariant per-position shift, and sum(y_t) is not zero for a general gain. So a tied E is left
as is and its *output* is centred at lookup instead (an output fix, see `centring`): the head keeps E,
the tie and the parameter count; the cost is one mean subtraction per input token. Untied embeddings
are centred in place. Inputs passed as `inputs_embeds` must come from `get_input_embeddings()`.

A norm whose output is summed into the stream but read by nothing else (BLOOM's embedding norm, CLIP's
pre_layrnorm) is a stream writer: its output is centred and its centred bias kept after it. A norm whose
output is summed into the stream *and* read by a layer or the output is post-LN: the stream carries
g*x_hat + b, whose mean depends on the input, so no exact form exists and the model is refused, naming
the norm. So is a model whose own output (or any layer) reads the unnormalised stream, and one with a
parameter wide enough to write the stream that no sample input ran (`plan`).

What changes: hidden states inside the model are the centred originals (`not_preserved` lists them, and
a sub-model's returned stream); every other returned output is unchanged.

Verification: no copy of the model is made. Before any weight is edited, the model's outputs on
sample inputs are recorded in fp32 (`parity.reference_outputs`); a source whose outputs are NaN/inf is
refused then, untouched. Then the plan is *rehearsed* as forward hooks on the unedited model (`rehearse`):
above 1e-4 the plan is refused (`auto`: naive, the model untouched). Once the edits are made and the norms
swapped, the converted model runs on the same inputs and a max relative error above TOLERANCE, or any
non-finite output, raises VerificationFailed: 1e-4 for fp32 models; fp16/bf16 models are cast to fp32 in
place for both runs and cast back (a lossless round trip; peak memory is then the fp32 model), and since
their rewritten weights are rounded when stored (measured up to ~7e-4 / ~5e-3) the tolerance is 2e-3 /
2e-2. That failure comes after the edits: the in-memory model stays converted (discard it or reload; the
CLI then converts the source again, naively, under `auto`).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from normswap.errors import NormswapError
from normswap.models.inputs import sample_inputs
from normswap.models.introspect import norm_kind
from normswap.norms import PartialRMSNorm
from normswap.parity import Reference, compare_to, reference_outputs
from normswap.surgery.algebra import centre_outputs, fold_bias, fold_scale
from normswap.surgery.centring import add_input_fix, add_output_fix, describe_fix
from normswap.surgery.methods import ExactSteps, MethodResult, naive
from normswap.surgery.plan import NormPlan, Plan, Step, derive
from normswap.surgery.rehearse import rehearsal
from normswap.surgery.trace import trace
from normswap.surgery.walk import NormSite

TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}
PARTIAL_WARNING = ("pRMSNorm estimates the RMS from a subset of features: biases are folded exactly but the "
                   "result is approximate (verification not enforced)")


class NotExact(NormswapError):
    """The exact conversion cannot be applied to this model (`auto` falls back to naive)."""


class VerificationFailed(NormswapError):
    """The edited model's outputs differ from the original's beyond tolerance (nothing may be saved)."""


def _line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [""])[0]   # errors reach the CLI as one line


def fell_back(reason: Exception | str) -> str:
    """The warning of `auto` when it converts naively instead."""
    return (f"no exact conversion: {reason}; fell back to naive, which drops LayerNorm biases and changes "
            "outputs: measure the change and heal (fine-tune)")


def _refused(sites: list[NormSite], reason: str) -> Plan:
    return Plan({s.name: NormPlan(s.name, s.width, reason=reason) for s in sites}, [])


def plan(model: nn.Module, sites: list[NormSite], inputs: dict | list[dict] | None = None) -> Plan:
    """Trace `model` on `inputs` (default: all its sample inputs, the ones verification uses), merge what
    every forward showed and derive the plan; the plan's `reason` is set where a norm cannot be made exact."""
    if inputs is None:
        try:
            inputs = sample_inputs(model)
        except Exception as e:  # a model sample_inputs cannot feed
            return _refused(sites, f"no sample input to trace it ({_line(e)})")
    norms = {n for n, m in model.named_modules() if isinstance(m, nn.LayerNorm) or norm_kind(m) == "rmsnorm"}
    try:
        t = trace(model, [inputs] if isinstance(inputs, dict) else list(inputs), norms | {s.name for s in sites})
    except Exception as e:  # the forward itself failed: say so instead of a traceback
        return _refused(sites, f"tracing failed: {type(e).__name__}: {_line(e)}")
    try:
        return derive(model, t, sites)
    except Exception as e:  # never an internal error: a refusal that says what failed
        return _refused(sites, f"the exact plan could not be derived ({type(e).__name__}: {_line(e)})")


def not_preserved(model: nn.Module, p: Plan) -> list[str]:
    """Returned outputs an exact conversion cannot keep: the residual stream is centred inside the model."""
    out = [f"{name}: {why}" for name, why in p.not_kept.items()]
    if hasattr(getattr(model, "config", None), "output_hidden_states"):
        out.append("hidden_states (output_hidden_states=True): the residual stream inside the model, returned "
                   "centred (each row minus its mean)")
    return out


def plan_or_naive(method: str, model: nn.Module, sites: list[NormSite], steps: ExactSteps) -> MethodResult:
    """Methods "exact" and "auto" (in memory and streaming alike): steps.apply(model, sites, plan) where
    steps.plan(model, sites) finds the model exact and the plan passes its rehearsal; else refuse ("exact")
    or naive with a warning ("auto"). Any failure before the edits falls back: the model is untouched."""
    try:
        try:
            p = steps.plan(model, sites)
            first, kept = p.reason, keepable(p, sites)
            if kept:   # the other norms may be exact without these: plan them alone, these stay LayerNorm
                retry = steps.plan(model, [s for s in sites if s.name not in kept])
                if retry.reason:
                    kept = {}
                else:
                    sites, p = [s for s in sites if s.name not in kept], retry
        except NormswapError:
            raise
        except Exception as e:
            raise NotExact(f"the exact plan failed ({type(e).__name__}: {_line(e)})") from None
        if p.reason:
            raise NotExact(p.reason)
        try:
            result = steps.apply(model, sites, p)
        except NotExact:   # the rehearsal says keeping them was not enough: the first cause is the true one
            if kept:
                raise NotExact(first) from None
            raise
        result.kept = kept
    except NotExact as e:
        if method == "exact":
            raise NormswapError(f"cannot convert exactly: {e}; alternatives: `method='naive'` (drops the biases; "
                                "heal by fine-tuning) or `method='auto'`") from None
        result = naive(model, sites)
        result.warnings.append(fell_back(e))
        return result
    result.not_preserved, result.unverified = not_preserved(model, p), dict(p.not_kept)
    return result


def keepable(p: Plan, sites: list[NormSite]) -> dict[str, str]:
    """Norms refused for what reaches their own input, which could stay LayerNorms while the others become
    exact RMSNorms: none where the model is post-LN or a parameter never ran (those concern every norm), or
    where every norm is refused. A LayerNorm ignores the mean its input loses when the stream's writers are
    centred, so keeping one is exact whenever the rest of the plan is (the rehearsal checks it)."""
    refused = {n: q.reason for n, q in p.norms.items() if q.reason}
    if p.reasons or not refused or len(refused) >= len(sites) or any("post-LN" in r for r in refused.values()):
        return {}
    # A kept norm whose input is no plain sum (Swin's patch merging: a concatenation along the hidden dim of
    # four positions of the stream) sees every centring of its sources: those stay as they are, so every norm
    # reading one, or writing one, stays a LayerNorm too (Swin: all stages but the last).
    pinned = {label: n for n in refused if p.norms[n].shifted for label in p.norms[n].sources}
    for s in sites:
        q = p.norms[s.name]
        hit = next((lb for lb in [*q.sources, "norm:" + s.name] if lb in pinned), None)
        if s.name not in refused and hit:
            what = "its output" if hit == "norm:" + s.name else f"its input holds {hit.partition(':')[2]}, which"
            refused[s.name] = (f"{what} also reaches {pinned[hit]}, whose input is not a plain sum, so it cannot be "
                               "centred")
    return refused if len(refused) < len(sites) else {}


def install_fixes(model: nn.Module, fixes: dict, inputs: list[str]) -> None:
    """After the swap: the output fixes (centre and/or bias after a module), the input fixes, recorded in
    config.normswap so that loading re-applies them."""
    for name, (centre, bias) in fixes.items():
        add_output_fix(model.get_submodule(name), centre, bias)
    for name in inputs:
        add_input_fix(model.get_submodule(name))
    model.config.normswap["output_fixes"] = {**model.config.normswap.get("output_fixes", {}),
                                             **{n: describe_fix(model.get_submodule(n)) for n in [*fixes, *inputs]}}


class ExactResult(MethodResult):
    """A MethodResult whose `after_swap(model, report)` finishes and verifies the swapped model."""

    def __init__(self, reference: Reference, fixes: dict, inputs: list[str], **kw):
        super().__init__("exact", **kw)
        self.reference, self.fixes, self.inputs = reference, fixes, inputs

    def after_swap(self, model: nn.Module, report) -> None:
        install_fixes(model, self.fixes, self.inputs)
        partial = any(isinstance(model.get_submodule(r.name), PartialRMSNorm) for r in report.converted)
        if partial:
            report.warnings.append(PARTIAL_WARNING)
        report.verification = verify(self.reference, model, enforce=not partial)
        self.reference = None  # free the recorded outputs


@contextmanager
def _fp32_eval(model: nn.Module):
    """Run `model` with its fp16/bf16 tensors in fp32 and in eval mode, in place; restore dtypes and mode.

    fp16/bf16 -> fp32 -> fp16/bf16 is exact, so the model comes back bit-identical without a copy."""
    half = [t for t in [*model.parameters(), *model.buffers()] if t.dtype in (torch.float16, torch.bfloat16)]
    dtypes, training = [t.dtype for t in half], model.training
    try:
        for t in half:
            t.data = t.data.float()
        yield model.eval()
    finally:
        for t, dtype in zip(half, dtypes):
            t.data = t.data.to(dtype)
        model.train(training)


def _reference(model: nn.Module, skip: dict | None = None) -> Reference:
    """The unedited model's fp32 outputs (but the `skip` ones: name -> why, reported as not preserved); a
    source that gives NaN/inf cannot be called exact."""
    with _fp32_eval(model):
        ref = reference_outputs(model, skip=skip)
    if ref.nonfinite:
        raise NormswapError(f"the source model gives {ref.nonfinite} non-finite (NaN/inf) {ref.output} values on "
                            "sample inputs: it is broken, so no conversion of it can be verified as exact")
    return ref


def verify(reference: Reference, model: nn.Module, enforce: bool = True) -> dict:
    """Compare the converted model's outputs with the `reference` recorded before editing, in fp32 and
    eval mode (only the rounding of the rewritten weights counts); NormswapError beyond TOLERANCE (when
    `enforce`) and on any non-finite output (always)."""
    dtype = next(model.parameters()).dtype
    with _fp32_eval(model):
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


def output_fix(model: nn.Module, step: Step) -> tuple[bool, torch.Tensor | None]:
    """(centre, bias kept after the module) of a fix step; the norm's bias is read now, before the swap."""
    b = None if not step.norm else model.get_submodule(step.norm).bias.detach().double()
    return step.centre, None if b is None else b - b.mean() if step.centre else b


def bias_fates(p: Plan) -> dict[str, str]:
    """Per norm, what the report says of its bias."""
    return {n: "folded" if q.bias in ("fold", "after", "stream") else "none" for n, q in p.norms.items()}


def rehearse(model: nn.Module, sites: list[NormSite], p: Plan, reference: Reference) -> None:
    """Run the plan as hooks on the unedited model (`rehearse.rehearsal`) against the reference; NotExact
    (the model untouched) if it is not exact to the fp32 tolerance: then the trace missed something."""
    try:
        with _fp32_eval(model), rehearsal(model, sites, p, set(p.uncalled), output_fix):
            parity = compare_to(reference, model)
    except Exception as e:
        raise NotExact(f"the plan could not be rehearsed ({type(e).__name__}: {_line(e)})") from None
    tol = TOLERANCE[torch.float32]
    if not parity.finite or not parity.max_rel <= tol:
        raise NotExact(f"the traced plan failed verification before any edit (max relative "
                       f"{parity.worst or parity.output} error "
                       f"{parity.max_rel:.2e} > {tol:g}): the model does something the trace does not see")


@torch.no_grad()
def convert_exact(model: nn.Module, sites: list[NormSite], p: Plan) -> ExactResult:
    reference = _reference(model, p.not_kept)   # before any edit: outputs, not a copy
    rehearse(model, sites, p, reference)
    fixes: dict[str, tuple[bool, torch.Tensor | None]] = {}
    added: list[str] = []
    inputs: list[str] = []   # blocks whose first input is centred
    for step in p.steps:
        if step.op == "centre":
            centre_outputs(model, step.target, step.group, step.ranges, step.axis)
        elif step.op == "fold":
            b = model.get_submodule(step.norm).bias.detach().double()
            added += [step.target] if fold_bias(model.get_submodule(step.target), b) else []
        elif step.op == "scale":
            fold_scale(model, step.target, step.norm)
        elif step.norm == "input":
            inputs.append(step.target)
        else:   # output fixes wait for the swap
            fixes[step.target] = output_fix(model, step)
    return ExactResult(reference, fixes, inputs, bias=bias_fates(p), added_biases=added)


class InMemory:
    """The exact method's steps on a model in memory: trace it, edit its weights (see `ExactSteps`)."""

    def plan(self, model: nn.Module, sites: list[NormSite]) -> Plan:
        return plan(model, sites)

    def apply(self, model: nn.Module, sites: list[NormSite], p: Plan) -> MethodResult:
        return convert_exact(model, sites, p)


def exact(model: nn.Module, sites: list[NormSite], steps: ExactSteps | None = None) -> MethodResult:
    """Function-preserving: centre the residual writers, fold norm biases, verify after the swap."""
    return plan_or_naive("exact", model, sites, steps or InMemory())


def auto(model: nn.Module, sites: list[NormSite], steps: ExactSteps | None = None) -> MethodResult:
    """exact where the trace shows it possible, otherwise naive with a warning."""
    return plan_or_naive("auto", model, sites, steps or InMemory())
