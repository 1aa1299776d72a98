"""The fused C++ CPU RMSNorm (normswap.ops.cpu) against fp64 references: values, gradients, dispatch.

Skipped where the kernel cannot be built (no C++ compiler or ninja): tests/ops/test_cpu_fallback.py covers
that case. The first run builds the kernel (about a minute), later runs load it from the cache.
"""
from __future__ import annotations

import pytest
import torch

from normswap import PartialRMSNorm, RMSNorm, ops
from normswap.ops import cpu, reference

EPS = 1e-6
# Error allowed relative to the reference's largest magnitude: fp32 math, then rounding to the dtype.
TOL = {torch.float32: 2e-6, torch.float64: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module")
def ext():
    module = cpu.extension()
    if module is None:
        pytest.skip("the C++ CPU kernel cannot be built here (see the warning)")
    return module


@pytest.fixture(autouse=True)
def default_backend(monkeypatch):
    monkeypatch.delenv("NORMSWAP_BACKEND", raising=False)


def make(shape, dtype, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def ref64(x, w, residual=None, p=None):
    """fp64 reference: (y,) or (y, h); h is rounded to storage precision first, as the kernels do."""
    h = x if residual is None else x + residual
    y = reference.rms_norm_reference(h.double(), None if w is None else w.double(), EPS, p=p)
    return y if residual is None else (y, h)


def close(actual, expected, dtype, what=""):
    assert actual.shape == expected.shape, what
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    err = (actual.double() - expected.double()).abs().max().item()
    scale = expected.double().abs().max().item() or 1.0
    assert err <= TOL[dtype] * scale, f"{what}: max err {err:.3g} > {TOL[dtype]:.1g} x {scale:.3g}"


def cpu_ops_called(fn) -> set[str]:
    """Names of the normswap::cpu_* ops that `fn` dispatched (the profiler sees every dispatcher call)."""
    with torch.autograd.profiler.profile() as prof:
        fn()
    return {e.name for e in prof.function_events if e.name.startswith("normswap::cpu")}


# ---- forward -------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES + [torch.float64], ids=str)
@pytest.mark.parametrize("d", [1, 7, 16, 100, 768, 4099])
def test_forward_matches_fp64(ext, dtype, d):
    x, w = make((3, 5, d), dtype, scale=3), make(d, dtype, seed=1)
    y = ops.rms_norm(x, w, EPS)
    assert y.dtype == dtype and y.shape == x.shape
    close(y, ref64(x, w), dtype)
    close(ops.rms_norm(x, None, EPS), ref64(x, None), dtype, "no weight")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("p", [0.07, 0.5, 1.0])
def test_partial_rms_matches_fp64(ext, dtype, p):
    x, w = make((6, 100), dtype), make(100, dtype, seed=1)
    close(ops.rms_norm(x, w, EPS, p=p), ref64(x, w, p=p), dtype)


def test_fp32_weight_with_low_precision_input(ext):
    x, w = make((4, 96), torch.bfloat16), make(96, torch.float32, seed=1)
    y = ops.rms_norm(x, w, EPS)
    assert y.dtype == torch.bfloat16
    close(y, ref64(x, w), torch.bfloat16)
    # a weight in a third dtype is converted, not misread
    close(ops.rms_norm(x, w.half(), EPS), ref64(x, w.half()), torch.bfloat16, "fp16 weight")


def test_empty_rows(ext):
    x = torch.empty(0, 5, 64)
    assert ops.rms_norm(x, torch.ones(64), EPS).shape == (0, 5, 64)


def test_overflow_rows_are_scaled(ext):
    # fp32 squares overflow above ~1.8e19: those rows take the power-of-two scaled pass.
    x = make((5, 300), torch.float32)
    x[1] *= 1e30
    x[2, 7] = 3e38
    x[3] *= 1e-30  # tiny rows are never scaled up
    y = ops.rms_norm(x, None, EPS)
    close(y, ref64(x, None), torch.float32)
    # Per-row decision: a row is bit-identical whether or not another row overflowed.
    assert torch.equal(y[0], ops.rms_norm(x[0:1], None, EPS)[0])
    assert torch.equal(y[4], ops.rms_norm(x[4:5], None, EPS)[0])


def test_bf16_huge_values(ext):
    x = make((4, 64), torch.bfloat16) * 1e35
    close(ops.rms_norm(x, None, EPS), ref64(x, None), torch.bfloat16)


def test_nan_and_inf_propagate_like_the_reference(ext):
    x = make((3, 32), torch.float32)
    x[0, 3], x[1, 4] = float("nan"), float("inf")
    y, y_ref = ops.rms_norm(x, None, EPS), reference.rms_norm_reference(x, None, EPS)
    assert torch.isnan(y[:2]).all() and torch.isnan(y_ref[:2]).all()
    close(y[2], y_ref[2].double(), torch.float32)


@pytest.mark.parametrize("layout", ["transposed", "strided_cols", "sliced_rows", "expanded"])
def test_non_contiguous_inputs(ext, layout):
    base = make((8, 6, 64), torch.float32)
    x = {"transposed": base.transpose(0, 1), "strided_cols": make((4, 128), torch.float32)[:, ::2],
         "sliced_rows": base[:, ::2], "expanded": make((1, 64), torch.float32).expand(5, 64)}[layout]
    assert not x.is_contiguous()
    w = make(64, torch.float32, seed=1)
    close(ops.rms_norm(x, w, EPS), ref64(x, w), torch.float32)
    r = make(x.shape, torch.float32, seed=2).transpose(0, -1).contiguous().transpose(0, -1)
    y, h = ops.rms_norm(x, w, EPS, residual=r)
    close(y, ref64(x, w, r)[0], torch.float32, "residual")
    assert torch.equal(h, x + r)


# ---- residual ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("p", [None, 0.25])
def test_residual_add_matches_unfused(ext, dtype, p):
    x, r, w = make((4, 3, 200), dtype), make((4, 3, 200), dtype, seed=2), make(200, dtype, seed=1)
    y, h = ops.rms_norm(x, w, EPS, residual=r, p=p)
    assert torch.equal(h, x + r)  # h is exactly what the unfused add stores
    y_ref, _ = ref64(x, w, r, p=p)
    close(y, y_ref, dtype)


def test_residual_promotion_and_broadcast(ext):
    x, r, w = make((2, 5, 64), torch.bfloat16), make((5, 64), torch.float32, seed=2), make(64, torch.float32, seed=1)
    y, h = ops.rms_norm(x, w, EPS, residual=r)
    assert (y.dtype, h.dtype, h.shape) == (torch.bfloat16, torch.float32, (2, 5, 64))
    assert torch.equal(h, x + r)
    close(y, ref64(x, w, r)[0], torch.bfloat16)
    y64, h64 = ops.rms_norm(x.double(), w, EPS, residual=r.double())
    assert h64.dtype == torch.float64 and torch.equal(h64, x.double() + r.double())


# ---- gradients -----------------------------------------------------------------------------------
def grads(fn, x, w, r, dy, dh):
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in (x, w, r)]
    out = fn(*leaves)
    y, h = out if r is not None else (out, None)
    loss = (y.double() * dy.double()).sum() + ((h.double() * dh.double()).sum() if h is not None else 0)
    loss.backward()
    return [t.grad for t in leaves if t is not None]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("p", [None, 0.3])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("d", [7, 100, 1030])
def test_gradients_match_fp64(ext, dtype, p, with_residual, d):
    x, w, dy = make((9, d), dtype, scale=2), make(d, dtype, seed=1), make((9, d), dtype, seed=3)
    r, dh = (make((9, d), dtype, seed=2), make((9, d), dtype, seed=4)) if with_residual else (None, None)
    ours = grads(lambda a, b, c: ops.rms_norm(a, b, EPS, residual=c, p=p), x, w, r, dy, dh)
    x64, w64 = x.double(), w.double()
    theirs = grads(lambda a, b, c: reference.rms_norm_reference(a, b, EPS, residual=c, p=p),
                   x64, w64, r.double() if r is not None else None, dy, dh)
    for name, a, b in zip(["dx", "dweight", "dresidual"], ours, theirs):
        assert a.dtype == dtype
        close(a, b, dtype, name)


def test_gradients_without_weight_and_of_huge_rows(ext):
    x, dy = make((4, 64), torch.float32), make((4, 64), torch.float32, seed=3)
    x[1] *= 1e30
    (dx,) = grads(lambda a, b, c: ops.rms_norm(a, None, EPS), x, None, None, dy, None)
    (dx64,) = grads(lambda a, b, c: reference.rms_norm_reference(a, None, EPS), x.double(), None, None, dy, None)
    close(dx[[0, 2, 3]], dx64[[0, 2, 3]], torch.float32)
    close(dx[1] * 1e30, dx64[1] * 1e30, torch.float32, "scaled row")


def test_dweight_is_deterministic(ext):
    x, w, dy = make((300, 256), torch.float32), make(256, torch.float32, seed=1), make((300, 256), torch.float32, 1, 3)
    first = grads(lambda a, b, c: ops.rms_norm(a, b, EPS), x, w, None, dy, None)
    again = grads(lambda a, b, c: ops.rms_norm(a, b, EPS), x, w, None, dy, None)
    assert all(torch.equal(a, b) for a, b in zip(first, again))


@pytest.mark.parametrize("used", ["y", "h"])
def test_residual_gradients_when_one_output_is_unused(ext, used):
    """Only y or only h reaches the loss: the other's gradient is never materialised, yet dx, dresidual and
    dweight are those of the fp64 reference (an h-only loss passes dh straight through, dweight None)."""
    x, r, w = make((5, 48), torch.float32), make((5, 48), torch.float32, seed=2), make(48, torch.float32, seed=1)
    dout = make((5, 48), torch.float32, seed=3)
    got = {}
    for name, fn, dt in [("ours", ops.rms_norm, torch.float32),
                         ("ref", reference.rms_norm_reference, torch.float64)]:
        a, b, c = (t.detach().to(dt).clone().requires_grad_() for t in (x, r, w))
        y, h = fn(a, c, EPS, residual=b)
        ((y if used == "y" else h).double() * dout.double()).sum().backward()
        got[name] = [a.grad, b.grad, c.grad]
    for what, a, b in zip(["dx", "dresidual", "dweight"], got["ours"], got["ref"]):
        if b is None:
            assert a is None, what
        else:
            close(a, b, torch.float32, what)


@pytest.mark.parametrize("shape", [(1, 70000), (3, 40000), (600, 256)])
def test_dweight_partials_over_threads(ext, shape):
    """Two threads: one dweight partial per task (each zeroed by its task, one possibly without rows),
    summed; the result is the fp64 reference's."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x, w, dy = make(shape, torch.float32), make(shape[1], torch.float32, seed=1), make(shape, torch.float32, seed=3)
        ours = grads(lambda a, b, c: ops.rms_norm(a, b, EPS), x, w, None, dy, None)
        theirs = grads(lambda a, b, c: reference.rms_norm_reference(a, b, EPS), x.double(), w.double(), None, dy, None)
    finally:
        torch.set_num_threads(before)
    for what, a, b in zip(["dx", "dweight"], ours, theirs):
        close(a, b, torch.float32, what)


def test_op_registration_passes_opcheck(ext):
    x, w = make((3, 40), torch.float32).requires_grad_(), make(40, torch.float32, seed=1).requires_grad_()
    r = make((3, 40), torch.float32, seed=2).requires_grad_()
    torch.library.opcheck(torch.ops.normswap.cpu_rms_norm.default, (x, w, EPS, 20))
    torch.library.opcheck(torch.ops.normswap.cpu_rms_norm_add.default, (x, r, w, EPS, 40))
    torch.library.opcheck(torch.ops.normswap.cpu_rms_norm_backward.default,
                          (x.detach(), r.detach(), torch.rand(3), w.detach(), None, 40, True))


# ---- dispatch, modules, compile, export ----------------------------------------------------------
def test_modules_use_the_kernel_by_default(ext):
    x = make((2, 64), torch.float32)
    assert ops.resolve_backend(x) == "cpu"
    norm, pnorm = RMSNorm(64), PartialRMSNorm(64, p=0.25)
    assert cpu_ops_called(lambda: norm(x)) == {"normswap::cpu_rms_norm"}
    assert cpu_ops_called(lambda: norm(x, residual=x)) == {"normswap::cpu_rms_norm_add"}
    close(pnorm(x), ref64(x, pnorm.weight.detach(), p=0.25), torch.float32)
    with torch.inference_mode():  # no autograd key at all: straight to the CPU kernel
        close(norm(x), ref64(x, norm.weight.detach()), torch.float32, "inference mode")


def test_backend_setting_is_seen_at_the_next_call(ext, monkeypatch):
    norm, x = RMSNorm(64), make((2, 64), torch.float32)
    norm(x)
    monkeypatch.setenv("NORMSWAP_BACKEND", "torch")
    assert cpu_ops_called(lambda: norm(x)) == set()
    assert torch.equal(norm(x), reference.rms_norm_reference(x, norm.weight, norm.eps))
    monkeypatch.setenv("NORMSWAP_BACKEND", "cpu")
    assert cpu_ops_called(lambda: norm(x)) == {"normswap::cpu_rms_norm"}


def test_bad_inputs_give_one_line_errors(ext):
    with pytest.raises(TypeError, match="floating-point"):
        ops.rms_norm(torch.ones(2, 4, dtype=torch.int64), None, EPS)
    with pytest.raises(RuntimeError, match=r"weight must have shape \(4\)"):
        ops.rms_norm(torch.ones(2, 4), torch.ones(5), EPS)
    with pytest.raises(RuntimeError, match="partial width"):
        torch.ops.normswap.cpu_rms_norm(torch.ones(2, 4), None, EPS, 5)


def test_ops_compile_with_their_fake_and_autograd(ext):
    x, w = make((4, 96), torch.float32), make(96, torch.float32, seed=1)
    r, dy = make((4, 96), torch.float32, seed=2), make((4, 96), torch.float32, seed=3)

    def f(a, b, c):
        y, h, _ = torch.ops.normswap.cpu_rms_norm_add(a, c, b, EPS, 48)
        return y * 2 + h
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    got = grads(lambda a, b, c: (compiled(a, b, c), c), x, w, r, dy, torch.zeros_like(dy))
    want = grads(lambda a, b, c: (f(a, b, c), c), x, w, r, dy, torch.zeros_like(dy))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_modules_under_compile_take_the_decomposition(ext):
    norm, x = RMSNorm(64), make((3, 64), torch.float32)
    graphs = []

    def backend(gm, inputs):   # the graph's code with its subgraphs' (ops/graph.py's autograd.Function)
        graphs.append("".join(m.code for m in gm.modules() if isinstance(m, torch.fx.GraphModule)))
        return gm.forward
    y = torch.compile(norm, fullgraph=True, backend=backend)(x)
    assert len(graphs) == 1 and "cpu_rms_norm" not in graphs[0] and "sqrt" in graphs[0]
    close(y, ref64(x, norm.weight.detach()), torch.float32)


def test_func_transforms_and_forward_ad_take_the_pytorch_path(ext):
    import torch.autograd.forward_ad as fwad
    norm, x = RMSNorm(16), make((3, 4, 16), torch.float32)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    w = norm.weight.detach()
    close(torch.vmap(norm)(x), ref64(x, w), torch.float32, "vmap")
    (dx,) = grads(lambda a, b, c: norm(a), x, None, None, torch.ones_like(x), None)
    close(torch.func.grad(lambda t: norm(t).sum())(x), dx, torch.float32, "func.grad")
    tangent = make(x.shape, torch.float32, seed=5)
    with fwad.dual_level():
        jvp = fwad.unpack_dual(norm(fwad.make_dual(x, tangent))).tangent
    _, jvp_ref = torch.func.jvp(lambda t: reference.rms_norm_reference(t.double(), w.double(), norm.eps),
                                (x,), (tangent,))
    close(jvp, jvp_ref, torch.float32, "forward AD")


def test_export_and_tracing_take_the_pytorch_path(ext):
    norm, x = RMSNorm(32), make((2, 32), torch.float32)
    graph = torch.export.export(norm, (x,)).graph_module.code
    assert "cpu_rms_norm" not in graph and "sqrt" in graph
    traced = torch.jit.trace(norm, (x,))
    assert "cpu_rms_norm" not in str(traced.graph)
    close(traced(x), ref64(x, norm.weight.detach()), torch.float32)
