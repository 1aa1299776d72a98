"""`convert`: the one verb that turns a model's LayerNorms into RMSNorm, in place."""
from __future__ import annotations

import torch
from torch import nn

from normswap.errors import NormswapError, first_line
from normswap.folder import fingerprint
from normswap.norms import NormType, RMSNorm, build_norm, norm_spec, off_fast_path
from normswap.ops import check_eps, partial_width
from normswap.models.adopt import adopt
from normswap.models.inputs.examples import NoInputs, check_examples
from normswap.folder.attached import section as model_section
from normswap.folder.attached import set_section
from normswap.folder.section import new_section
from normswap.models.wrapped import unwrapped
from normswap.surgery.labels import Cause, Refusal
from normswap.surgery.exact import InMemory, auto, auto_or_naive, exact
from normswap.surgery.methods import BiasFate, ExactSteps, Method, MethodResult, naive
from normswap.surgery.report import ConversionReport, NormRecord
from normswap.surgery.trainable import kept_trainable
from normswap.surgery.verification import VerificationFailed
from normswap.surgery.walk import FilterFn, NormSite, Skip, Skipped, find_norms, replace_module

METHODS = {Method.AUTO: auto, Method.EXACT: exact, Method.NAIVE: naive}
DEFAULT_P = 0.0625


def _make_norm(site: NormSite, to: str, p: float | None) -> RMSNorm:
    """The replacement, with the site's effective gain (weight + 1 for a "1P" norm); no gain if it is 1."""
    old = site.module
    affine = getattr(old, "weight", None) is not None or not bool((site.gain == 1).all())
    new = build_norm({"type": to, "width": site.width, "eps": site.eps, "p": p, "affine": affine}, like=old)
    if affine:
        with torch.no_grad():
            new.weight.copy_(site.gain.to(new.weight.device, new.weight.dtype))
    new.train(old.training)
    return new


def probe(steps: ExactSteps, model: nn.Module) -> dict:
    """The fingerprint's probe (`io.fingerprint`): the first batch of the inputs the conversion runs on (normswap's
    first sample, else the user's first example), or why there is none."""
    try:
        batch = steps.inputs(model)[0]
    except NoInputs as e:
        return {"none": f"no input to run it on ({first_line(e, strip=True)})"}
    return probe_of(batch)


def probe_of(batch: dict) -> dict:
    """The fingerprint's probe for the input batch `batch` (keyword arguments), or why it cannot be stored."""
    try:
        return {"probe": {"args": fingerprint.encode(()), "kwargs": fingerprint.encode(batch)}}
    except TypeError as e:
        return {"none": f"its first input batch cannot be stored ({e})"}


def _record(model: nn.Module, report: ConversionReport, steps: ExactSteps) -> None:
    """Write what was converted into the model's normswap section (`models.section`: config.normswap, saved
    with the config, or an attribute of a model without one)."""
    if not report.converted:
        return
    section = dict(model_section(model) or new_section(model, probe(steps, model)))
    section["norms"] = {**section["norms"],
                        **{r.name: norm_spec(model.get_submodule(r.name)) for r in report.converted}}
    section["added_biases"] = sorted(set(section["added_biases"]) | set(report.added_biases))
    section["conversions"] = section["conversions"] + [{"to": report.to, "method": report.method,
                                                        "p": report.p, "norms": report.num_converted}]
    if report.not_preserved:   # outputs this conversion changes, as the report says: every load of the folder says so
        section["not_preserved"] = {**section.get("not_preserved", {}), **report.not_preserved}
    set_section(model, section)


def _row_method(method: Method, to: NormType) -> str:
    """A row's method: a pRMSNorm is never exact (its biases fold exactly, its RMS of a few features does not)."""
    return "approximate" if to is NormType.PRMSNORM and method is Method.EXACT else method


def _check_target(to: str, p: float | None) -> tuple[NormType, float | None]:
    if to not in NormType.values():
        raise NormswapError(f"unknown target '{to}': choose rmsnorm or prmsnorm")
    to = NormType(to)
    if to is NormType.PRMSNORM:
        p = DEFAULT_P if p is None else float(p)
        try:
            partial_width(8, p)
        except ValueError as e:
            raise NormswapError(str(e)) from None
    elif p is not None:
        raise NormswapError("p applies only to `to='prmsnorm'`")
    return to, p


def convert(model: nn.Module, to: str = "rmsnorm", method: str = "auto", p: float | None = None,
            filter_fn: FilterFn | None = None, example_inputs=None) -> ConversionReport:
    """Replace every LayerNorm over the last dim of `model` by RMSNorm (or pRMSNorm), in place.

    method: "auto" (default: exact where the traced plan allows it, else naive with a warning), "exact"
    (function-preserving, verified; refuses what it cannot do) or "naive" (bias dropped, the paper's swap).
    filter_fn(module, name) -> bool limits which norms are touched. example_inputs: one batch or a list of
    batches of what the forward takes (a tensor, a tuple of positional arguments, a dict of keyword
    arguments), as torch.export takes them: exact traces, rehearses and verifies on them (besides normswap's
    own samples for a transformers model); any other nn.Module converts exactly only with them. Running it
    again on a converted model is a no-op.

    A model wrapped in nn.DataParallel or torch.compile is converted inside its wrapper, which then runs the
    converted model (DistributedDataParallel is refused: convert before wrapping). Parameters the conversion
    creates keep the user's choice of `requires_grad`: a new norm's gain that of the norm it replaces, an added
    bias that of its layer's weight.
    """
    if not isinstance(model, nn.Module):
        raise NormswapError(f"`model` must be a torch.nn.Module, not {type(model).__name__}")
    model = unwrapped(model)
    meta = next((n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta), None)
    if meta is not None:  # probing needs values: a meta model would have every norm "skipped"
        raise NormswapError(f"the model's weights are on the meta device ({meta}, ...): load them before "
                            "converting (a saved folder converts with bounded memory through `convert_checkpoint`)")
    check_examples(example_inputs)
    report, _ = convert_with(model, to, method, p, filter_fn, InMemory(example_inputs))
    if report.converted:   # its own save_pretrained now writes a complete, self-verifying folder
        adopt(model)
    return report


def convert_with(model: nn.Module, to: str = "rmsnorm", method: str = "auto", p: float | None = None,
                 filter_fn: FilterFn | None = None,
                 steps: ExactSteps | None = None) -> tuple[ConversionReport, MethodResult | None]:
    """`convert`, with the exact method's `steps` given (default: in memory, on the model's own samples);
    (report, what the method did, None when there was nothing to convert)."""
    to, p = _check_target(to, p)
    steps = steps or InMemory()
    if method not in Method.values():
        raise NormswapError(f"unknown method '{method}': choose one of {', '.join(sorted(Method.values()))}")
    method = Method(method)
    sites, skipped, rms = find_norms(model, filter_fn)

    def report() -> ConversionReport:
        return ConversionReport(to=to, method=method, p=p, already_rms=list(rms), skipped=list(skipped))
    if not sites:
        return report(), None
    for site in sites:  # before any edit: RMSNorm refuses eps <= 0 (NaN on an all-zero row)
        try:
            check_eps(site.eps)
        except ValueError as e:
            raise NormswapError(f"{site.name}: {e}") from None
    with kept_trainable(model):
        # a failed verification puts the model back (`_finish`): under auto it is then converted naively
        return auto_or_naive(method, lambda: _finish(model, sites, report(), METHODS[method](model, sites, steps),
                                                     to, p, steps),
                             lambda: _finish(model, sites, report(), naive(model, sites), to, p, steps),
                             lambda done: done[0].warnings)


def _finish(model: nn.Module, sites: list[NormSite], report: ConversionReport, result: MethodResult,
            to: NormType, p: float | None, steps: ExactSteps) -> tuple[ConversionReport, MethodResult]:
    """The norms swapped, the fixes installed and the result verified (exact, in memory); where verification
    fails, the model put back as it was before raising."""
    try:
        _swap(model, sites, report, result, to, p, steps)
        result.after_swap(model, report)   # fixes installed (exact), verified
    except VerificationFailed as e:
        if result.undo is None:
            raise
        result.undo.restore(model)
        raise VerificationFailed(f"{e}; the model was put back as it was") from None
    return report, result


def _kept_reason(refusal: Refusal) -> str:
    if refusal.cause is Cause.UNREACHABLE:
        return f"left as it is (a LayerNorm that never runs): {refusal}"
    return f"kept as it is so that the rest converts exactly: {refusal}"


def _swap(model: nn.Module, sites: list[NormSite], report: ConversionReport, result: MethodResult, to: NormType,
          p: float | None, steps: ExactSteps) -> None:
    """The norms swapped after `result`'s method ran, and what it did written into `report` and the section."""
    report.method = result.method
    report.added_biases = result.added_biases
    report.warnings += result.warnings
    report.not_preserved, report.unverified = result.not_preserved, result.unverified
    if result.kept:   # exact for the others; these could not be, and stay as they are
        report.skipped += [Skipped(s.name, type(s.module).__name__, _kept_reason(result.kept[s.name]), Skip.KEPT,
                                   result.kept[s.name]) for s in sites if s.name in result.kept]
        sites = [s for s in sites if s.name not in result.kept]
    for site in sites:
        replace_module(model, site.name, _make_norm(site, to, p))
        report.converted.append(NormRecord(
            name=site.name, replaced=type(site.module).__name__, width=site.width, eps=site.eps, to=to,
            method=_row_method(result.per_norm_method.get(site.name, result.method), to),
            bias=result.bias.get(site.name, BiasFate.NONE), bias_norm=site.bias_norm))
    off_fast_path(model)   # torch's fused encoder layer would compute LayerNorm from the new norms' weights
    _record(model, report, steps)
