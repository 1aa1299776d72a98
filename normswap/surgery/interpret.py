"""The one interpreter of an exact plan's steps (`interpret`), in memory and lazily alike.

Each step of `plan.Plan.steps`, in order: "centre" a source, "fold" a norm's bias into a reader, "scale"
(a LayerScale folded into the layer before it), "fix" (an output or input fix, installed after the swap). The
weight edits go to an editor: `EditNow` makes them on the model in memory; `Recorder` records them per layer,
and the lazy writer replays each layer's edits (`Recorder.replay`, through `EditNow`: the same
arithmetic in the same order, so the same bits) when it reaches that layer's tensors.

`ExactResult` is the exact method's one result type: the fixes it installs after the swap, the recorded
edits (lazy) or the reference outputs to verify against (in memory: the lazy conversion verifies the folder it
wrote instead, under the same rule, `verification.enforced`).
"""
from __future__ import annotations

import torch
from torch import nn

from normswap.folder.portable import ensure_bias
from normswap.folder.attached import section
from normswap.parity import Reference
from normswap.surgery.algebra import centre_outputs, fold_bias, scale_outputs, scale_parameter
from normswap.surgery.centring import add_input_fix, add_output_fix, describe_fix
from normswap.surgery.methods import MethodResult
from normswap.surgery.plan import Plan, Step
from normswap.surgery.verification import PARTIAL_WARNING, enforced, verify


class EditNow:
    """The editor that makes each weight edit on the model at once (float64 arithmetic, see `algebra`)."""

    def centre(self, model: nn.Module, step: Step) -> None:
        centre_outputs(model, step.target, step.group, step.ranges, step.axis)

    def fold(self, model: nn.Module, layer: str, b: torch.Tensor) -> bool:
        """bias += W b; True if `layer` had no bias and one was created."""
        return fold_bias(model.get_submodule(layer), b)

    def scale(self, model: nn.Module, layer: str, lam: torch.Tensor) -> None:
        scale_outputs(model.get_submodule(layer), lam)


class Recorder:
    """The editor that records each layer's edits, in the interpreter's order, for the lazy writer.

    Planning needs only 1-D tensors (norm biases, LayerScale factors), real on the lazy meta model; a
    created bias is made on meta now (the writer fills it) so that the swapped model saves it."""

    def __init__(self):
        self.edits: dict[str, list[tuple]] = {}   # layer -> [(EditNow method, its arguments after model)]

    def centre(self, model: nn.Module, step: Step) -> None:
        owner = step.param.rpartition(".")[0] if step.param else step.target
        self.edits.setdefault(owner, []).append(("centre", step))

    def fold(self, model: nn.Module, layer: str, b: torch.Tensor) -> bool:
        _, created = ensure_bias(model.get_submodule(layer))   # on meta: the writer fills it
        self.edits.setdefault(layer, []).append(("fold", layer, b))
        return created

    def scale(self, model: nn.Module, layer: str, lam: torch.Tensor) -> None:
        self.edits.setdefault(layer, []).append(("scale", layer, lam.detach().clone()))

    def __contains__(self, layer: str) -> bool:
        """Whether `layer` has edits not yet replayed."""
        return layer in self.edits

    def replay(self, model: nn.Module, layer: str) -> None:
        """Make `layer`'s recorded edits (its weights loaded) through `EditNow`, once: replayed, they are dropped."""
        now = EditNow()
        for op, *args in self.edits.pop(layer):
            getattr(now, op)(model, *args)


class ExactResult(MethodResult):
    """A MethodResult whose `after_swap(model, report)` installs the fixes and, given the `reference`
    outputs (in memory), verifies the swapped model; `edits`, when recorded, are for the lazy writer."""

    def __init__(self, fixes: dict, inputs: list[str], edits: Recorder | None = None,
                 reference: Reference | None = None, **kw):
        super().__init__("exact", **kw)
        self.fixes, self.inputs, self.edits, self.reference = fixes, inputs, edits, reference

    def after_swap(self, model: nn.Module, report) -> None:
        install_fixes(model, self.fixes, self.inputs)
        if not enforced(report):
            report.warnings.append(PARTIAL_WARNING)
        if self.reference is not None:   # in memory; the lazy conversion verifies the folder it writes
            report.verification = verify(self.reference, model, enforce=enforced(report))
            self.reference = None  # free the recorded outputs


@torch.no_grad()
def interpret(model: nn.Module, p: Plan, edits: Recorder | None = None,
              reference: Reference | None = None) -> ExactResult:
    """Carry out `p`'s steps in order: weight edits made now, or recorded into `edits`; norm biases read now,
    before the swap; fixes kept for `ExactResult.after_swap`, which verifies against `reference` if given."""
    editor = edits if edits is not None else EditNow()
    fixes: dict[str, tuple[bool, torch.Tensor | None]] = {}
    added: list[str] = []
    inputs: list[str] = []   # blocks whose first input is centred
    for step in p.steps:
        if step.op == "centre":
            editor.centre(model, step)
        elif step.op == "fold":
            b = model.get_submodule(step.norm).bias.detach().double()
            added += [step.target] if editor.fold(model, step.target, b) else []
        elif step.op == "scale":   # LayerScale (target) folded into the layer before it (norm)
            lam = scale_parameter(model, step.target)
            editor.scale(model, step.norm, lam)
            lam.fill_(1.0)
        elif step.norm == "input":
            inputs.append(step.target)
        else:   # output fixes wait for the swap
            fixes[step.target] = output_fix(model, step)
    return ExactResult(fixes, inputs, edits, reference, bias=bias_fates(p), added_biases=added)


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


def output_fix(model: nn.Module, step: Step) -> tuple[bool, torch.Tensor | None]:
    """(centre, bias kept after the module) of a fix step; the norm's bias is read now, before the swap."""
    b = None if not step.norm else model.get_submodule(step.norm).bias.detach().double()
    return step.centre, None if b is None else b - b.mean() if step.centre else b


def bias_fates(p: Plan) -> dict[str, str]:
    """Per norm, what the report says of its bias."""
    return {n: "folded" if q.bias in ("fold", "after", "stream") else "none" for n, q in p.norms.items()}
