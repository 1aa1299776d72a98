"""The compiled CPU form (normswap/ops/graph.py): its written backward and blocked dweight sum against fp64."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():   # Inductor imports Triton: keep it interpreted for the kernel tests after
    os.environ.setdefault("TRITON_INTERPRET", "1")

from normswap import PartialRMSNorm, RMSNorm  # noqa: E402
from normswap.ops import graph, reference  # noqa: E402

EPS = 1e-5


def fp64_grads(x, w, dy, k, residual=None):
    """(y, dx, dw) of RMSNorm(x [+ residual]) in fp64, by autograd of the textbook formula."""
    xd = x.detach().double().requires_grad_()
    wd = w.detach().double().requires_grad_()
    h = xd if residual is None else xd + residual.double()
    y = h / torch.sqrt(h[..., :k].pow(2).mean(-1, keepdim=True) + EPS) * wd
    return (y, *torch.autograd.grad(y, (xd, wd), dy.double()))


def rel(a, b) -> float:
    return float((a.double() - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("plain", [False, True])
@pytest.mark.parametrize("rows", [0, 1, 15, 16, 17, 50])
def test_column_sum_is_the_sum_over_every_leading_dim(rows, plain):
    t = torch.randn(rows, 3, 40, generator=torch.Generator().manual_seed(rows))
    got = graph.column_sum(t, plain)
    assert got.shape == (40,)
    torch.testing.assert_close(got.double(), t.double().sum((0, 1)), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2), (torch.float16, 3e-3)])
@pytest.mark.parametrize("p,with_residual", [(None, False), (0.3, False), (None, True), (0.3, True)])
def test_traced_form_matches_fp64(dtype, tol, p, with_residual):
    """The function torch.compile traces (aot_eager: the graph as traced, no codegen): y, dx and dweight."""
    torch._dynamo.reset()   # one lambda's code object across the cases: no recompile limit
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 11, 48, generator=g) * 3).to(dtype).requires_grad_()
    w = (torch.rand(48, generator=g) + 0.5).to(dtype).requires_grad_()
    r = torch.randn(3, 11, 48, generator=g).to(dtype) if with_residual else None
    dy = torch.randn(3, 11, 48, generator=g).to(dtype)
    fn = torch.compile(lambda a, b: reference.rms_norm_reference(a, b, EPS, residual=r, p=p),
                       backend="aot_eager", fullgraph=True)
    out = fn(x, w)
    y = out if r is None else out[0]
    got = (y, *torch.autograd.grad(y, (x, w), dy))
    want = fp64_grads(x, w, dy, reference.partial_width(48, p), r)
    assert y.dtype == dtype and got[2].dtype == dtype
    errors = [rel(a, b) for a, b in zip(got, want)]
    assert max(errors) < tol, errors


@pytest.mark.parametrize("cls,dtype,rows,tol", [
    (RMSNorm, torch.float32, 37, 2e-6), (PartialRMSNorm, torch.float32, 37, 2e-6),   # dweight in one pass
    (RMSNorm, torch.float32, 4111, 2e-6),   # over PLAIN_FP32: 256 row blocks and a remainder of 15
    (RMSNorm, torch.bfloat16, 37, 2e-2), (RMSNorm, torch.bfloat16, 48, 2e-2)])   # blocks and a rest; none
def test_inductor_code_matches_fp64(cls, dtype, rows, tol):
    """The modules compiled by Inductor (generated C++), each dweight sum the backward chooses."""
    assert (rows * 64 > graph.PLAIN_FP32) == (rows == 4111)
    torch._dynamo.reset()
    norm = cls(64, eps=EPS, **({"p": 0.25} if cls is PartialRMSNorm else {})).to(dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows, 64, generator=g).to(dtype).requires_grad_()
    dy = torch.randn(rows, 64, generator=g).to(dtype)
    y = torch.compile(norm, fullgraph=True)(x)
    got = (y, *torch.autograd.grad(y, (x, norm.weight), dy))
    want = fp64_grads(x, norm.weight, dy, 16 if cls is PartialRMSNorm else 64)
    errors = [rel(a, b) for a, b in zip(got, want)]
    assert max(errors) < tol, errors


def test_only_where_its_function_serves():
    """Not without a gain, nor under torch.func transforms or forward-mode AD (no vmap rule, no jvp)."""
    import torch.autograd.forward_ad as fwad
    x, w = torch.randn(2, 8), torch.ones(8)
    assert graph.applies(x, w) and not graph.applies(x, None)
    seen = []
    torch.func.vmap(lambda row: seen.append(graph.applies(row, w)) or row)(x)
    with fwad.dual_level():
        seen.append(graph.applies(fwad.make_dual(x, torch.ones_like(x)), w))
    assert seen == [False, False]
