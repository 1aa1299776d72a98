"""Rehearse an exact plan before any weight is edited: verification that can still fall back.

The conversion edits the model in place and no copy is kept, so a plan that fails verification after the
edits leaves a model that is neither the original nor naive. `rehearsal` runs the plan as forward hooks
instead (`Rehearsal`, an editor of the one interpreter, `interpret.carry_out`): each step's effect on its
module's output, computed by the same functions the edits use
(`algebra.centred`, `algebra.bias_shift`, `centring.fixed`, the RMSNorm op), with the norms computing
RMSNorm. Parameters used by hand (a scale factor; a layer whose weights another module uses without
calling it, as nn.MultiheadAttention's out_proj, centred and scaled by a LayerScale after the attention)
get their edited values for the rehearsal only. On exit every hook is removed and every parameter holds its
original tensor again: the model is bit-identical.
Cost: one forward per sample input, plus a copy of each parameter swapped (small ones, in practice).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from normswap import ops
from normswap.surgery.algebra import bias_shift, centred, centred_copy, named_tensor, output_dim, scaled_outputs
from normswap.surgery.centring import centre_input, fixed
from normswap.surgery.interpret import carry_out
from normswap.surgery.plan import Plan
from normswap.surgery.steps import Centre, Fix, Fold, Param, Scale
from normswap.surgery.walk import NormSite


def _channel_dim(module: nn.Module, out: torch.Tensor) -> int:
    return 1 if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)) else out.dim() - 1


def _centre_hook(step: Centre):
    def hook(module, args, out):
        return centred(out, _channel_dim(module, out), step.group, step.ranges).to(out.dtype)
    return hook


def _shift_hook(shift: torch.Tensor):
    def hook(module, args, out):
        return out + shift.to(out.dtype)
    return hook


def _scale_hook(lam: torch.Tensor):
    def hook(module, args, out):
        return out * lam.to(out.dtype)
    return hook


def _rms_hook(site: NormSite):
    def hook(module, args, out):
        x = args[0]
        return ops.rms_norm(x, site.gain.to(x.device, x.dtype), site.eps)
    return hook


def _fix_hook(centre: bool, bias: torch.Tensor | None):
    def hook(module, args, out):
        return fixed(out, centre, None if bias is None else bias.to(out.device, out.dtype))
    return hook


class _Swaps:
    """Parameters given other values for the rehearsal, and their own tensors to put back."""

    def __init__(self):
        self.saved: list[tuple[nn.Parameter, torch.Tensor]] = []

    def put(self, param: nn.Parameter, value: torch.Tensor) -> None:
        self.saved.append((param, param.data))
        param.data = value.to(param.dtype)

    def restore(self) -> None:
        for param, data in reversed(self.saved):
            param.data = data


class Rehearsal:
    """The editor (`interpret.Editor`) that makes each step a forward hook on its module, or, for a tensor used
    by hand (a parameter, a layer in `uncalled`), swaps in its edited value (`swaps`); the fixes are hooked last."""

    def __init__(self, uncalled: set[str], swaps: _Swaps):
        self.uncalled, self.swaps = uncalled, swaps
        self.hooks: dict[str, list] = {}   # per module, in the order the edits compose: fold, scale, centre
        self.fixes: list[tuple[str, bool, object]] = []   # (module, at its input, hook)

    def centre(self, model: nn.Module, step: Centre) -> None:
        if isinstance(step.target, Param) or step.target.name in self.uncalled:
            _centre_by_value(model, step, self.swaps)
        else:
            self.hooks.setdefault(step.target.name, []).append(_centre_hook(step))

    def fold(self, model: nn.Module, step: Fold, b: torch.Tensor) -> bool:
        shift = bias_shift(model.get_submodule(step.reader), b)
        self.hooks.setdefault(step.reader, []).insert(0, _shift_hook(shift))
        return False

    def scale(self, model: nn.Module, step: Scale, lam: torch.Tensor) -> None:
        if step.into in self.uncalled:   # nn.MultiheadAttention's out_proj: its weights are used by hand
            for param, value in scaled_outputs(model.get_submodule(step.into), lam):
                self.swaps.put(param, value)
        else:
            self.hooks.setdefault(step.into, []).append(_scale_hook(lam.detach().clone()))
        self.swaps.put(lam, torch.ones_like(lam))

    def fix(self, model: nn.Module, step: Fix, centre: bool, bias: torch.Tensor | None) -> None:
        self.fixes.append((step.target, step.at_input, centre_input if step.at_input else _fix_hook(centre, bias)))


@contextmanager
@torch.no_grad()
def rehearsal(model: nn.Module, sites: list[NormSite], p: Plan, uncalled: set[str]):
    """Within: `model` computes what the plan would make of it (see the module docstring). `uncalled`:
    layers whose weights are used without calling them (edited by value)."""
    handles, swaps = [], _Swaps()
    try:
        editor = Rehearsal(uncalled, swaps)
        carry_out(model, p.steps, editor)
        for s in sites:
            handles.append(s.module.register_forward_hook(_rms_hook(s)))
        for name, fns in editor.hooks.items():
            handles += [model.get_submodule(name).register_forward_hook(fn) for fn in fns]
        for name, at_input, hook in editor.fixes:
            module = model.get_submodule(name)
            handles.append(module.register_forward_pre_hook(hook, with_kwargs=True) if at_input else
                           module.register_forward_hook(hook))
        yield model
    finally:
        for h in handles:
            h.remove()
        swaps.restore()


def _centre_by_value(model: nn.Module, step: Centre, swaps: _Swaps) -> None:
    if isinstance(step.target, Param):
        param = named_tensor(model, step.target.name)
        swaps.put(param, centred_copy(param, param.dim() + step.target.axis, step.group, step.ranges))
        return
    layer = model.get_submodule(step.target.name)
    swaps.put(layer.weight, centred_copy(layer.weight, output_dim(layer), step.group, step.ranges))
    if not isinstance(layer, nn.Embedding) and getattr(layer, "bias", None) is not None:
        swaps.put(layer.bias, centred_copy(layer.bias, 0, step.group, step.ranges))
