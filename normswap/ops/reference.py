"""Pure-PyTorch RMSNorm: the CPU path, the ONNX-export path and the fallback when Triton is absent."""
from __future__ import annotations

import math

import torch

from normswap.ops import graph as graph_form


def partial_width(d: int, p: float | None) -> int:
    """Number of leading features pRMSNorm uses to estimate the RMS: ceil(p * d), at least 1.

    ceil of the decimal the user wrote: p=0.07, d=100 gives 7, where float math gives
    ceil(7.000000000000001) = 8. A float p is within half an ulp of its decimal and the product adds at
    most another, so p * d within 1e-12 (relative; float error is ~2e-16) of an integer *is* that integer.
    Float arithmetic only (no Fraction): torch.compile traces this inside the norm's forward.
    """
    if p is None:
        return d
    if not (isinstance(p, (int, float)) and math.isfinite(p) and 0.0 < p <= 1.0):
        raise ValueError(f"p must be in (0, 1], got {p}")
    x = p * d
    n = round(x)
    return max(1, min(d, n if abs(x - n) <= 1e-12 * x else math.ceil(x)))


def check_eps(eps: float) -> float:
    """eps as a float; refuses eps <= 0 or non-finite (an all-zero row would give 0/0 = NaN)."""
    try:
        value = float(eps)
    except (TypeError, ValueError):
        raise ValueError(f"eps must be a positive number, got {eps!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"eps must be positive and finite, got {eps!r}")
    return value


def check_float(*tensors: torch.Tensor | None) -> None:
    """RMSNorm of integers would be truncated back to integers: refuse them instead."""
    for t in tensors:
        if t is not None and not t.is_floating_point():
            raise TypeError(f"RMSNorm needs floating-point inputs, got {t.dtype}")


def exporting() -> bool:
    is_exporting = getattr(torch.compiler, "is_exporting", None)  # torch >= 2.5
    return (torch.onnx.is_in_onnx_export() or torch.jit.is_tracing()
            or (is_exporting is not None and is_exporting()))


def checked_pass(h: torch.Tensor) -> bool:
    """Whether the plain pass can run first with an overflow check after it (a host sync: CPU eager only, and
    no data-dependent branch under a torch.func transform); elsewhere outside a graph, always scaled."""
    return h.device.type == "cpu" and not torch._C._are_functorch_transforms_active()


def _pow2_floor_at_least_1(m: torch.Tensor) -> torch.Tensor:
    """The largest power of two <= m (fp32, by clearing the mantissa bits), but at least 1."""
    return (m.view(torch.int32) & 0x7F800000).view(torch.float32).clamp(min=1.0)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                       residual: torch.Tensor | None = None, p: float | None = None):
    """y = x / sqrt(mean(x[..., :k]^2) + eps) * weight, squares and mean in fp32, y in x's dtype.

    With `residual`, h = x + residual is normalised and (y, h) is returned.
    fp32 squares overflow for |x| > ~1.8e19 (fp32/bf16 inputs), so rows are divided by s, the power of
    two just below their max |x| (never scaled up): x/s / sqrt(mean((x/s)^2) + eps/s^2) is the same
    value and power-of-two scaling is exact, so results are bit-identical wherever nothing overflowed.
    On CPU (eager) the scaled pass runs only when a mean square overflowed (the check is free there;
    always scaling cost 1.5-3x); on CUDA without Triton and under torch.func transforms it always runs (no
    host sync, no data-dependent branch for vmap). Skipped under torch.compile and while exporting: one
    pass over the row, `x * rsqrt(ms + eps)` compiled (ops/graph.py: Inductor's cheapest form; on CPU with a
    gain an autograd.Function whose backward sums dweight in row blocks), `x / sqrt(ms + eps)`
    exported (the form onnxruntime fuses). Their range is then fp32's squares': exact for fp16 inputs
    always, and for fp32 and bf16 rows unless a mean square overflows fp32 (values near 1e19, where
    LayerNorm's own variance overflows too).
    """
    check_float(x, residual)
    h = x if residual is None else x + residual
    k = partial_width(h.shape[-1], p)
    export = exporting()
    if torch.compiler.is_compiling() and not export:   # one pass, no branch on the values: ops/graph.py
        y = graph_form.rms_norm_graph(h, weight, eps, k).to(x.dtype)   # x's dtype, not h's: as below
        return y if residual is None else (y, h)
    hf = h.float()
    hk = hf if k == h.shape[-1] else hf[..., :k]
    ms = None
    if export or checked_pass(h):   # exported: one pass, no branch on the values in a graph
        ms = hk.pow(2).mean(-1, keepdim=True)
        if not export and not bool(torch.isfinite(ms).all()):
            ms = None   # a square overflowed: take the scaled pass below
    if ms is None:
        inv = 1.0 / _pow2_floor_at_least_1(hk.detach().abs().amax(-1, keepdim=True))
        hf, eps = hf * inv, eps * inv * inv
        ms = (hk * inv).pow(2).mean(-1, keepdim=True)
    y = hf / torch.sqrt(ms + eps)   # the form onnxruntime's fusion recognises on export
    if weight is not None:
        y = y * weight.float()
    y = y.to(x.dtype).contiguous()   # as LayerNorm's, whatever x's strides: callers .view() it
    return y if residual is None else (y, h)
