"""The one interpreter of an exact plan's steps (`carry_out`): in memory, lazily and rehearsed alike.

Each step of `plan.Plan.steps`, in order (`steps`): `Centre` a source, `Fold` a norm's bias into a reader,
`Scale` (a LayerScale folded into the layer before it), `Fix` (an output or input fix, installed after the
swap). `carry_out` reads what a step needs from the unedited model (a norm's bias, a scale's factor) and hands
the step to an editor (`Editor`): `EditNow` makes the weight edits on the model in memory; `Recorder` records
them per layer, and the lazy writer replays each layer's edits (`Recorder.replay`, through `EditNow`: the
same arithmetic in the same order, so the same bits) when it reaches that layer's tensors; `rehearse.Rehearsal`
makes them as forward hooks instead, on a model it leaves as it was.

`ExactResult` is the exact method's one result type: the fixes it installs after the swap, the recorded
edits (lazy) or the reference outputs to verify against (in memory: the lazy conversion verifies the folder it
wrote instead, under the same rule, `verification.enforced`).
"""
from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from normswap.folder.portable import ensure_bias
from normswap.folder.attached import section
from normswap.parity import Reference
from normswap.surgery.algebra import centre_outputs, fold_bias, scale_outputs, scale_parameter
from normswap.surgery.centring import add_input_fix, add_output_fix, describe_fix
from normswap.surgery.labels import BiasPlan
from normswap.surgery.methods import BiasFate, Method, MethodResult
from normswap.surgery.plan import Plan
from normswap.surgery.steps import Centre, Fix, Fold, Scale, Step
from normswap.surgery.verification import PARTIAL_WARNING, enforced, verify


class Editor(Protocol):
    """What carries out each kind of step (`carry_out` reads the values a step needs before handing it over)."""

    def centre(self, model: nn.Module, step: Centre) -> None: ...

    def fold(self, model: nn.Module, step: Fold, b: torch.Tensor) -> bool:
        """reader.bias += W b (b: the norm's bias, float64); True if the reader had no bias and one was created."""

    def scale(self, model: nn.Module, step: Scale, lam: torch.Tensor) -> None:
        """Fold the factor `lam` (the scale's own tensor) into the layer `step.into`, and the scale becomes 1."""

    def fix(self, model: nn.Module, step: Fix, centre: bool, bias: torch.Tensor | None) -> None:
        """After the swap: centre the target's output (`centre`) and/or add `bias` after it; or centre its input."""


@torch.no_grad()
def carry_out(model: nn.Module, steps: list[Step], editor: Editor) -> list[str]:
    """Hand each step, in order, to `editor`, with the norm biases and scale factors it needs, read now (before
    any swap); the layers given a bias they did not have."""
    added: list[str] = []
    for step in steps:
        if isinstance(step, Centre):
            editor.centre(model, step)
        elif isinstance(step, Fold):
            if editor.fold(model, step, model.get_submodule(step.norm).bias.detach().double()):
                added.append(step.reader)
        elif isinstance(step, Scale):
            editor.scale(model, step, scale_parameter(model, step.scale))
        elif isinstance(step, Fix):
            editor.fix(model, step, *output_fix(model, step))
        else:
            raise TypeError(f"not a plan step: {step!r}")
    return added


class Fixes:
    """The fixes of a plan, kept for after the swap: output fixes (centre, bias) by module, input fixes."""

    def __init__(self):
        self.fixes: dict[str, tuple[bool, torch.Tensor | None]] = {}
        self.inputs: list[str] = []   # blocks whose first input is centred

    def fix(self, model: nn.Module, step: Fix, centre: bool, bias: torch.Tensor | None) -> None:
        if step.at_input:
            self.inputs.append(step.target)
        else:
            self.fixes[step.target] = centre, bias


class EditNow(Fixes):
    """The editor that makes each weight edit on the model at once (float64 arithmetic, see `algebra`)."""

    def centre(self, model: nn.Module, step: Centre) -> None:
        centre_outputs(model, step.target, step.group, step.ranges)

    def fold(self, model: nn.Module, step: Fold, b: torch.Tensor) -> bool:
        return fold_bias(model.get_submodule(step.reader), b)

    def scale(self, model: nn.Module, step: Scale, lam: torch.Tensor) -> None:
        scale_outputs(model.get_submodule(step.into), lam)
        lam.fill_(1.0)


class Recorder(Fixes):
    """The editor that records each layer's edits, in the interpreter's order, for the lazy writer.

    Planning needs only 1-D tensors (norm biases, LayerScale factors), real on the lazy meta model; a
    created bias is made on meta now (the writer fills it) so that the swapped model saves it."""

    def __init__(self):
        super().__init__()
        self.edits: dict[str, list[tuple]] = {}   # layer -> [(EditNow's method, its arguments after the model)]

    def centre(self, model: nn.Module, step: Centre) -> None:
        self.edits.setdefault(step.target.module, []).append((EditNow.centre, step))

    def fold(self, model: nn.Module, step: Fold, b: torch.Tensor) -> bool:
        _, created = ensure_bias(model.get_submodule(step.reader))   # on meta: the writer fills it
        self.edits.setdefault(step.reader, []).append((EditNow.fold, step, b))
        return created

    def scale(self, model: nn.Module, step: Scale, lam: torch.Tensor) -> None:
        self.edits.setdefault(step.into, []).append((EditNow.scale, step, lam.detach().clone()))
        lam.fill_(1.0)

    def __contains__(self, layer: str) -> bool:
        """Whether `layer` has edits not yet replayed."""
        return layer in self.edits

    def replay(self, model: nn.Module, layer: str) -> None:
        """Make `layer`'s recorded edits (its weights loaded) through `EditNow`, once: replayed, they are dropped."""
        now = EditNow()
        for edit, *args in self.edits.pop(layer):
            edit(now, model, *args)


class ExactResult(MethodResult):
    """A MethodResult whose `after_swap(model, report)` installs the fixes and, given the `reference`
    outputs (in memory), verifies the swapped model; `edits`, when recorded, are for the lazy writer."""

    def __init__(self, fixes: Fixes, edits: Recorder | None = None, reference: Reference | None = None, **kw):
        super().__init__(Method.EXACT, **kw)
        self.fixes, self.inputs, self.edits, self.reference = fixes.fixes, fixes.inputs, edits, reference

    def after_swap(self, model: nn.Module, report) -> None:
        install_fixes(model, self.fixes, self.inputs)
        if not enforced(report):
            report.warnings.append(PARTIAL_WARNING)
        if self.reference is not None:   # in memory; the lazy conversion verifies the folder it writes
            report.verification = verify(self.reference, model, enforce=enforced(report))
            self.reference = None  # free the recorded outputs


def interpret(model: nn.Module, p: Plan, edits: Recorder | None = None,
              reference: Reference | None = None) -> ExactResult:
    """Carry out `p`'s steps (`carry_out`): weight edits made now, or recorded into `edits`; fixes kept for
    `ExactResult.after_swap`, which verifies against `reference` if given."""
    editor = edits if edits is not None else EditNow()
    added = carry_out(model, p.steps, editor)
    return ExactResult(editor, edits, reference, bias=bias_fates(p), added_biases=added)


def install_fixes(model: nn.Module, fixes: dict, inputs: list[str]) -> None:
    """After the swap: the output fixes (centre and/or bias after a module), the input fixes, recorded in
    the model's normswap section so that loading re-applies them."""
    for name, (centre, bias) in fixes.items():
        add_output_fix(model.get_submodule(name), centre, bias)
    for name in inputs:
        add_input_fix(model.get_submodule(name))
    record = section(model)
    record["output_fixes"] = {**record.get("output_fixes", {}),
                              **{n: describe_fix(model.get_submodule(n)) for n in [*fixes, *inputs]}}


def output_fix(model: nn.Module, step: Fix) -> tuple[bool, torch.Tensor | None]:
    """(centre, bias kept after the module) of a fix step; the norm's bias is read now, before the swap."""
    b = None if step.norm is None else model.get_submodule(step.norm).bias.detach().double()
    return step.centre, None if b is None else b - b.mean() if step.centre else b


def bias_fates(p: Plan) -> dict[str, BiasFate]:
    """Per norm, what the report says of its bias."""
    return {n: BiasFate.FOLDED if q.bias is not BiasPlan.NONE else BiasFate.NONE for n, q in p.norms.items()}
