"""Pure-PyTorch RMSNorm: the CPU path, the ONNX-export path and the fallback when Triton is absent."""
from __future__ import annotations

import math

import torch


def partial_width(d: int, p: float | None) -> int:
    """Number of leading features pRMSNorm uses to estimate the RMS: ceil(p * d), at least 1."""
    if p is None:
        return d
    if not 0.0 < p <= 1.0:
        raise ValueError(f"p must be in (0, 1], got {p}")
    return max(1, min(d, math.ceil(p * d)))


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                       residual: torch.Tensor | None = None, p: float | None = None):
    """y = x / sqrt(mean(x[..., :k]^2) + eps) * weight, squares and mean in fp32, y in x's dtype.

    With `residual`, h = x + residual is normalised and (y, h) is returned.
    """
    h = x if residual is None else x + residual
    hf = h.float()
    k = partial_width(h.shape[-1], p)
    ms = (hf if k == h.shape[-1] else hf[..., :k]).pow(2).mean(-1, keepdim=True)
    # x / sqrt(.) rather than x * rsqrt(.): the form onnxruntime's fusion recognises on export.
    y = hf / torch.sqrt(ms + eps)
    if weight is not None:
        y = y * weight.float()
    y = y.to(x.dtype)
    return y if residual is None else (y, h)
