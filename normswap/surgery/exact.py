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
   and persistent buffers added to the stream along their last dim (or the dim a product makes channels:
   stacked expert weights), biases included; a per-channel scale (LayerScale, `lambda * x`) folded into its layer first;
2. fold each norm bias into the layers reading that norm, c' = c + W b, creating a zero bias where there
   is none (listed in added_biases: a bias-less LM head's, tied or not); where a reader is not linear,
   also reads something else, or the norm's output is returned (a headless model's final norm), the bias is
   kept after the norm as an output fix instead.
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
parameter or buffer wide enough to write the stream that no sample input ran (`plan`).

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
2e-2. That failure comes after the edits: the in-memory model is put back as it was (`undo`: the originals of only
what the plan edits, kept before the edits) and, under `auto`, converted naively instead (`auto_or_naive`, the
one fallback; a folder converted lazily is converted again from the source).

The plan's steps are carried out by `interpret` (in memory here; recorded per layer for the lazy
writer in `pipeline.lazy_convert`), and checked by `verification`.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch import nn

from normswap.errors import FellBackToNaive, first_line, warn_caller
from normswap.models.inputs.examples import NoInputs, model_inputs
from normswap.models.introspect import norm_kind
from normswap.parity import Reference, compare_to
from normswap.surgery import verification
from normswap.surgery.interpret import ExactResult, interpret
from normswap.surgery.methods import ExactSteps, Method, MethodResult, naive
from normswap.surgery.labels import Cause, NotExact, Refusal
from normswap.surgery.plan import NormPlan, Plan, derive, keepable
from normswap.surgery.rehearse import rehearsal
from normswap.surgery.steps import Step
from normswap.surgery.trace import ForwardFailed, trace
from normswap.surgery.undo import Undo
from normswap.surgery.verification import TOLERANCE, VerificationFailed, fp32_eval, verify
from normswap.surgery.walk import NormSite

__all__ = ["NotExact", "Step", "TOLERANCE", "VerificationFailed", "auto", "auto_or_naive", "exact", "fell_back",
           "not_preserved", "plan", "plan_or_naive", "verify"]   # re-exported: the plan's steps, and its check
T = TypeVar("T")


def fell_back(reason: Exception | str) -> str:
    """The warning of `auto` when it converts naively instead."""
    return (f"no exact conversion: {reason}; fell back to naive, which drops LayerNorm biases and changes "
            "outputs: measure the change and heal (fine-tune)")


def auto_or_naive(method: str, attempt: Callable[[], T], fallback: Callable[[], T],
                  warnings: Callable[[T], list[str]]) -> T:
    """The one auto -> naive fallback (a model in memory, its plan, a lazily converted folder, a reloaded source):
    `attempt()`; where it raises NotExact (a typed refusal: no exact form here, because ...) under method "auto",
    `fallback()` (naive, on an untouched model: the caller's to provide) with the warning saying why in
    `warnings(result)`, and raised as a Python warning (`FellBackToNaive`) where the caller sees it. Under any
    other method the refusal propagates; any other exception is a bug and propagates under every method."""
    try:
        return attempt()
    except NotExact as e:
        if method != Method.AUTO:
            raise
        result = fallback()
        warnings(result).append(fell_back(e))
        warn_caller(fell_back(e), FellBackToNaive)
        return result


def _refused(sites: list[NormSite], reason: Refusal) -> Plan:
    return Plan({s.name: NormPlan(s.name, s.width, reason=reason) for s in sites}, [])


def plan(model: nn.Module, sites: list[NormSite], inputs: list[dict] | None = None,
         examples=None, seen: dict | None = None) -> Plan:
    """Trace `model` on `inputs` (default: `model_inputs(model, examples)`: its samples and the user's examples,
    the ones verification uses), merge what every forward showed and derive the plan; the plan's `reason` is
    set where a norm cannot be made exact, or the model has no input to trace it on or fails on them. `seen`
    holds the trace for the next plan of the same unedited model with fewer norms (norms kept: `planned`),
    which derives from it: a kept norm is still a norm there (it stays a LayerNorm)."""
    held = seen.get("trace") if seen is not None else None
    if held is not None and {s.name for s in sites} <= held[0]:
        return derive(model, held[1], sites)
    if inputs is None:
        try:
            inputs = model_inputs(model, examples)
        except NoInputs as e:  # a model normswap cannot feed, and no example inputs
            return _refused(sites, Refusal(Cause.INPUTS, f"no sample input to trace it ({first_line(e, strip=True)})"))
    norms = {n for n, m in model.named_modules() if isinstance(m, nn.LayerNorm) or norm_kind(m) == "rmsnorm"}
    norms |= {s.name for s in sites}
    try:
        t = trace(model, [inputs] if isinstance(inputs, dict) else list(inputs), norms)
    except ForwardFailed as e:  # the model's own forward failed on its inputs: say so instead of a traceback
        return _refused(sites, Refusal(Cause.FORWARD, f"tracing failed: {e}"))
    if seen is not None:
        seen["trace"] = norms, t
    return derive(model, t, sites)


def not_preserved(model: nn.Module, p: Plan) -> dict[str, str]:
    """Outputs an exact conversion cannot keep (name -> why), as the report and the folder (every load's warning)
    name them: the residual stream is centred inside the model."""
    out = dict(p.not_kept)
    if hasattr(getattr(model, "config", None), "output_hidden_states"):
        out["hidden_states"] = ("output_hidden_states=True: the residual stream inside the model, returned centred "
                                "(each row minus its mean); a norm's output returned there lacks its bias where "
                                "that was folded into its readers")
    return out


def plan_or_naive(method: str, model: nn.Module, sites: list[NormSite], steps: ExactSteps) -> MethodResult:
    """Methods "exact" and "auto" (in memory and lazily alike): steps.apply(model, sites, plan) where
    steps.plan(model, sites) finds the model exact and the plan passes its rehearsal; else refuse ("exact")
    or naive with a warning ("auto"). A refusal comes before the edits: the model is untouched."""
    try:
        return auto_or_naive(method, lambda: planned(model, sites, steps), lambda: naive(model, sites),
                             lambda result: result.warnings)
    except NotExact as e:   # "exact": refused
        raise NotExact(Refusal(e.cause, f"cannot convert exactly: {e}; alternatives: `method='naive'` (drops the "
                                        "biases; heal by fine-tuning) or `method='auto'`", e.refusal.modules)) from None


def planned(model: nn.Module, sites: list[NormSite], steps: ExactSteps) -> MethodResult:
    """The exact conversion by `steps` (refused norms kept as LayerNorms where the rest can then be exact);
    NotExact, the model untouched, where it cannot be."""
    p = steps.plan(model, sites)
    first, kept, left = p.refusal, {}, sites
    # the other norms may be exact without those refused: plan them alone, those stay LayerNorm; keeping a norm can
    # refuse the norms it reaches (a post-LN stage: each reads the one before), so again until none is refused
    while more := keepable(p, left, set(kept)):
        kept |= more
        left = [s for s in sites if s.name not in kept]
        if not left:   # every norm would stay: the first cause is the model's
            raise NotExact(first)
        p = steps.plan(model, left)
    if p.refusal:   # a model-wide reason blocks what keeping norms would allow (post-LN aside): the cause to name
        raise NotExact(p.reasons[0] if p.reasons and first.cause is not Cause.POST_LN else first)
    sites = left
    try:
        result = steps.apply(model, sites, p)
    except NotExact:   # the rehearsal says keeping them was not enough: the first cause is the true one
        if kept:
            raise NotExact(first) from None
        raise
    result.kept = kept
    result.not_preserved, result.unverified = not_preserved(model, p), dict(p.not_kept)
    return result


def rehearse(model: nn.Module, sites: list[NormSite], p: Plan, reference: Reference) -> None:
    """Run the plan as hooks on the unedited model (`rehearse.rehearsal`) against the reference; NotExact
    (the model untouched) if it is not exact to the fp32 tolerance: then the trace missed something."""
    with fp32_eval(model), rehearsal(model, sites, p, set(p.uncalled)):
        parity = compare_to(reference, model)
    tol = TOLERANCE[torch.float32]
    if not parity.finite or not parity.max_rel <= tol:
        raise NotExact(Refusal(Cause.UNVERIFIED, f"the traced plan failed verification before any edit (max "
                               f"relative {parity.worst or parity.output} error {parity.max_rel:.2e} > {tol:g}): the "
                               "model does something the trace does not see"))


@torch.no_grad()
def convert_exact(model: nn.Module, sites: list[NormSite], p: Plan, examples=None) -> ExactResult:
    """The plan carried out in memory, rehearsed first against the outputs recorded before any edit (not a
    copy of the model, on its samples and the user's `examples`), which the swapped model is verified against."""
    reference = verification.reference(model, p.not_kept, examples)
    rehearse(model, sites, p, reference)
    undo = Undo(model, p.steps, sites)   # the originals of what the edits touch, should verification fail
    result = interpret(model, p, reference=reference)
    result.undo = undo
    return result


class InMemory:
    """The exact method's steps on a model in memory: trace it, edit its weights (see `ExactSteps`), on its
    sample inputs and the user's `examples` (`example_inputs`)."""

    def __init__(self, examples=None):
        self.examples, self.seen = examples, {}   # seen: the trace of the unedited model (`plan`)

    def inputs(self, model: nn.Module) -> list[dict]:
        return model_inputs(model, self.examples)

    def plan(self, model: nn.Module, sites: list[NormSite]) -> Plan:
        return plan(model, sites, examples=self.examples, seen=self.seen)

    def apply(self, model: nn.Module, sites: list[NormSite], p: Plan) -> MethodResult:
        self.seen.clear()   # the model is edited now
        return convert_exact(model, sites, p, self.examples)


def exact(model: nn.Module, sites: list[NormSite], steps: ExactSteps | None = None) -> MethodResult:
    """Function-preserving: centre the residual writers, fold norm biases, verify after the swap."""
    return plan_or_naive(Method.EXACT, model, sites, steps or InMemory())


def auto(model: nn.Module, sites: list[NormSite], steps: ExactSteps | None = None) -> MethodResult:
    """exact where the trace shows it possible, otherwise naive with a warning."""
    return plan_or_naive(Method.AUTO, model, sites, steps or InMemory())
