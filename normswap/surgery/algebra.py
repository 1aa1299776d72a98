"""The weight algebra of the exact conversion, in float64, written back in the model's dtype.

- `centre_outputs`: make a layer's outputs (or a parameter added to the stream) zero-mean per group of
  channels, or over given channel ranges only: Linear (out, in) along dim 0, Conv1D (in, out) along dim 1,
  Embedding rows, ConvNd output channels (`centred` is the same map applied to any tensor).
- `fold_bias`: c' = c + W b for a linear layer reading a norm whose bias is b (the bias created if absent).
- `scale_outputs`: a per-channel scale (LayerScale, `scale_parameter`) multiplied into the layer before it.

fp64 working copies are made a slice at a time: a whole fp64 vocabulary matrix would be twice the size of
the fp32 one and set the peak memory of the whole conversion. 64 MB slices: above glibc's largest mmap
threshold (32 MB), so each is returned to the OS when freed; measured, 16 and 32 MB slices were kept on the
heap and the process grew by ~250 MB anyway.
"""
from __future__ import annotations

import torch
from torch import nn

from normswap.models.introspect import is_conv1d
from normswap.folder.portable import ensure_bias   # creating a bias is part of the structure folders rebuild
from normswap.surgery.steps import Param, Target

CHUNK = 1 << 23   # elements per fp64 slice (64 MB)


def _update(param: torch.Tensor, value: torch.Tensor) -> None:
    param.copy_(value.to(param.dtype))


def _slices(w: torch.Tensor, dim: int):
    """Views of w along `dim`, each of about CHUNK elements (every slice keeps the other dim whole)."""
    step = max(1, CHUNK // max(1, w.shape[1 - dim]))
    return w.split(step, dim)


def centred(t: torch.Tensor, dim: int, group: int, ranges: tuple = ()) -> torch.Tensor:
    """t with zero mean over consecutive groups of `group` entries along `dim` (all of it if 0), or, given
    `ranges` ((start, stop), ...), over each range only, the other entries unchanged; in float64."""
    x = t.double().movedim(dim, -1)
    if ranges:
        x = x.clone()
        for a, b in ranges:
            x[..., a:b] -= x[..., a:b].mean(-1, keepdim=True)
        return x.movedim(-1, dim)
    g = group if group and x.shape[-1] % group == 0 else x.shape[-1]
    x = x.unflatten(-1, (-1, g))
    return (x - x.mean(-1, keepdim=True)).flatten(-2).movedim(-1, dim)


def rows_centred(x: torch.Tensor, dtype: torch.dtype | None = None) -> bool:
    """Whether every row of x (along the last dim) has mean ~0 for its size: centring it changes nothing. The
    weights' `dtype` bounds how centred rows written by centred weights are: ~eps/3 of their RMS measured in
    bf16 and fp16, so 4 eps is allowed there (1e-4 in fp32)."""
    tol = max(1e-4, 4 * torch.finfo(dtype or x.dtype).eps)
    x = x.detach().double()
    return bool((x.mean(-1).abs() <= tol * x.pow(2).mean(-1).sqrt() + 1e-30).all())


def _centre_in_place(t: torch.Tensor, dim: int, group: int, ranges: tuple) -> None:
    """`centred`, written back; a 2-D weight a slice at a time (each slice whole along `dim`), a stacked one
    (experts, dim > 0) one 2-D slice after another."""
    if t.dim() > 2 and dim > 0:
        for part in t:
            _centre_in_place(part, dim - 1, group, ranges)
        return
    for part in (_slices(t, 1 - dim) if t.dim() == 2 else [t]):
        _update(part, centred(part, dim, group, ranges))


def centred_copy(t: torch.Tensor, dim: int, group: int, ranges: tuple = ()) -> torch.Tensor:
    """A copy of t (same dtype) centred as `centre_outputs` would, computed a slice at a time."""
    out = t.detach().clone()
    _centre_in_place(out, dim, group, ranges)
    return out


def output_dim(layer: nn.Module) -> int:
    """The dim of a layer's weight that indexes its outputs."""
    return 1 if isinstance(layer, nn.Embedding) or is_conv1d(layer) else 0


def centre_outputs(model: nn.Module, target: Target, group: int, ranges: tuple = ()) -> None:
    """Make every output of the layer `target` (or the channels of a `Param`, along its axis) zero-mean per group of
    `group` channels (or over each of `ranges`)."""
    if isinstance(target, Param):
        param = named_tensor(model, target.name)
        _centre_in_place(param, param.dim() + target.axis, group, ranges)
        return
    layer = model.get_submodule(target.name)
    _centre_in_place(layer.weight, output_dim(layer), group, ranges)
    if not isinstance(layer, nn.Embedding) and getattr(layer, "bias", None) is not None:
        _update(layer.bias, centred(layer.bias, 0, group, ranges))


def scaled_outputs(layer: nn.Module, lam: torch.Tensor) -> list[tuple[nn.Parameter, torch.Tensor]]:
    """(parameter, its float64 value with the layer's outputs *= lam per output channel): weight and bias. `lam`
    may hold its channels in any one dim (a LayerScale shaped (1, 1, D), vit-pytorch's CaiT)."""
    lam = lam.reshape(-1)
    dim = 1 if is_conv1d(layer) else 0
    shape = [-1 if d == dim else 1 for d in range(layer.weight.dim())]
    out = [(layer.weight, layer.weight.double() * lam.double().view(shape))]
    if getattr(layer, "bias", None) is not None:
        out.append((layer.bias, layer.bias.double() * lam.double()))
    return out


def scale_outputs(layer: nn.Module, lam: torch.Tensor) -> None:
    """layer's outputs *= lam (per output channel)."""
    for param, value in scaled_outputs(layer, lam):
        _update(param, value)


def scale_parameter(model: nn.Module, target: Target) -> nn.Parameter:
    """The per-channel factor of a scale step: a `Param`, or a LayerScale module's one parameter."""
    if isinstance(target, Param):
        return named_tensor(model, target.name)
    return next(model.get_submodule(target.name).parameters())


def named_tensor(model: nn.Module, name: str) -> torch.Tensor:
    """The parameter, or else the (persistent) buffer, of that qualified name: a `Param` target's tensor."""
    try:
        return model.get_parameter(name)
    except AttributeError:
        return model.get_buffer(name)


def bias_shift(layer: nn.Module, b: torch.Tensor) -> torch.Tensor:
    """W b in float64: what a linear layer reading x + b adds to its output on x."""
    if isinstance(layer, nn.Linear):   # (out, in): row blocks of W b
        return torch.cat([part.double() @ b for part in _slices(layer.weight, 0)])
    n = max(1, CHUNK // layer.weight.shape[1])   # Conv1D (in, out): b W summed over row blocks
    return sum(b[i:i + n] @ layer.weight[i:i + n].double() for i in range(0, layer.weight.shape[0], n))


def fold_bias(layer: nn.Module, b: torch.Tensor) -> bool:
    """bias += W b for a reader of a norm whose bias is b; True if the bias had to be created."""
    shift = bias_shift(layer, b)
    bias, created = ensure_bias(layer)
    _update(bias, bias.double() + shift)
    return created
