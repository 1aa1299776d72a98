"""RMSNorm kernel benchmark: normswap's Triton kernels against the peers, as bandwidth and speedups.

    python benchmarks/kernels.py            # the full grid (N=16384, D in 768..16384, bf16/fp16/fp32)
    python benchmarks/kernels.py --quick    # a fast sanity run
    python benchmarks/kernels.py --markdown benchmarks/kernels.md

Modes: fwd (y = RMSNorm(x)), bwd (dx, dweight from dy), add (h = x + r; y = RMSNorm(h); returns both),
add-bwd (gradients of x, r, weight with upstream gradients on y and h). Peers: torch.nn.functional.rms_norm,
torch.compile of the PyTorch reference, nn.LayerNorm (what conversion replaces) and Liger-Kernel's RMSNorm
when importable; in the add modes: the add followed by our norm, and the add followed by F.rms_norm.

GB/s counts the bytes the op must move at minimum (fwd 2, bwd 3, add 4, add-bwd 4 row-tensors;
weight and per-row stats ignored) for every implementation, so GB/s compare like for like. "% copy" is
against a device-to-device copy measured here; "speedup" is the peer's time over ours (> 1: ours faster).
Timing: CUDA events around CUDA-graph replays (launch overhead removed), falling back to back-to-back
eager launches where a graph cannot be captured (the "timing" column says which); each sample rotates
through enough input sets to exceed 3x the L2 cache; median of the samples.
"""
from __future__ import annotations

import argparse
import datetime
import math
import statistics
import sys
from dataclasses import dataclass
from collections.abc import Callable

import torch
import torch.nn.functional as F

WIDTHS = (768, 1024, 2048, 4096, 8192, 16384)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MODES = ("fwd", "bwd", "add", "add-bwd")
ROW_TENSORS = {"fwd": 2, "bwd": 3, "add": 4, "add-bwd": 4}
EPS = 1e-6
DEVICE = "cuda"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--quick", action="store_true", help="D in {1024, 4096}, N=4096, bf16, few samples")
    ap.add_argument("--rows", type=int, default=16384, help="N, rows per call (default 16384)")
    ap.add_argument("--widths", type=str, default=None, help="comma-separated D list (default: the full grid)")
    ap.add_argument("--dtypes", type=str, default=None, help="comma-separated subset of bf16,fp16,fp32")
    ap.add_argument("--modes", type=str, default=None, help=f"comma-separated subset of {','.join(MODES)}")
    ap.add_argument("--samples", type=int, default=None, help="timed samples per measurement (default 50)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed rounds before timing")
    ap.add_argument("--no-graphs", action="store_true", help="time eager launches instead of CUDA graphs")
    ap.add_argument("--peers", type=str, default=None,
                    help="comma-separated subset of F.rms_norm,compiled-ref,LayerNorm,Liger (default: all)")
    ap.add_argument("--markdown", type=str, default=None, help="also write the tables to this file")
    return ap.parse_args(argv)


# ---- implementations -----------------------------------------------------------------------------
@dataclass
class Impl:
    name: str
    fn: Callable  # (x, w, b, r) -> y or (y, h)


def build_impls(residual: bool, wanted: set[str] | None) -> list[Impl]:
    """Ours first, then the peers (filtered by `wanted`, when given)."""
    from normswap.ops.autograd import rms_norm_triton
    from normswap.ops.reference import rms_norm_reference

    compiled_ref = torch.compile(rms_norm_reference, dynamic=False)
    if residual:
        def add_ours(x, w, b, r):
            h = x + r
            return rms_norm_triton(h, w, EPS), h

        def add_torch(x, w, b, r):
            h = x + r
            return F.rms_norm(h, (x.shape[-1],), w, EPS), h

        impls = [Impl("ours (fused)", lambda x, w, b, r: rms_norm_triton(x, w, EPS, residual=r)),
                 Impl("add + ours", add_ours),
                 Impl("add + F.rms_norm", add_torch),
                 Impl("compiled-ref", lambda x, w, b, r: compiled_ref(x, w, EPS, residual=r))]
        liger = _liger_fused_add()
        if liger is not None:
            impls.append(Impl("Liger", liger))
    else:
        impls = [Impl("ours", lambda x, w, b, r: rms_norm_triton(x, w, EPS)),
                 Impl("F.rms_norm", lambda x, w, b, r: F.rms_norm(x, (x.shape[-1],), w, EPS)),
                 Impl("compiled-ref", lambda x, w, b, r: compiled_ref(x, w, EPS)),
                 Impl("LayerNorm", lambda x, w, b, r: F.layer_norm(x, (x.shape[-1],), w, b, EPS))]
        liger = _liger()
        if liger is not None:
            impls.append(Impl("Liger", liger))
    return impls[:1] + [i for i in impls[1:] if wanted is None or i.name in wanted]


def _liger():
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    except ImportError:
        return None
    # Liger's "llama" casting mode computes in fp32 and casts like our kernel; offset 0: plain weight.
    # in_place=False: Liger may otherwise overwrite dy, which the timing loop reuses.
    return lambda x, w, b, r: LigerRMSNormFunction.apply(x, w, EPS, 0.0, "llama", False)


def _liger_fused_add():
    try:
        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
    except ImportError:  # older Liger releases have no fused add
        return None
    # Assumed signature (X, R, W, eps, offset, casting_mode, in_place) -> (Y, X + R); a mismatch shows up
    # as "Liger failed" in the output, not as a wrong number.
    return lambda x, w, b, r: LigerFusedAddRMSNormFunction.apply(x, r, w, EPS, 0.0, "llama", False)


# ---- timing --------------------------------------------------------------------------------------
def _median_ms(round_fn: Callable[[], None], calls_per_round: int, samples: int, warmup: int,
               graphs: bool) -> tuple[float, str]:
    """Median milliseconds per call of `round_fn` (which makes `calls_per_round` calls)."""
    for _ in range(warmup):
        round_fn()
    torch.cuda.synchronize()
    replay, how = round_fn, "eager"
    if graphs:
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=_capture_stream()):
                round_fn()
            graph.replay()
            torch.cuda.synchronize()
            replay, how = graph.replay, "graph"
        except Exception:  # noqa: BLE001 - any capture failure: time eagerly instead, and say so
            torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(samples)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(samples)]
    for s, e in zip(starts, ends):
        s.record()
        replay()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) / calls_per_round, how


_STREAM = None


def _capture_stream():
    # Forward graphs for the backward runs are built on this stream too, so autograd replays the
    # backward on the stream being captured.
    global _STREAM
    if _STREAM is None:
        _STREAM = torch.cuda.Stream()
    return _STREAM


def copy_bandwidth(samples: int) -> float:
    """Device-to-device copy GB/s (read + write bytes) on a 1 GiB buffer."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    ms, _ = _median_ms(lambda: dst.copy_(src), 1, samples, 3, graphs=False)  # noqa: F821 (del below)
    del src, dst
    return 2 * (1 << 30) / ms / 1e6


def make_sets(n: int, d: int, dtype: torch.dtype, l2_bytes: int):
    """Enough independent input sets that one round streams > 3x the L2 cache."""
    set_bytes = n * d * dtype.itemsize * 4
    count = max(1, math.ceil(3 * l2_bytes / set_bytes))
    g = torch.Generator(device=DEVICE).manual_seed(0)
    sets = []
    for _ in range(count):
        def rnd():
            return torch.randn(n, d, device=DEVICE, dtype=dtype, generator=g)
        sets.append({"x": rnd(), "r": rnd(), "dy": rnd(), "dh": rnd()})
    w = torch.rand(d, device=DEVICE, dtype=dtype) + 0.5
    b = torch.zeros(d, device=DEVICE, dtype=dtype)
    return sets, w, b


def time_impl(impl: Impl, mode: str, sets, w, b, samples, warmup, graphs) -> tuple[float, str]:
    residual = mode.startswith("add")
    if mode in ("fwd", "add"):
        def round_fn():
            with torch.no_grad():
                for s in sets:
                    impl.fn(s["x"], w, b, s["r"] if residual else None)
        return _median_ms(round_fn, len(sets), samples, warmup, graphs)

    # Backward: build each set's autograd graph once (kept with retain_graph), time only the backward.
    # The bias is differentiated too (allow_unused for the RMSNorms) so LayerNorm pays for dbias as in training.
    leaves, jobs = [], []
    wl, bl = w.detach().requires_grad_(), b.detach().requires_grad_()
    _capture_stream().wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(_capture_stream()):
        for s in sets:
            x = s["x"].detach().requires_grad_()
            r = s["r"].detach().requires_grad_() if residual else None
            out = impl.fn(x, wl, bl, r)
            outs, grads = ((out[0], out[1]), (s["dy"], s["dh"])) if residual else ((out,), (s["dy"],))
            inputs = [t for t in (x, r, wl, bl) if t is not None]
            jobs.append((outs, inputs, grads))
            leaves.append(x)
    torch.cuda.current_stream().wait_stream(_capture_stream())

    def round_fn():
        for outs, inputs, grads in jobs:  # noqa: F821 (deleted after the runs)
            torch.autograd.grad(outs, inputs, grads, retain_graph=True, allow_unused=True)
    try:
        return _median_ms(round_fn, len(sets), samples, warmup, graphs)
    finally:
        del jobs, leaves


# ---- report --------------------------------------------------------------------------------------
def run(args) -> list[str]:
    quick = args.quick
    widths = [int(v) for v in args.widths.split(",")] if args.widths else ([1024, 4096] if quick else WIDTHS)
    dtypes = args.dtypes.split(",") if args.dtypes else (["bf16"] if quick else list(DTYPES))
    modes = args.modes.split(",") if args.modes else list(MODES)
    rows = 4096 if quick and args.rows == 16384 else args.rows
    samples = args.samples or (10 if quick else 50)
    wanted = set(args.peers.split(",")) if args.peers else None
    for m in modes:
        if m not in MODES:
            sys.exit(f"unknown mode {m!r}: choose from {', '.join(MODES)}")

    # One compiled reference serves every (D, dtype): let dynamo keep a graph per shape instead of
    # falling back to eager after its default recompile limit.
    for knob in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, max(256, getattr(torch._dynamo.config, knob)))
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    import triton
    copy_gbs = copy_bandwidth(samples)
    lines = [f"device: {props.name} ({props.multi_processor_count} SMs, L2 {l2 >> 20} MiB); "
             f"torch {torch.__version__}, triton {triton.__version__}; {datetime.date.today()}",
             f"device-to-device copy: {copy_gbs:.0f} GB/s; N = {rows} rows; median of {samples} samples", ""]
    print("\n".join(lines), flush=True)

    for mode in modes:
        impls = build_impls(mode.startswith("add"), wanted)
        for dname in dtypes:
            dtype = DTYPES[dname]
            head = (f"| D | {impls[0].name} us | GB/s | % copy | "
                    + " | ".join(f"{i.name} us | speedup" for i in impls[1:]) + " | timing |")
            table = [f"### {mode}, {dname}", "", head, "|" + "---|" * (head.count("|") - 1)]
            print("\n".join(table), flush=True)
            for d in widths:
                sets, w, b = make_sets(rows, d, dtype, l2)
                nbytes = ROW_TENSORS[mode] * rows * d * dtype.itemsize
                results = []
                for impl in impls:
                    try:
                        results.append(time_impl(impl, mode, sets, w, b, samples, args.warmup,
                                                 not args.no_graphs))
                    except Exception as e:  # noqa: BLE001 - one failing peer must not end the run
                        print(f"  ({impl.name} failed at D={d}: {type(e).__name__}: {str(e)[:120]})",
                              file=sys.stderr)
                        results.append((float("nan"), "failed"))
                ours_ms = results[0][0]
                gbs = nbytes / ours_ms / 1e6
                cells = [str(d), f"{ours_ms * 1e3:.1f}", f"{gbs:.0f}", f"{100 * gbs / copy_gbs:.0f}%"]
                for ms, _ in results[1:]:
                    cells += [f"{ms * 1e3:.1f}", f"{ms / ours_ms:.2f}x"]
                timing = ",".join(sorted({how for _, how in results}))
                row = "| " + " | ".join(cells) + f" | {timing} |"
                table.append(row)
                print(row, flush=True)
                del sets
                torch.cuda.empty_cache()
            lines += table + [""]
            print()
        torch._dynamo.reset()
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: benchmarks/kernels.py needs a GPU (kernel correctness runs on CPU: "
              "TRITON_INTERPRET=1 pytest tests/test_kernels.py)", file=sys.stderr)
        return 0
    try:
        import triton  # noqa: F401
    except ImportError:
        print("Triton is not installed: pip install 'normswap[gpu]'", file=sys.stderr)
        return 1
    lines = run(args)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("\n".join(lines) + "\n")
        print(f"wrote {args.markdown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
