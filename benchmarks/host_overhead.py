"""Host-side cost of one normswap norm call on the Triton path, with the kernel launch stubbed out.

    TRITON_INTERPRET=1 python benchmarks/host_overhead.py     # any machine: no GPU, no kernel runs

On a GPU, eager decode is bound by the host: each op's Python and dispatch cost, not its kernel. This
times what `ops.rms_norm` does around the launch (checks, backend choice, dispatch), with the launcher
replaced by one that returns preallocated outputs, three ways: plain inference (no gradient: the launcher
is called directly), the same call through the custom ops (what plain inference did before it went
direct), and a call that records a gradient (the custom op and its autograd). For scale, whole CPU calls of
F.layer_norm, F.rms_norm and an add on the same tiny tensors (their dispatch plus a few hundred flops).
Medians over 7 runs of 20000 calls, one thread.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch
import torch.nn.functional as F


def per_call_us(fn, calls: int) -> float:
    for _ in range(calls // 10):
        fn()
    runs = []
    for _ in range(7):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - t) / calls * 1e6)
    return statistics.median(runs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--width", type=int, default=768)
    args = ap.parse_args(argv)
    os.environ["NORMSWAP_BACKEND"] = "triton"
    from normswap import ops
    from normswap.ops import triton_kernels as K
    torch.set_num_threads(1)
    d = args.width
    x, r, w = torch.randn(8, d), torch.randn(8, d), torch.nn.Parameter(torch.ones(d))
    xg = x.clone().requires_grad_()
    y, h, rstd = torch.empty_like(x), torch.empty_like(x), torch.empty(8)
    K.rms_norm_fwd = lambda x, w, eps, k, residual=None, **kw: (y, h if residual is not None else None, rstd)
    direct = ops.plain_inference

    def through_the_op(fn):   # ops.rms_norm as it was before plain inference went direct
        def call():
            ops.plain_inference = lambda *t: False
            try:
                fn()
            finally:
                ops.plain_inference = direct
        return call
    rows = []
    with torch.no_grad():
        rows += [("ours, plain inference (direct launch)", lambda: ops.rms_norm(x, w, 1e-6)),
                 ("ours, plain inference, through the custom op", through_the_op(lambda: ops.rms_norm(x, w, 1e-6))),
                 ("ours + residual, plain inference (direct launch)", lambda: ops.rms_norm(x, w, 1e-6, residual=r)),
                 ("ours + residual, through the custom op",
                  through_the_op(lambda: ops.rms_norm(x, w, 1e-6, residual=r)))]
        timed = [(name, per_call_us(fn, args.calls)) for name, fn in rows]
        peers = [("F.layer_norm, whole CPU call", lambda: F.layer_norm(x, (d,), w, w, 1e-5)),
                 ("F.rms_norm, whole CPU call", lambda: F.rms_norm(x, (d,), w, 1e-6)),
                 ("x + r, whole CPU call", lambda: x + r)]
        timed += [(name, per_call_us(fn, args.calls)) for name, fn in peers]
    timed.append(("ours, recording a gradient (custom op + autograd)",
                  per_call_us(lambda: ops.rms_norm(xg, w, 1e-6), args.calls)))
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, 8 x {d} fp32, launch stubbed\n")
    print("| call | host us |\n|---|---|")
    for name, t in timed:
        print(f"| {name} | {t:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
