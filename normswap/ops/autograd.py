"""Autograd for the Triton RMSNorm, in one place: three `torch.library` custom ops and their gradients.

Custom ops (not a bare autograd.Function) so `torch.compile` keeps each kernel as one opaque op with a
fake (shape-only) implementation instead of tracing into Triton launcher code. The kernels module is
imported lazily, on the first call, so importing normswap never imports Triton.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from normswap.ops import fakes
from normswap.ops.reference import partial_width


def _kernels():
    from normswap.ops import triton_kernels
    return triton_kernels


# ---- forward: plain ----------------------------------------------------------------------------
@torch.library.custom_op("normswap::rms_norm_fwd", mutates_args=())
def rms_norm_fwd(x: Tensor, weight: Optional[Tensor], eps: float, k: int) -> tuple[Tensor, Tensor]:
    """(y, rstd): RMSNorm of x over the last dim, rms from the first k features."""
    y, _, rstd = _kernels().rms_norm_fwd(x, weight, eps, k)
    return y, rstd


rms_norm_fwd.register_fake(fakes.forward)


# ---- forward: fused residual add ---------------------------------------------------------------
@torch.library.custom_op("normswap::rms_norm_add_fwd", mutates_args=())
def rms_norm_add_fwd(x: Tensor, residual: Tensor, weight: Optional[Tensor], eps: float,
                     k: int) -> tuple[Tensor, Tensor, Tensor]:
    """(y, h, rstd) with h = x + residual and y = RMSNorm(h), in one pass over memory."""
    return _kernels().rms_norm_fwd(x, weight, eps, k, residual=residual)


rms_norm_add_fwd.register_fake(fakes.forward_add)


# ---- backward (shared) -------------------------------------------------------------------------
@torch.library.custom_op("normswap::rms_norm_bwd", mutates_args=())
def rms_norm_bwd(dy: Tensor, h: Tensor, rstd: Tensor, weight: Optional[Tensor], dh_out: Optional[Tensor],
                 k: int, need_dw: bool) -> tuple[Tensor, Tensor]:
    """(dx, dw); dw is an empty tensor when there is no weight or it needs no gradient."""
    dx, dw = _kernels().rms_norm_bwd(dy, h, rstd, weight, k, dh_out=dh_out, need_dw=need_dw)
    # A custom op cannot return None; an empty tensor stands for "no dweight".
    return dx, (dw if dw is not None else h.new_empty(0))


rms_norm_bwd.register_fake(fakes.backward)


def _setup_plain(ctx, inputs, output):
    x, weight, _, k = inputs
    ctx.save_for_backward(x, output[1], weight)
    ctx.k = k


def _backward_plain(ctx, dy, _drstd):
    x, rstd, weight = ctx.saved_tensors
    need_dw = weight is not None and ctx.needs_input_grad[1]
    dx, dw = rms_norm_bwd(dy, x, rstd, weight, None, ctx.k, need_dw)
    return dx, (dw if need_dw else None), None, None


def _setup_add(ctx, inputs, output):
    _, _, weight, _, k = inputs
    # Only h (an output) is saved: x and residual are not needed once their sum exists.
    ctx.save_for_backward(output[1], output[2], weight)
    ctx.k = k


def _backward_add(ctx, dy, dh_out, _drstd):
    h, rstd, weight = ctx.saved_tensors
    need_dw = weight is not None and ctx.needs_input_grad[2]
    dh, dw = rms_norm_bwd(dy, h, rstd, weight, dh_out, ctx.k, need_dw)
    # h = x + residual, so both inputs receive dh (= dnorm + the gradient of the returned h).
    return dh, dh, (dw if need_dw else None), None, None


rms_norm_fwd.register_autograd(_backward_plain, setup_context=_setup_plain)
rms_norm_add_fwd.register_autograd(_backward_add, setup_context=_setup_add)


def rms_norm_triton(x: Tensor, weight: Tensor | None, eps: float, residual: Tensor | None = None,
                    p: float | None = None, direct: bool = False):
    """Same contract as `rms_norm_reference` (y, or (y, h) with a residual), on the Triton kernels.

    `direct`: call the launchers the custom ops wrap, without the ops' dispatch (about 5 us of host time a
    call on torch 2.14, more on older torch: a decode step's worth over a model's norms). Only for plain
    eager tensors that need no gradient (`ops.plain_inference`): nothing then uses the ops' autograd, fake
    implementation or graph node.
    """
    k = partial_width(x.shape[-1], p)
    eps = float(eps)
    if residual is None:
        if direct:
            return _kernels().rms_norm_fwd(x, weight, eps, k)[0]
        return torch.ops.normswap.rms_norm_fwd(x, weight, eps, k)[0]
    out_dtype = x.dtype
    # Match the reference's `x + residual`: type promotion and broadcasting happen before the kernel.
    if residual.dtype != out_dtype:
        h_dtype = torch.promote_types(x.dtype, residual.dtype)
        x, residual = x.to(h_dtype), residual.to(h_dtype)
    if x.shape != residual.shape:
        x, residual = torch.broadcast_tensors(x, residual)
    if direct:
        y, h, _ = _kernels().rms_norm_fwd(x, weight, eps, k, residual=residual)
    else:
        y, h, _ = torch.ops.normswap.rms_norm_add_fwd(x, residual, weight, eps, k)
    return (y if y.dtype == out_dtype else y.to(out_dtype)), h
