"""`rms_norm`: the single entry point every normswap norm module calls, and the backend choice behind it.

NORMSWAP_BACKEND:
  auto   (default) Triton kernels for CUDA tensors when Triton is importable; the fused C++ kernel
         (`ops.cpu`, built at first use) for CPU tensors, or the PyTorch path where it cannot be built;
  cpu    the C++ kernel for CPU tensors, an error where it cannot be built;
  triton the Triton kernels always; CPU tensors need TRITON_INTERPRET=1 (how CI tests them);
  torch  the pure-PyTorch reference.
ONNX export and TorchScript tracing always take the PyTorch path: its ops export, a custom op does not.
So do torch.compile on CPU (Inductor fuses the decomposition with its neighbours, which the opaque C++
op would prevent: measured in benchmarks/RESULTS.md, "CPU kernel"), torch.func transforms and
forward-mode AD (the C++ autograd supports neither).

Eager CPU calls decide once per NORMSWAP_BACKEND value (a change is seen at the next call) and then go
straight to C++: no per-call backend resolution, export check or input check in Python.
"""
from __future__ import annotations

import functools
import importlib.util
import os

import torch
import torch.autograd.forward_ad as _fwad

from normswap.ops.reference import check_eps, check_float, partial_width, rms_norm_reference
from normswap.ops.reference import exporting as _exporting

__all__ = ["rms_norm", "partial_width", "check_eps", "rms_norm_reference", "resolve_backend", "plain_inference",
           "BACKENDS"]

BACKENDS = ("auto", "cpu", "triton", "torch")
HAS_TRITON = importlib.util.find_spec("triton") is not None
ENV = "NORMSWAP_BACKEND"

# os.environ.get costs ~0.6 us (key encoding, a Python-level mapping): too much for a 3 us decode-size
# norm. Its backing dict gives the raw value in ~30 ns; fall back to the public API where it is absent.
try:
    _env_raw = os.environ._data.get  # type: ignore[attr-defined]
    _ENV_KEY = os.environ.encodekey(ENV)  # type: ignore[attr-defined]
except AttributeError:  # not CPython's os.environ
    _env_raw, _ENV_KEY = os.environ.get, ENV
_is_compiling = torch.compiler.is_compiling
_is_tracing = torch._C._is_tracing
_functorch_active = torch._C._are_functorch_transforms_active


# Under torch.compile the choice is read once, when the graph is traced, and taken as a constant: reading
# os.environ inside the graph made dynamo guard on the environment, which cost every compiled call ~50 us.
@torch.compiler.assume_constant_result
def _setting() -> str:
    choice = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if choice not in BACKENDS:
        raise ValueError(f"{ENV} must be one of {', '.join(BACKENDS)}, got {choice!r}")
    return choice


def _pytorch_form_needed() -> bool:
    """torch.compile or export (is_compiling), TorchScript tracing, a torch.func transform or forward-mode
    AD: the C++ op (its C++ autograd) serves none of them, the PyTorch form serves all."""
    return _is_compiling() or _is_tracing() or _functorch_active() or _fwad._current_level >= 0


def _cpu_module(required: bool):
    """The compiled CPU kernel module (built at the first call), or None where it cannot be built."""
    from normswap.ops import cpu
    module = cpu.extension()
    if module is None and required:
        raise RuntimeError(f"{ENV}=cpu but the C++ CPU kernel could not be built (see the warning above)")
    return module


def resolve_backend(x: torch.Tensor) -> str:
    """'cpu', 'triton' or 'torch': the backend `rms_norm` will use for `x` under the current settings."""
    choice = _setting()
    if choice == "torch" or _exporting():
        return "torch"
    if choice == "triton":
        if not HAS_TRITON:
            raise RuntimeError(f"{ENV}=triton but Triton is not installed (pip install normswap[gpu])")
        return "triton"
    if x.device.type == "cpu":
        if _pytorch_form_needed():
            return "torch"
        return "cpu" if _cpu_module(choice == "cpu") is not None else "torch"
    return "triton" if HAS_TRITON and x.is_cuda else "torch"


@functools.lru_cache(maxsize=1)
def _eager_module(raw):
    """The C++ module for eager CPU calls under the raw NORMSWAP_BACKEND value `raw`, else None: decided once
    per value (an error, NORMSWAP_BACKEND=cpu where the kernel cannot be built, again at the next call)."""
    choice = _setting()
    return _cpu_module(choice == "cpu") if choice in ("auto", "cpu") else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
             residual: torch.Tensor | None = None, p: float | None = None):
    """RMSNorm over the last dim (pRMSNorm when p is given); returns y, or (y, x + residual) with `residual`."""
    if x.is_cpu:
        if _is_compiling():
            # torch.compile / export of a CPU tensor: the decomposition, reached with few calls (each call
            # traced here is a guard that every compiled call evaluates)
            if _setting() != "triton":
                return rms_norm_reference(x, weight, eps, residual=residual, p=p)
        elif not _pytorch_form_needed():
            fast = _eager_module(_env_raw(_ENV_KEY))
            if fast is not None:  # checks, promotion and broadcasting happen in C++
                k = -1 if p is None else partial_width(x.shape[-1], p)
                if residual is None:
                    return fast.rms_norm(x, weight, eps, k)
                return fast.rms_norm_add(x, residual, weight, eps, k)
    check_float(x, residual)
    if resolve_backend(x) == "triton":
        from normswap.ops.autograd import rms_norm_triton
        return rms_norm_triton(x, weight, eps, residual=residual, p=p, direct=plain_inference(x, weight, residual))
    return rms_norm_reference(x, weight, eps, residual=residual, p=p)


_dispatch_modes = torch._C._len_torch_dispatch_stack
_function_modes = torch._C._is_torch_function_mode_enabled
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def plain_inference(*tensors: torch.Tensor | None) -> bool:
    """Eager mode, nothing intercepting ops, plain tensors (parameters included), no gradient to record: a
    kernel can be launched as it is, without a custom op's dispatch. Under torch.compile the first test
    decides, so nothing after it is traced."""
    if _pytorch_form_needed() or _dispatch_modes() or _function_modes():
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t is not None and (type(t) not in _PLAIN or (grad and t.requires_grad)):
            return False
    return True
