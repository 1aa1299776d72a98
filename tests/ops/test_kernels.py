"""RMSNorm kernels against fp64 references: Triton (interpreter on CPU, or CUDA), the PyTorch path, dispatch.

CPU runs need TRITON_INTERPRET=1 before the kernels module is imported (`make test` sets it; this file
sets it too when no CUDA device is present). Shapes are small: the interpreter runs programs one by one.
"""
from __future__ import annotations

import collections
import contextlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from normswap import PartialRMSNorm, RMSNorm, ops  # noqa: E402
from normswap.ops import cpu, reference, tuning, triton_kernels as K  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEVICE == "cpu" and not K.INTERPRETED,
                                reason="Triton kernels on CPU need TRITON_INTERPRET=1 at import")

# Error allowed relative to the reference's largest magnitude. bf16 is loose: the interpreter truncates
# on conversion instead of rounding, doubling bf16's 2^-8 step.
TOL = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
EPS = 1e-6


@pytest.fixture
def triton_backend(monkeypatch):
    monkeypatch.setenv("NORMSWAP_BACKEND", "triton")


@pytest.fixture
def small_block(monkeypatch):
    """Force column-block looping at test-sized widths."""
    monkeypatch.setattr(K, "MAX_BLOCK", 16)


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str = "") -> None:
    """|actual - expected| <= tol * max|expected| elementwise, expected in fp64."""
    assert actual.shape == expected.shape, what
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    err = (actual.double() - expected).abs().max().item()
    scale = expected.abs().max().item() or 1.0
    assert err <= TOL[dtype] * scale, f"{what}: max err {err:.3g} > {TOL[dtype]:.1g} x {scale:.3g}"


def make(shape, dtype, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype).to(DEVICE)


def run(fn, x, w, residual=None, dy=None, dh=None):
    """Forward + backward of `fn`; returns outputs and input grads (x, w, residual)."""
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in (x, w, residual)]
    xl, wl, rl = leaves
    out = fn(xl, wl, rl)
    y, h = out if rl is not None else (out, None)
    loss = (y.double() * dy.double()).sum()
    if dh is not None:
        loss = loss + (h.double() * dh.double()).sum()
    loss.backward()
    return y, h, [t.grad if t is not None else None for t in leaves]


def check_against_fp64(x, w, residual=None, p=None, with_dh=True):
    """Triton forward and backward vs the reference evaluated in fp64 on the same (rounded) inputs."""
    dtype = x.dtype
    dy = make(x.shape, dtype, seed=7)
    dh = make(x.shape, dtype, seed=8) if residual is not None and with_dh else None
    y, h, grads = run(lambda a, b, c: ops.rms_norm(a, b, EPS, residual=c, p=p), x, w, residual, dy, dh)
    d64 = [t.double() if t is not None else None for t in (x, w, residual)]
    y_ref, h_ref, grads_ref = run(lambda a, b, c: reference.rms_norm_reference(a, b, EPS, residual=c, p=p),
                                  *d64, dy=dy, dh=dh)
    assert y.dtype == dtype
    close(y, y_ref, dtype, "y")
    if residual is not None:
        close(h, h_ref, dtype, "h")
    for name, g, g_ref in zip(("dx", "dweight", "dresidual"), grads, grads_ref):
        if g_ref is not None:
            assert g.dtype == dtype, name
            close(g, g_ref, dtype, name)


DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (leading shape, width, force column-block looping)
CASES = [((1,), 7, False), ((33,), 96, False), ((2, 3), 200, True), ((1,), 1000, True)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("lead,d,looping", CASES, ids=lambda c: str(c))
@pytest.mark.parametrize("p", [None, 0.25])
def test_forward_backward_vs_fp64(triton_backend, monkeypatch, dtype, lead, d, looping, p):
    if looping:
        monkeypatch.setattr(K, "MAX_BLOCK", 64)
    x, w = make((*lead, d), dtype), make(d, dtype, seed=1) + 1
    check_against_fp64(x, w, p=p)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("looping", [False, True])
@pytest.mark.parametrize("p", [None, 0.3])
def test_fused_residual_vs_fp64(triton_backend, monkeypatch, dtype, looping, p):
    if looping:
        monkeypatch.setattr(K, "MAX_BLOCK", 16)
    x, r, w = make((3, 4, 70), dtype), make((3, 4, 70), dtype, seed=2), make(70, dtype, seed=1)
    check_against_fp64(x, w, residual=r, p=p)


def test_fused_residual_h_unused_and_no_weight(triton_backend):
    x, r = make((5, 40), torch.float32), make((5, 40), torch.float32, seed=2)
    check_against_fp64(x, None, residual=r, with_dh=False)


def test_no_weight(triton_backend, small_block):
    check_against_fp64(make((4, 50), torch.float16), None, p=0.5)


def test_wide_rows_beyond_64k(triton_backend):
    # The default block limit, not a shrunk one: 70,001 columns loop over 16K-wide blocks.
    d = 70_001
    check_against_fp64(make((2, d), torch.bfloat16), make(d, torch.bfloat16, seed=1))


def test_fp16_large_values_stay_finite(triton_backend, small_block):
    # |x| ~ 300: x^2 ~ 9e4 overflows fp16 (max 65504) unless squared in fp32.
    x = make((6, 48), torch.float16, scale=300.0)
    assert (x.float().abs() > 256).any()
    check_against_fp64(x, make(48, torch.float16, seed=1), residual=make((6, 48), torch.float16, 300.0, 3))
    check_against_fp64(x, make(48, torch.float16, seed=1))


def test_non_contiguous_inputs(triton_backend):
    base = make((4, 6, 64), torch.float32)
    w = make(32, torch.float32, seed=1)
    check_against_fp64(base[..., ::2], w)                            # column stride 2: copied
    check_against_fp64(base[..., 10:42], w)                          # row stride 64 > width: strided rows
    check_against_fp64(base[..., :32].transpose(0, 1), w)            # permuted leading dims
    check_against_fp64(base[..., :32], w, residual=base[..., 32:].transpose(0, 1).transpose(0, 1))
    dy = torch.ones(1, 32, device=DEVICE).expand(24, 32)             # stride-0 upstream gradient
    x = base[..., :32].reshape(24, 32).clone().requires_grad_()
    ops.rms_norm(x, None, EPS).backward(dy)
    x64 = x.detach().double().requires_grad_()
    reference.rms_norm_reference(x64, None, EPS).backward(dy.double())
    close(x.grad, x64.grad, torch.float32, "dx (expanded dy)")


def test_mixed_dtypes_follow_reference(triton_backend):
    # bf16 activations with an fp32 residual stream and fp32 weight, as under autocast-style training.
    x, r, w = make((4, 24), torch.bfloat16), make((4, 24), torch.float32, seed=2), make(24, torch.float32, 1)
    y, h = ops.rms_norm(x, w, EPS, residual=r)
    y_ref, h_ref = reference.rms_norm_reference(x, w, EPS, residual=r)
    assert (y.dtype, h.dtype) == (y_ref.dtype, h_ref.dtype) == (torch.bfloat16, torch.float32)
    close(h, h_ref.double(), torch.float32, "h")
    close(y, y_ref.double(), torch.bfloat16, "y")


def test_frozen_weight_skips_dweight(triton_backend, small_block):
    x, w, dy = make((6, 40), torch.float32), make(40, torch.float32, seed=1), make((6, 40), torch.float32, 7)
    xl = x.clone().requires_grad_()
    ops.rms_norm(xl, w, EPS, p=0.5).backward(dy)
    x64 = x.double().requires_grad_()
    reference.rms_norm_reference(x64, w.double(), EPS, p=0.5).backward(dy.double())
    assert w.grad is None
    close(xl.grad, x64.grad, torch.float32, "dx")


def test_empty_batch(triton_backend):
    x = torch.empty(0, 8, device=DEVICE, requires_grad=True)
    w = torch.ones(8, device=DEVICE, requires_grad=True)
    y = ops.rms_norm(x, w, EPS)
    y.sum().backward()
    assert y.shape == (0, 8) and torch.equal(w.grad, torch.zeros(8, device=DEVICE))


def test_dweight_is_deterministic(triton_backend, small_block):
    x, w = make((37, 40), torch.float32), make(40, torch.float32, seed=1)
    grads = []
    for _ in range(2):
        wl = w.clone().requires_grad_()
        ops.rms_norm(x, wl, EPS).pow(2).sum().backward()
        grads.append(wl.grad)
    assert torch.equal(grads[0], grads[1])


# ---- launch settings: measured ones from `tuning.TUNED`, else the defaults --------------------------
def tuned(monkeypatch, arch, entries):
    monkeypatch.setattr(tuning, "TUNED", {arch: entries})


def test_launch_for_takes_the_entry_for_the_most_rows_it_covers(monkeypatch):
    cpu = torch.device("cpu")
    tuned(monkeypatch, "cpu", {("fwd", 2, 1024): ((16384, 16, 8), (2048, 8, 4)), ("bwd", 2, 1024): ((256, 8, 4),)})
    assert K.launch_for("fwd", cpu, 2048, 2, 1024, True) == K.FwdLaunch(8, 4)
    assert K.launch_for("fwd", cpu, 16383, 2, 1024, True) == K.FwdLaunch(8, 4)
    assert K.launch_for("fwd", cpu, 20000, 2, 1024, True) == K.FwdLaunch(16, 8)
    assert K.launch_for("bwd", cpu, 256, 2, 1024, True) == K.BwdLaunch(8, 4)
    default = K.default_launch("fwd", 1024)
    assert default == K.FwdLaunch(K._num_warps(1024, 512), 1)
    for args in ((2047, 2, 1024, True), (20000, 4, 1024, True), (20000, 2, 2048, True), (20000, 2, 1024, False)):
        assert K.launch_for("fwd", cpu, *args) == default, args   # fewer rows, another dtype/width, looping
    tuned(monkeypatch, "sm_90", {("fwd", 2, 1024): ((1, 16, 8),)})   # another architecture's entries
    assert K.launch_for("fwd", cpu, 20000, 2, 1024, True) == default


# Several rows per program (7 rows: the last tile part-filled), more or fewer backward programs.
LAUNCHES = [((1, 4, 1), (1, 4, 2)), ((1, 4, 4), (1, 4, 1)), ((1, 8, 8), (1, 8, 8)), ((1, 2, 2), (5, 4, 3))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fwd,bwd", LAUNCHES, ids=str)
@pytest.mark.parametrize("p, residual", [(None, False), (0.25, False), (None, True)])
def test_tuned_launches_vs_fp64(triton_backend, monkeypatch, dtype, fwd, bwd, p, residual):
    d = 96   # one 128-wide block
    tuned(monkeypatch, "cpu", {("fwd", dtype.itemsize, 128): (fwd,), ("bwd", dtype.itemsize, 128): (bwd,)})
    launched = []
    for name in ("_rms_norm_fwd_kernel", "_rms_norm_bwd_kernel"):
        kernel = getattr(K, name)
        monkeypatch.setattr(K, name, _Spy(kernel, name, launched))
    x, w = make((7, d), dtype), make(d, dtype, seed=1) + 1
    check_against_fp64(x, w, residual=make((7, d), dtype, seed=2) if residual else None, p=p)
    rows, per_sm = fwd[2], bwd[2]
    assert ("_rms_norm_fwd_kernel", -(-7 // rows), rows) in launched
    assert ("_rms_norm_bwd_kernel", min(7, 2 * per_sm), None) in launched   # the interpreter counts as 2 SMs


class _Spy:
    """A kernel whose launches are recorded as (name, programs, ROWS)."""

    def __init__(self, kernel, name, log):
        self.kernel, self.name, self.log = kernel, name, log

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.append((self.name, grid[0], kwargs.get("ROWS")))
            return self.kernel[grid](*args, **kwargs)
        return launch


# ---- plain eager inference launches the kernels without the custom ops' dispatch -------------------
class OpCalls(list):
    """For each `with` block, the set of normswap custom ops it ran, as the profiler saw them (the profiler
    intercepts nothing, so it changes no decision)."""

    @contextlib.contextmanager
    def __call__(self):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            yield
        self.append({e.name.split("::")[1] for e in prof.events() if e.name.startswith("normswap::")})


@pytest.fixture
def op_calls():
    return OpCalls()


class _Sub(torch.Tensor):
    pass


class _Passthrough(torch.utils._python_dispatch.TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("residual, p", [(False, None), (True, None), (False, 0.25), (True, 0.5)])
def test_plain_inference_launches_directly_with_the_ops_results(triton_backend, op_calls, dtype, residual, p):
    x, w = make((3, 5, 40), dtype), torch.nn.Parameter(make(40, dtype, seed=1) + 1)
    r = make((3, 5, 40), dtype, seed=2) if residual else None
    with op_calls(), torch.no_grad():
        direct = ops.rms_norm(x, w, EPS, residual=r, p=p)
    with op_calls(), torch.enable_grad(), _Passthrough():   # a dispatch mode: the ops' path, the same launcher
        via_op = ops.rms_norm(x, w, EPS, residual=r, p=p)
    assert op_calls == [set(), {"rms_norm_add_fwd" if residual else "rms_norm_fwd"}]
    for a, b in zip(direct if residual else [direct], via_op if residual else [via_op]):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_whatever_needs_the_op_gets_it(triton_backend, op_calls):
    x, w = make((4, 24), torch.float32), make(24, torch.float32, seed=1)
    with op_calls():
        ops.rms_norm(x, w, EPS)                                    # grad on, but nothing requires it
    with op_calls():
        ops.rms_norm(x.clone().requires_grad_(), w, EPS)           # a gradient to record
    with op_calls():
        ops.rms_norm(x, torch.nn.Parameter(w), EPS)                # a trainable weight
    with op_calls(), torch.device("cpu"):                          # a TorchFunctionMode
        ops.rms_norm(x, w, EPS)
    with op_calls(), _Passthrough(), torch.no_grad():              # a TorchDispatchMode
        ops.rms_norm(x, w, EPS)
    with op_calls(), torch.no_grad():
        ops.rms_norm(x.as_subclass(_Sub), w, EPS)                  # a tensor subclass
    assert op_calls == [set()] + [{"rms_norm_fwd"}] * 5
    assert ops.plain_inference(x, None, w) and not ops.plain_inference(x.as_subclass(_Sub))


# ---- the PyTorch path ---------------------------------------------------------------------------
def test_torch_path_fp32_within_1e6_of_fp64():
    x, w, r = make((64, 384), torch.float32, 3.0), make(384, torch.float32, seed=1), make((64, 384), torch.float32, 2)
    for p in (None, 0.1):
        y = reference.rms_norm_reference(x, w, EPS, p=p)
        y64 = reference.rms_norm_reference(x.double(), w.double(), EPS, p=p)
        assert ((y.double() - y64).abs() / y64.abs().clamp_min(1e-3)).max() <= 1e-6
    y, h = reference.rms_norm_reference(x, w, EPS, residual=r)
    y64, _ = reference.rms_norm_reference(h.double(), w.double(), EPS), None
    assert ((y.double() - y64).abs() / y64.abs().clamp_min(1e-3)).max() <= 1e-6


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_torch_path_matches_functional_rms_norm(dtype):
    x, w = make((16, 100), dtype), make(100, dtype, seed=1)
    ours = reference.rms_norm_reference(x, w, EPS)
    theirs = torch.nn.functional.rms_norm(x.float(), (100,), w.float(), EPS).to(dtype)
    close(ours, theirs.double(), dtype, "vs F.rms_norm")


# ---- dispatch -----------------------------------------------------------------------------------
def _count_reference_calls(monkeypatch):
    calls = []
    real = ops.rms_norm_reference
    monkeypatch.setattr(ops, "rms_norm_reference", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def _count_launches(monkeypatch) -> collections.Counter:
    """Triton kernel launches by name while the test runs: proof the Triton path really ran."""
    launches = collections.Counter()
    fwd, bwd = K.rms_norm_fwd, K.rms_norm_bwd

    def counted_fwd(*a, residual=None, **k):
        launches["fwd_add" if residual is not None else "fwd"] += 1
        return fwd(*a, residual=residual, **k)

    def counted_bwd(*a, **k):
        launches["bwd"] += 1
        return bwd(*a, **k)
    monkeypatch.setattr(K, "rms_norm_fwd", counted_fwd)
    monkeypatch.setattr(K, "rms_norm_bwd", counted_bwd)
    return launches


def _cpu_auto() -> str:
    """What auto picks for CPU tensors: the C++ kernel, or the PyTorch path where it cannot be built."""
    return "cpu" if cpu.extension() is not None else "torch"


@pytest.mark.parametrize("setting,expected", [("triton", "triton"), ("torch", "torch"),
                                              ("auto", "triton" if DEVICE == "cuda" else "cpu-auto")])
def test_backend_switch_routes(monkeypatch, setting, expected):
    expected = _cpu_auto() if expected == "cpu-auto" else expected
    monkeypatch.setenv("NORMSWAP_BACKEND", setting)
    calls = _count_reference_calls(monkeypatch)
    launches = _count_launches(monkeypatch)
    x = make((3, 16), torch.float32)
    ops.rms_norm(x, None, EPS)
    assert ops.resolve_backend(x) == expected
    assert (launches["fwd"], len(calls)) == {"triton": (1, 0), "torch": (0, 1), "cpu": (0, 0)}[expected]


def test_auto_uses_the_cpu_kernel_for_cpu_tensors(monkeypatch):
    monkeypatch.delenv("NORMSWAP_BACKEND", raising=False)
    assert ops.resolve_backend(torch.zeros(2, 4)) == _cpu_auto()


def test_backend_switch_rejects_unknown(monkeypatch):
    monkeypatch.setenv("NORMSWAP_BACKEND", "cuda")
    with pytest.raises(ValueError, match="NORMSWAP_BACKEND"):
        ops.rms_norm(torch.zeros(2, 4), None, EPS)


def test_onnx_export_takes_torch_path(triton_backend, monkeypatch):
    pytest.importorskip("onnxscript")
    calls = _count_reference_calls(monkeypatch)
    program = torch.onnx.export(RMSNorm(16).eval(), (torch.randn(2, 16),), dynamo=True, verbose=False)
    ops_in_graph = [n.op_type for n in program.model_proto.graph.node]
    assert calls and "Sqrt" in ops_in_graph and "Div" in ops_in_graph  # the form onnxruntime fuses
    assert not any("normswap" in n.domain for n in program.model_proto.graph.node)


# ---- torch.compile ------------------------------------------------------------------------------
class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.pnorm = RMSNorm(24), PartialRMSNorm(24, p=0.25)

    def forward(self, x, r):
        y, h = self.norm(x, residual=r)
        return self.pnorm(y * 2.0) + h


def test_torch_compile_matches_eager(triton_backend, monkeypatch):
    # Inductor on CPU compiles the surrounding graph; each normswap op stays one opaque call
    # (fullgraph=True fails on any graph break), which runs the kernels at run time.
    torch.manual_seed(0)
    model = _Tiny().to(DEVICE)
    with torch.no_grad():
        model.norm.weight.uniform_(0.5, 1.5)
    x, r = make((3, 5, 24), torch.float32), make((3, 5, 24), torch.float32, seed=2)

    def step(m):
        xl, rl = x.clone().requires_grad_(), r.clone().requires_grad_()
        m.zero_grad()
        out = m(xl, rl)
        out.square().sum().backward()
        return out.detach(), xl.grad, rl.grad, m.norm.weight.grad.clone()

    eager = step(model)
    launches = _count_launches(monkeypatch)
    torch._dynamo.reset()
    compiled = step(torch.compile(model, backend="inductor", fullgraph=True))
    assert launches["fwd_add"] > 0 and launches["bwd"] > 0
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ---- the compiled (non-interpreter) path, without a GPU ---------------------------------------------
_COMPILE_SCRIPT = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from normswap.ops import triton_kernels as K

assert not K.INTERPRETED
CONSTEXPRS = {"HAS_RES", "HAS_W", "HAS_DW", "HAS_DHO", "BLOCK", "SINGLE", "ROWS"}

def kind(name, dtype):
    if name in CONSTEXPRS:
        return "constexpr"
    if name in ("RSTD", "DW_PART"):
        return "*fp32"
    if name.isupper():
        return "*" + dtype
    return "fp32" if name == "eps" else "i32"

n = 0
for dtype, flag in (("bf16", True), ("fp32", False)):
    for mode, kernel, flags, block in (
            ("fwd", K._rms_norm_fwd_kernel, ("HAS_RES", "HAS_W"), K.MAX_BLOCK),
            ("bwd", K._rms_norm_bwd_kernel, ("HAS_W", "HAS_DW", "HAS_DHO"), K.MAX_BLOCK_BWD)):
        # the forward's one-block path also as a tile of several (narrow) rows
        for single, rows in ((True, 1), (False, 1)) + (((True, 4),) if mode == "fwd" else ()):
            sig = {a: kind(a, dtype) for a in kernel.arg_names}
            consts = {**{f: flag for f in flags}, "BLOCK": block // rows, "SINGLE": single}
            if mode == "fwd":
                consts["ROWS"] = rows
            out = triton.compile(ASTSource(kernel, sig, consts), target=GPUTarget("cuda", 90, 32),
                                 options={"num_warps": K.default_launch(mode, block).num_warps})
            assert out.asm.get("cubin")
            n += 1
print("compiled", n)
"""


@pytest.mark.slow
def test_kernels_compile_for_sm90():
    # The interpreter never runs Triton's compiler. Compile every kernel variant family to an sm_90 cubin
    # with the toolchain in the triton wheel (no GPU needed), in a subprocess: under TRITON_INTERPRET=1
    # `triton.jit` yields interpreter objects that cannot be compiled.
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and "compiled 10" in proc.stdout, proc.stderr[-3000:]
