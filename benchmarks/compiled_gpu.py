"""torch.compile on CUDA (Inductor writes Triton): compiled RMSNorm against compiled nn.LayerNorm (issue 32).

    python benchmarks/compiled_gpu.py           # needs a CUDA device; ~3 min on an H100/H200

Candidates, each `torch.compile(module, dynamic=False)`, against nn.LayerNorm (the bar): "op", normswap's
RMSNorm module (on CUDA with Triton: our Triton kernels, one opaque op in the graph); "decomp", the PyTorch
decomposition Inductor compiles where that op is not used (NORMSWAP_BACKEND=torch, no Triton; one reduction
over the row); "scaled", the decomposition as it was before issue 32 (a max pass for overflow scaling, then
the reduction), to show what that pass cost. Forward (no grad) and backward (a captured forward and
backward, less the forward) at decode-to-prefill rows x widths 256-8192, fp32 and bf16; times by
CUDA-graph replays of 20 calls (the kernels alone, no launch or guard overhead; median of 15).
Ratios < 1: RMSNorm faster.

Then the generated code: for the forward and the backward of RMSNorm and of LayerNorm, the Triton kernels
Inductor wrote and the reductions in each (tl.sum / max), read from the source it returns.
"""
from __future__ import annotations

import datetime
import re
import statistics
import sys

import torch
from torch import nn

from normswap import RMSNorm
from normswap.ops.reference import rms_norm_reference

SHAPES = [(1, 4096), (8, 4096), (64, 2048), (256, 1024), (1024, 4096), (1024, 8192), (4096, 256), (16384, 4096)]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class Decomposition(nn.Module):
    """normswap's PyTorch form (`ops.reference`), what Inductor compiles where the Triton op is not used
    (NORMSWAP_BACKEND=torch, no Triton): one reduction over the row."""

    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return rms_norm_reference(x, self.weight, 1e-6)


class Scaled(nn.Module):
    """The pre-issue-32 decomposition: a max pass, then the scaled mean square."""

    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        hf = x.float()
        m = hf.detach().abs().amax(-1, keepdim=True)
        inv = 1.0 / (m.view(torch.int32) & 0x7F800000).view(torch.float32).clamp(min=1.0)
        ms = (hf * inv).pow(2).mean(-1, keepdim=True)
        return ((hf * inv) / torch.sqrt(ms + 1e-6 * inv * inv) * self.weight.float()).to(x.dtype)


def bench(fn, calls: int = 20, samples: int = 15) -> float:
    """Median ms per call over CUDA-graph replays of `calls` calls (launch and guard overhead removed: the
    kernels alone); triton's do_bench where the calls cannot be captured."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
    except Exception as e:   # noqa: BLE001 - not capturable: time eager launches instead
        print(f"  (not captured, timed eagerly: {type(e).__name__}: {str(e)[:80]})", flush=True)
        from triton.testing import do_bench
        return do_bench(fn, warmup=10, rep=40, return_mode="median")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(samples):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def timings(dtype: torch.dtype) -> list[str]:
    names = ("op", "decomp", "scaled")
    rows = ["| rows x width | LN fwd us | " + " | ".join(f"{k} / LN fwd" for k in names) + " | LN bwd us | "
            + " | ".join(f"{k} / LN bwd" for k in names) + " |", "|---|" + "---|" * 8]
    print("\n".join(rows), flush=True)
    for n, d in SHAPES:
        mods = {"ln": nn.LayerNorm(d, eps=1e-6), "op": RMSNorm(d, eps=1e-6), "decomp": Decomposition(d),
                "scaled": Scaled(d)}
        mods = {k: torch.compile(m.to("cuda", dtype), dynamic=False) for k, m in mods.items()}
        x = torch.randn(n, d).to("cuda", dtype)   # CPU RNG: nothing random on the GPU during captures
        dy = torch.randn(n, d).to("cuda", dtype)
        xg = x.clone().requires_grad_()
        fwd, bwd = {}, {}
        for k, m in mods.items():
            with torch.no_grad():
                fwd[k] = bench(lambda m=m: m(x))
            params = [xg, *m.parameters()]
            # forward and backward captured together; the backward's time is the step's less the forward's
            bwd[k] = bench(lambda m=m, p=params: torch.autograd.grad(m(xg), p, dy)) - fwd[k]
        rows.append(f"| {n} x {d} | {fwd['ln'] * 1e3:.1f} | " + " | ".join(f"{fwd[k] / fwd['ln']:.2f}" for k in names)
                    + f" | {bwd['ln'] * 1e3:.1f} | " + " | ".join(f"{bwd[k] / bwd['ln']:.2f}" for k in names) + " |")
        print(rows[-1], flush=True)
    return rows


def kernels(module: nn.Module, x: torch.Tensor) -> list[str]:
    """Per Triton kernel Inductor wrote for the forward and the backward: its reductions."""
    from torch._inductor.utils import run_and_get_code
    torch._dynamo.reset()
    compiled = torch.compile(module, dynamic=False)
    xg = x.clone().requires_grad_()

    def step():
        y = compiled(xg)
        y.backward(torch.ones_like(y))
    _, sources = run_and_get_code(step)
    out = []
    for src in sources:
        for body in re.split(r"@triton\.jit", src)[1:]:
            body = body.split("''', device_str=")[0]
            name = re.search(r"def (\w+)\(", body).group(1)
            reductions = len(re.findall(r"tl\.sum\(|triton_helpers\.max2\(|tl\.max\(|welford", body))
            out.append(f"{name}: {reductions} reduction(s)")
    return out


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: this benchmark needs a GPU", file=sys.stderr)
        return 0
    import triton
    for knob in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 512)
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}, triton {triton.__version__}; "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC\n")
    for name, dtype in DTYPES.items():
        print(f"### {name}\n")
        timings(dtype)
        print()
    x = torch.randn(1024, 4096, device="cuda")
    for label, module in (("decomposition", Decomposition(4096)), ("LayerNorm", nn.LayerNorm(4096)),
                          ("scaled (before)", Scaled(4096))):
        print(f"{label} kernels (forward, then backward):", "; ".join(kernels(module.cuda(), x)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
