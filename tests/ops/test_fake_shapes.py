"""The shape-only forms torch.compile and torch.export trace through: one set (`ops.fakes`), registered for
the Triton custom ops and the C++ ops alike, each agreeing with what its kernel returns."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from normswap.ops import cpu, fakes  # noqa: E402

EPS = 1e-6
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRITON = {"forward": "rms_norm_fwd", "forward_add": "rms_norm_add_fwd", "backward": "rms_norm_bwd"}
CPU = {"forward": "cpu_rms_norm", "forward_add": "cpu_rms_norm_add", "backward": "cpu_rms_norm_backward"}


def cases(x, r, w):
    """(fake, args) for the forward, the fused-add forward and the backward (with and without dw)."""
    rstd = torch.rand(x.shape[0], device=x.device)
    return [("forward", (x, w, EPS, 20)), ("forward_add", (x, r, w, EPS, 40)),
            ("backward", (x.detach(), r.detach(), rstd, w.detach(), None, 40, True)),
            ("backward", (x.detach(), r.detach(), rstd, None, r.detach(), 40, False))]


def tensors():
    g = torch.Generator().manual_seed(0)
    x, r = (torch.randn(3, 40, generator=g).to(DEVICE).requires_grad_() for _ in range(2))
    return x, r, torch.rand(40, generator=g).to(DEVICE).requires_grad_()


def test_the_fakes_give_the_shapes_of_each_output():
    x, r, w = tensors()
    y, rstd = fakes.forward(x, w, EPS, 20)
    assert (y.shape, y.dtype, rstd.shape, rstd.dtype) == (x.shape, x.dtype, (3,), torch.float32)
    assert [t.shape for t in fakes.forward_add(x, r, w, EPS, 40)] == [x.shape, x.shape, (3,)]
    assert [t.shape for t in fakes.backward(x, x, rstd, w, None, 40, True)] == [x.shape, w.shape]
    assert [t.shape for t in fakes.backward(x, x, rstd, None, None, 40, True)] == [x.shape, (0,)]
    assert [t.shape for t in fakes.backward(x, x, rstd, w, None, 40, False)] == [x.shape, (0,)]


def test_the_triton_ops_pass_opcheck():
    pytest.importorskip("triton")
    from normswap.ops import triton_kernels
    if DEVICE == "cpu" and not triton_kernels.INTERPRETED:
        pytest.skip("Triton kernels on CPU need TRITON_INTERPRET=1 at import")
    import normswap.ops.autograd  # noqa: F401  registers torch.ops.normswap.rms_norm_*
    for name, args in cases(*tensors()):
        torch.library.opcheck(getattr(torch.ops.normswap, TRITON[name]).default, args)


def test_the_cpu_ops_pass_opcheck_with_the_same_fakes():
    if DEVICE != "cpu" or cpu.extension() is None:
        pytest.skip("the C++ CPU kernel is for CPU tensors and could not be built here")
    for name, args in cases(*tensors()):
        torch.library.opcheck(getattr(torch.ops.normswap, CPU[name]).default, args)
