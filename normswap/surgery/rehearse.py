"""Rehearse an exact plan before any weight is edited: verification that can still fall back.

The conversion edits the model in place and no copy is kept, so a plan that fails verification after the
edits leaves a model that is neither the original nor naive. `rehearsal` runs the plan as forward hooks
instead: each step's effect on its module's output, computed by the same functions the edits use
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
from normswap.surgery.algebra import (bias_shift, centred, centred_copy, named_tensor, output_dim, scale_parameter,
                                      scaled_outputs)
from normswap.surgery.centring import centre_input, fixed
from normswap.surgery.plan import Plan, Step
from normswap.surgery.walk import NormSite


def _channel_dim(module: nn.Module, out: torch.Tensor) -> int:
    return 1 if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)) else out.dim() - 1


def _centre_hook(step: Step):
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


@contextmanager
@torch.no_grad()
def rehearsal(model: nn.Module, sites: list[NormSite], p: Plan, uncalled: set[str], output_fix):
    """Within: `model` computes what the plan would make of it (see the module docstring). `uncalled`:
    layers whose weights are used without calling them (edited by value); `output_fix(model, step)` gives a
    fix step's (centre, bias)."""
    handles, swaps = [], _Swaps()
    hooks: dict[str, list] = {}
    try:
        for step in p.steps:   # per module, in the order the edits compose: fold, scale, centre, fixes
            if step.op == "fold":
                layer = model.get_submodule(step.target)
                b = model.get_submodule(step.norm).bias.detach().double()
                hooks.setdefault(step.target, []).insert(0, _shift_hook(bias_shift(layer, b)))
            elif step.op == "scale":
                lam = scale_parameter(model, step.target)
                if step.norm in uncalled:   # nn.MultiheadAttention's out_proj: its weights are used by hand
                    for param, value in scaled_outputs(model.get_submodule(step.norm), lam):
                        swaps.put(param, value)
                else:
                    hooks.setdefault(step.norm, []).append(_scale_hook(lam.detach().clone()))
                swaps.put(lam, torch.ones_like(lam))
            elif step.op == "centre" and (step.param is not None or step.target in uncalled):
                _centre_by_value(model, step, swaps)
            elif step.op == "centre":
                hooks.setdefault(step.target, []).append(_centre_hook(step))
        for s in sites:
            handles.append(s.module.register_forward_hook(_rms_hook(s)))
        for name, fns in hooks.items():
            handles += [model.get_submodule(name).register_forward_hook(fn) for fn in fns]
        for step in p.steps:
            if step.op == "fix" and step.norm == "input":
                handles.append(model.get_submodule(step.target).register_forward_pre_hook(centre_input,
                                                                                          with_kwargs=True))
            elif step.op == "fix":
                handles.append(model.get_submodule(step.target).register_forward_hook(_fix_hook(
                    *output_fix(model, step))))
        yield model
    finally:
        for h in handles:
            h.remove()
        swaps.restore()


def _centre_by_value(model: nn.Module, step: Step, swaps: _Swaps) -> None:
    if step.param is not None:
        param = named_tensor(model, step.param)
        swaps.put(param, centred_copy(param, param.dim() + step.axis, step.group, step.ranges))
        return
    layer = model.get_submodule(step.target)
    swaps.put(layer.weight, centred_copy(layer.weight, output_dim(layer), step.group, step.ranges))
    if not isinstance(layer, nn.Embedding) and getattr(layer, "bias", None) is not None:
        swaps.put(layer.bias, centred_copy(layer.bias, 0, step.group, step.ranges))
