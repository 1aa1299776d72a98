"""`rms_norm`: the single entry point every normswap norm module calls.

Backends plug in behind it (a GPU kernel issue adds Triton); today it is the PyTorch path.
"""
from __future__ import annotations

import torch

from normswap.ops.reference import partial_width, rms_norm_reference

__all__ = ["rms_norm", "partial_width", "rms_norm_reference"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
             residual: torch.Tensor | None = None, p: float | None = None):
    """RMSNorm over the last dim; returns y, or (y, x + residual) when `residual` is given."""
    return rms_norm_reference(x, weight, eps, residual=residual, p=p)
