"""`rms_norm`: the single entry point every normswap norm module calls, and the backend choice behind it.

NORMSWAP_BACKEND (read at each call):
  auto   (default) Triton kernels for CUDA tensors when Triton is importable, PyTorch otherwise;
  triton the kernels always; CPU tensors need TRITON_INTERPRET=1 (how CI tests them);
  torch  the pure-PyTorch reference.
ONNX export and TorchScript tracing always take the PyTorch path: its ops export, a custom op does not.
"""
from __future__ import annotations

import importlib.util
import os

import torch

from normswap.ops.reference import check_eps, check_float, partial_width, rms_norm_reference
from normswap.ops.reference import exporting as _exporting

__all__ = ["rms_norm", "partial_width", "check_eps", "rms_norm_reference", "resolve_backend", "BACKENDS"]

BACKENDS = ("auto", "triton", "torch")
HAS_TRITON = importlib.util.find_spec("triton") is not None


def resolve_backend(x: torch.Tensor) -> str:
    """'triton' or 'torch': the backend `rms_norm` will use for `x` under the current settings."""
    choice = os.environ.get("NORMSWAP_BACKEND", "auto").strip().lower() or "auto"
    if choice not in BACKENDS:
        raise ValueError(f"NORMSWAP_BACKEND must be one of {', '.join(BACKENDS)}, got {choice!r}")
    if choice == "torch" or _exporting():
        return "torch"
    if choice == "triton":
        if not HAS_TRITON:
            raise RuntimeError("NORMSWAP_BACKEND=triton but Triton is not installed (pip install normswap[gpu])")
        return "triton"
    return "triton" if HAS_TRITON and x.is_cuda else "torch"


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
             residual: torch.Tensor | None = None, p: float | None = None):
    """RMSNorm over the last dim (pRMSNorm when p is given); returns y, or (y, x + residual) with `residual`."""
    check_float(x, residual)
    if resolve_backend(x) == "triton":
        from normswap.ops.autograd import rms_norm_triton
        return rms_norm_triton(x, weight, eps, residual=residual, p=p)
    return rms_norm_reference(x, weight, eps, residual=residual, p=p)
