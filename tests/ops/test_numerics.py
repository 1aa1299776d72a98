"""RMSNorm numerics at the edges: eps, huge and tiny rows, exact pRMSNorm widths, integer inputs."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import normswap  # noqa: E402
from normswap import PartialRMSNorm, RMSNorm  # noqa: E402
from normswap.errors import NormswapError  # noqa: E402
from normswap.ops import partial_width, reference  # noqa: E402
from helpers.tiny import tiny_model  # noqa: E402

EPS = 1e-6


def fp64_rms(x: torch.Tensor, w: torch.Tensor, k: int, eps: float = EPS) -> torch.Tensor:
    x = x.double()
    return x / torch.sqrt(x[..., :k].pow(2).mean(-1, keepdim=True) + eps) * w.double()


@pytest.mark.parametrize("eps", [0, 0.0, -1e-6, float("nan"), float("inf"), "x", None])
@pytest.mark.parametrize("cls", [RMSNorm, PartialRMSNorm])
def test_bad_eps_is_refused(cls, eps):
    with pytest.raises(ValueError, match="eps"):
        cls(8, eps=eps)


def test_convert_refuses_a_layernorm_with_eps_zero_before_editing():
    model = tiny_model("gpt2")
    model.transformer.h[1].ln_2.eps = 0.0
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(NormswapError, match=r"transformer\.h\.1\.ln_2: eps must be positive"):
        normswap.convert(model, method="exact")
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert not any(isinstance(m, RMSNorm) for m in model.modules())


def test_partial_width_is_exact_ceil():
    assert partial_width(100, 0.07) == 7
    for d in (1, 7, 64, 100, 768, 1000, 4096, 12288):
        for i in range(1, 1001):
            assert partial_width(d, i / 1000) == max(1, -(-i * d // 1000)), (d, i)   # integer ceil
    for d, i in ((100, 70000001), (65536, 1)):   # just above an integer still rounds up
        assert partial_width(d, i / 1e9) == -(-i * d // 10**9)
    for bad in (0, -0.1, 1.5, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            partial_width(8, bad)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_integer_inputs_are_refused(dtype):
    x = torch.arange(8).reshape(1, 8).to(dtype)
    with pytest.raises(TypeError, match="floating-point"):
        RMSNorm(8)(x)
    with pytest.raises(TypeError, match="floating-point"):
        reference.rms_norm_reference(x, None, EPS)
    with pytest.raises(TypeError, match="floating-point"):
        RMSNorm(8)(torch.ones(1, 8), residual=x)


def _rows(dtype, scales, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(len(scales), d, generator=g, dtype=torch.float64) * torch.tensor(scales).double()[:, None]
    return x.to(dtype)


SCALES = [1e-30, 1e-3, 1.0, 3e4, 1e19, 1e25, 1e30, 1e36]   # fp32 squares overflow above ~1.8e19


@pytest.fixture(params=["cpu-eager", "always-scaled"])
def torch_path(request, monkeypatch):
    """The two safe PyTorch paths: CPU eager (scaled pass on overflow only) and CUDA without Triton or a
    torch.func transform (always scaled)."""
    if request.param == "always-scaled":
        monkeypatch.setattr(reference, "checked_pass", lambda h: False)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("p", [None, 0.25])
def test_torch_path_huge_and_tiny_rows_match_fp64(dtype, p, torch_path):
    x = _rows(dtype, SCALES)
    w = torch.rand(64, generator=torch.Generator().manual_seed(1), dtype=torch.float64) + 0.5
    y = reference.rms_norm_reference(x, w.to(dtype), EPS, p=p)
    want = fp64_rms(x, w.to(dtype), partial_width(64, p))
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert torch.isfinite(y).all() and (y.double() - want).abs().max() <= tol * want.abs().max()
    assert (y[1:].double().abs().amax(-1) > 0.1).all()   # no row collapsed to 0 (row 0 is below eps)


def test_torch_path_gradient_at_huge_scale_matches_fp64(torch_path):
    x = _rows(torch.float32, [1e25, 1.0, 1e30]).requires_grad_()
    x64 = x.detach().double().requires_grad_()
    dy = torch.randn(3, 64, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    reference.rms_norm_reference(x, None, EPS).backward(dy.float())
    fp64_rms(x64, torch.ones(64), 64).backward(dy)
    rel = ((x.grad.double() - x64.grad).abs().amax(-1) / x64.grad.abs().amax(-1))
    assert (rel <= 1e-5).all(), rel


def test_scaling_changes_no_bit_in_the_normal_range(torch_path):
    x = _rows(torch.float32, [1e-3, 1.0, 7.0, 3e4, 1e9] * 4)
    w = torch.rand(64) + 0.5
    hf = x.float()
    plain = (hf / torch.sqrt(hf.pow(2).mean(-1, keepdim=True) + EPS) * w).to(x.dtype)
    assert torch.equal(reference.rms_norm_reference(x, w, EPS), plain)


triton = pytest.importorskip("triton")
from normswap.ops import triton_kernels as K  # noqa: E402


@pytest.mark.skipif(not torch.cuda.is_available() and not K.INTERPRETED, reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("max_block, p", [(None, None), (16, None), (16, 0.4)])
def test_triton_huge_and_tiny_rows_match_fp64(dtype, max_block, p):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x = _rows(dtype, SCALES).to(dev)
    w = (torch.rand(64, generator=torch.Generator().manual_seed(1)) + 0.5).to(dtype).to(dev)
    k = partial_width(64, p)
    y, _, rstd = K.rms_norm_fwd(x, w, EPS, k, max_block=max_block)
    want = fp64_rms(x.cpu(), w.cpu(), k)
    tol = 2e-6 if dtype == torch.float32 else 1.6e-2
    assert torch.isfinite(y).all() and ((y.cpu().double() - want).abs().amax(-1) <= tol * want.abs().amax(-1)).all()
    # backward, whose rstd^3 term used to underflow at these scales
    x64 = x.cpu().double().requires_grad_()
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    fp64_rms(x64, w.cpu(), k).backward(dy)
    dx, dw = K.rms_norm_bwd(dy.to(dtype).to(dev), x, rstd, w, k, max_block=max_block)
    rows = x64.grad.abs().amax(-1)
    assert ((dx.cpu().double() - x64.grad).abs().amax(-1) <= 4 * tol * rows).all()
    assert torch.isfinite(dw).all()


# ---- torch.compile: one pass over the row ---------------------------------------------------------------

REDUCTIONS = {"sum", "mean", "amax", "amin", "max", "min", "var", "var_mean", "prod"}


def _graphs(fn, *args) -> tuple[list[tuple], list[tuple]]:
    """The reductions, (name, dims, input rank), of the forward and backward graphs torch.compile hands
    its compiler."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    seen: dict[str, list[tuple]] = {}

    def reduction(n):
        name = n.target.__name__.split(".")[0]
        rank = n.args[0].meta["val"].dim()
        dims = n.args[1] if len(n.args) > 1 else list(range(rank))
        return name, tuple(d % rank for d in dims), rank

    def keep(kind):
        def compiler(gm, _):
            seen[kind] = [reduction(n) for n in gm.graph.nodes if n.op == "call_function"
                          and getattr(n.target, "__name__", "").split(".")[0] in REDUCTIONS]
            return make_boxed_func(gm.forward)
        return compiler
    torch._dynamo.reset()
    out = torch.compile(fn, backend=aot_autograd(fw_compiler=keep("fw"), bw_compiler=keep("bw")))(*args)
    out.float().pow(2).sum().backward()
    return seen["fw"], seen["bw"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_norm_reduces_each_row_once_forward_and_backward(dtype):
    """Compiled RMSNorm: one reduction over the row forward (the mean square), one backward (sum dy*w*x);
    the weight's gradient reduces over rows only (in row blocks, ops/graph.py); no max pass for overflow."""
    norm = RMSNorm(64).to(dtype)
    x = torch.randn(4, 8, 64, dtype=dtype, requires_grad=True)
    fw, bw = _graphs(norm, x)
    assert fw == [("mean", (2,), 3)], fw
    over_rows = [r for r in bw if r[2] - 1 in r[1]]
    assert [r[0] for r in over_rows] == ["sum"] and len(over_rows[0][1]) == 1, bw
    assert {r[0] for r in bw} == {"sum"} and len(bw) > 1, bw


@pytest.mark.parametrize("dtype,scale,tol", [(torch.float16, 1e4, 2e-3), (torch.float32, 1e18, 1e-6),
                                             (torch.bfloat16, 1e18, 1e-2), (torch.float32, 1e-30, 1e-6)])
def test_compiled_norm_matches_fp64_over_the_documented_range(dtype, scale, tol):
    """The plain form under torch.compile: fp16 never overflows fp32 squares; fp32/bf16 rows up to ~1e18."""
    x = _rows(dtype, [scale, 1.0, 1e-3])
    w = torch.rand(64, generator=torch.Generator().manual_seed(1), dtype=torch.float64) + 0.5
    y = torch.compile(lambda a: reference.rms_norm_reference(a, w.to(dtype), EPS), backend="aot_eager")(x)
    want = fp64_rms(x, w.to(dtype), 64)
    assert torch.isfinite(y).all() and ((y.double() - want).abs().amax(-1) <= tol * want.abs().amax(-1) + 1e-30).all()


def test_compiled_norm_does_not_guard_on_the_environment():
    """The backend setting is read once, at trace time, as a constant: the guards a compiled norm checks at
    every call do not walk the process environment (os.environ's mapping: ~50 us a call, measured)."""
    cache_entries = getattr(torch._dynamo.eval_frame, "_debug_get_cache_entry_list", None)
    if cache_entries is None:
        pytest.skip("this torch does not expose dynamo's cache entries")
    norm, x = RMSNorm(32), torch.randn(2, 32)
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(norm, backend="eager")(x)
    (entry,) = cache_entries(RMSNorm.forward.__code__)
    guards = str(entry.guard_manager)
    assert "rms_norm" in guards and "environ" not in guards
    # a CPU tensor under compile goes straight to the decomposition: no backend resolution traced (and guarded)
    assert "resolve_backend" not in guards and "_pytorch_form_needed" not in guards
