"""GPU benchmark in one command (issue 50): normswap's Triton kernels and exact-converted GPT-2 models.

    python benchmarks/gpu.py OUTDIR                   # tuning, kernels, then models, within the budget (8 min)
    python benchmarks/gpu.py OUTDIR --only models     # some parts, sharing the whole budget
    python benchmarks/gpu.py OUTDIR --smoke           # the whole script on a CPU in seconds (tests run it)

Writes OUTDIR/gpu.md and OUTDIR/gpu.json, both rewritten after every row (a run cut short keeps what it
measured), and prints the markdown last.

tune: at 16384 and 2048 rows of each width, bf16 and fp32, every candidate launch setting of our forward
(warps; rows per program, a rows x block tile) and backward (warps; programs per SM), timed as the kernels
are and checked against float64. A setting at least 3% faster than the default is adopted for the rest of the
run (the kernel tables measure it) and written to OUTDIR/tuned.py: the TUNED assignment of
normswap/ops/tuning.py, which the package uses on that GPU architecture once pasted there.

kernels: at rows x width from decode (1, 8) to prefill (16384) and widths 768-8192, fp32/bf16/fp16: our
forward ("fwd"), backward ("bwd": dx and dweight from dy, autograd.grad of a retained graph), pRMSNorm forward
("prms", p = 1/16) and fused add + RMSNorm ("add": returns RMSNorm(x + r) and x + r). Against: a device copy
of the bytes the op must move at least (the roof: fwd 2, bwd 3, add 4 row-tensors; weights and per-row
statistics ignored), F.rms_norm eager and under torch.compile, F.layer_norm (with a bias; its backward
computes dbias too) and Liger-Kernel's RMSNorm / fused add + RMSNorm where liger_kernel imports; in "add",
the add followed by our norm or by F.rms_norm (eager, and compiled: Inductor fuses the two). GB/s counts those
minimum bytes for every implementation; "of copy" is the copy's time over ours at the same bytes; a peer's
ratio is its time over ours (> 1: ours faster). Each time is the median over samples of one call, each
sample a CUDA-graph replay of the call (launch overhead out; eager launches where capture fails: the
"timing" column says which) right after a read of a buffer 8x the L2 (cold L2). Compiled peers are
compiled once per dtype x width with the row count dynamic (one row specialised), rows largest first so
Inductor's autotuning sees the prefill shape. "rel err": ||ours - ref|| / ||ref||, ref in float64.

models: a GPT-2-small-sized (12 x 768) and a GPT-2-medium-sized (24 x 1024) model, random weights with
trained-looking LayerNorms (benchmarks/cpu.py's `random_gpt2`), against their exact conversion
(`exact_conversion`: a copy made before converting), in bf16 on the GPU, eager and torch.compile'd:
prefill (batch 8 x 512 tokens), one decode step with a KV cache (batch 8, 1 token after 512 cached; the
cache is cut back after each step) and a training step (forward + backward of the LM loss, 8 x 512, no
dropout, no optimizer). Timed as benchmarks/cpu.py times models: arms of identical copies, interleaved
repeats, the median of the per-repeat ratios converted / original with its 95% interval, beside the A/A
control copy / original; wall time, each call ending in a device synchronize.

Budget: each part checks the time left before each row (a shape, or a model row), against an estimate from
the rows already run, and skips, saying so in its table, what would overrun. With all three parts, tuning
ends by 20% of it and the kernels by 50%; the models have the rest. --smoke: tiny shapes and models on
the CPU, Triton in its interpreter (TRITON_INTERPRET=1), wall-clock timing instead of CUDA events, no CUDA
graphs or L2 flush, torch.compile with the "eager" backend; the same tables, with numbers that mean
nothing. Last, a table of issue 50's goals against what the run measured.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import json
import math
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

START = time.monotonic()   # the budget counts from here: imports are part of the run

DTYPE_ORDER = ("bf16", "fp32", "fp16")   # the order they run in, so the budget cuts fp16 first
MODES = ("fwd", "bwd", "prms", "add")
PEERS = {"fwd": ("F.rms_norm", "compiled F.rms_norm", "F.layer_norm", "Liger"),
         "bwd": ("F.rms_norm", "compiled F.rms_norm", "F.layer_norm", "Liger"),
         "prms": ("ours, p = 1", "F.rms_norm"),
         "add": ("add + ours", "add + F.rms_norm", "compiled add + F.rms_norm", "Liger")}
P = 0.0625
EPS = 1e-6   # benchmarks/kernels.py's, which its implementations (ours and the eager peers) use
# Each part's share of the budget when it runs with others: a part's deadline is the sum of the shares up to it
# (of the parts that run), scaled to the budget; the last part runs to the budget's end.
SHARES = {"tune": 0.2, "kernels": 0.3, "models": 0.5}
WORKLOADS = ("prefill", "decode", "train")
REL_TOL = {"fp32": 1e-5, "bf16": 1e-2, "fp16": 2e-3}   # rel err above this is flagged in the goals table


@dataclass(frozen=True)
class Profile:
    """Shapes, sizes and repeats: the GPU run's, or the smoke run's."""
    device: str
    rows: tuple[int, ...]          # largest first
    tune_rows: tuple[int, ...]     # the row counts the tuning pass times, largest first
    widths: tuple[int, ...]
    samples: int
    sizes: dict                    # name -> GPT2Config layer/width/heads
    vocab: int
    positions: int
    batch: int
    seq: int
    reps: int
    instances: int
    arm_seconds: float             # calls per arm and repeat: about this long (at least one)
    compile_backend: str
    first_shape_s: float           # prior estimates, replaced by what the run measures
    next_shape_s: float
    model_row_s: dict


GPU = Profile("cuda", rows=(16384, 2048, 256, 8, 1), tune_rows=(16384, 2048), widths=(768, 2048, 4096, 8192),
              samples=25,
              sizes={"small": dict(n_layer=12, n_embd=768, n_head=12),
                     "medium": dict(n_layer=24, n_embd=1024, n_head=16)},
              vocab=50257, positions=1024, batch=8, seq=512, reps=9, instances=2, arm_seconds=0.1,
              compile_backend="inductor", first_shape_s=15.0, next_shape_s=2.0,
              model_row_s={"eager": 10.0, "compiled": 50.0, "build": 20.0,   # build: model and conversion
                           "profile": 5.0})
SMOKE = Profile("cpu", rows=(8, 1), tune_rows=(8,), widths=(48,), samples=2,
                sizes={"small": dict(n_layer=1, n_embd=32, n_head=2), "medium": dict(n_layer=2, n_embd=32, n_head=2)},
                vocab=256, positions=64, batch=2, seq=16, reps=3, instances=2, arm_seconds=0.0,
                compile_backend="eager", first_shape_s=2.0, next_shape_s=0.5,
                model_row_s={"eager": 1.0, "compiled": 2.0, "build": 1.0, "profile": 1.0})


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("outdir", type=Path, help="folder for gpu.md and gpu.json (created)")
    ap.add_argument("--only", type=parts_arg, default=tuple(SHARES),
                    help="the parts to run, comma-separated, in this order: tune,kernels,models (default: all)")
    ap.add_argument("--budget", type=float, default=480.0, help="seconds for the whole run (default 480)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes and models on the CPU, in seconds")
    ap.add_argument("--dtypes", default=",".join(DTYPE_ORDER), help="kernels: a subset of bf16,fp32,fp16")
    ap.add_argument("--no-graphs", action="store_true", help="kernels: time eager launches, not CUDA graphs")
    return ap.parse_args(argv)


def parts_arg(text: str) -> tuple[str, ...]:
    wanted = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in wanted if p not in SHARES]
    if unknown or not wanted:
        raise argparse.ArgumentTypeError(f"parts are {', '.join(SHARES)}, got {text!r}")
    return tuple(p for p in SHARES if p in wanted)


def deadlines(parts: tuple[str, ...], budget: float) -> dict:
    """part -> the elapsed seconds it must end by (None: the budget's end)."""
    total, done, out = sum(SHARES[p] for p in parts), 0.0, {}
    for p in parts:
        done += SHARES[p]
        out[p] = None if p == parts[-1] else budget * done / total
    return out


# ---- time and output -----------------------------------------------------------------------------
class Budget:
    """Seconds left in the run, or before a part's deadline; `skip_reason` says whether an estimate fits."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    @staticmethod
    def elapsed() -> float:
        return time.monotonic() - START

    def left(self, deadline: float | None = None) -> float:
        return min(self.seconds, deadline if deadline is not None else self.seconds) - self.elapsed()

    def skip_reason(self, estimate: float, deadline: float | None = None) -> str | None:
        """None when `estimate` seconds fit before the deadline (default: the budget); else why not."""
        left = self.left(deadline)
        if estimate <= left:
            return None
        return f"skipped: budget (needs ~{estimate:.0f} s, {max(left, 0):.0f} s left)"


class Report:
    """Sections of rows, written as markdown and JSON after every row."""

    def __init__(self, outdir: Path, meta: dict):
        self.outdir, self.meta, self.sections = outdir, meta, {}
        outdir.mkdir(parents=True, exist_ok=True)

    def section(self, key: str, title: str, columns: list[str], notes: list[str] | None = None) -> None:
        self.sections.pop(key, None)   # made again: to the end (the goals table, remade after each part)
        self.sections[key] = {"title": title, "columns": columns, "notes": list(notes or []), "rows": []}

    def add(self, key: str, label: str, cells: list[str], values: dict, status: str = "ok", **extra) -> None:
        """A row: `cells` for the markdown (after the label), `values` (finite numbers) for the JSON."""
        assert all(isinstance(v, (int, float)) and math.isfinite(v) for v in values.values()), values
        cells = [c.replace("|", "/") for c in cells]   # an error message must not split a table cell
        self.sections[key]["rows"].append({"label": label, "status": status, "cells": cells, "values": values,
                                           **extra})
        self.write()

    def skip(self, key: str, label: str, reason: str) -> None:
        """A row with no numbers: why (skipped, or failed) in its first cell."""
        self.add(key, label, [reason] + [""] * (len(self.sections[key]["columns"]) - 2), {}, status=reason)

    def markdown(self) -> str:
        m = self.meta
        lines = ["# benchmarks/gpu.py", "", f"{m['device']}; torch {m['torch']}, triton {m['triton']}, "
                 f"transformers {m['transformers']}, liger-kernel {m['liger_kernel']}; {m['date']}",
                 f"command: `{m['command']}`; elapsed {m['elapsed_s']:.0f} s of a {m['budget_s']:.0f} s budget"
                 + (f"; device-to-device copy {m['copy_gbs']:.0f} GB/s (1 GiB, read + write); L2 "
                    f"{m['l2_bytes'] >> 20} MiB" if "copy_gbs" in m else "")]
        for s in self.sections.values():
            lines += ["", f"### {s['title']}", ""] + [f"{n}" for n in s["notes"]] + ([""] if s["notes"] else [])
            lines += ["| " + " | ".join(s["columns"]) + " |", "|" + "---|" * len(s["columns"])]
            lines += ["| " + " | ".join([r["label"], *r["cells"]]) + " |" for r in s["rows"]]
        return "\n".join(lines) + "\n"

    def write(self) -> None:
        self.meta["elapsed_s"] = Budget.elapsed()
        (self.outdir / "gpu.json").write_text(json.dumps({"meta": self.meta, "sections": self.sections}, indent=1))
        (self.outdir / "gpu.md").write_text(self.markdown())


def us(t: float | None) -> str:
    return "" if t is None else (f"{t:.1f}" if t < 1000 else f"{t:.0f}")


def failed(e: BaseException) -> str:
    return f"failed: {type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"


# ---- timers --------------------------------------------------------------------------------------
class CudaTimer:
    """Median microseconds of one call: CUDA events around a graph replay of it (eager launches where it
    cannot be captured), each after a read of a buffer 8x the L2, so that the call finds a cold L2."""

    def __init__(self, samples: int, graphs: bool):
        import kernels
        import torch
        self.torch, self.samples, self.graphs = torch, samples, graphs
        props = torch.cuda.get_device_properties(0)
        self.l2 = getattr(props, "L2_cache_size", 50 << 20)
        # read, not written: a written flush leaves dirty lines whose write-back the timed call would pay
        self.flush_buf = torch.randn(max(8 * self.l2, 256 << 20) // 4, device="cuda")
        self.stream = kernels._capture_stream()   # the stream backward graphs are built and captured on

    @contextlib.contextmanager
    def side(self):
        """Where forward graphs for timed backwards are built: the stream they are captured on (autograd
        runs a backward on its forward's stream)."""
        self.stream.wait_stream(self.torch.cuda.current_stream())
        with self.torch.cuda.stream(self.stream):
            yield

    def sync(self) -> None:
        self.torch.cuda.synchronize()

    def time(self, fn) -> tuple[float, str]:
        torch = self.torch
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            for _ in range(3):   # compile, autotune, allocate
                fn()
        torch.cuda.current_stream().wait_stream(self.stream)
        torch.cuda.synchronize()
        replay, how, graph = fn, "eager", None
        if self.graphs:
            try:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=self.stream):
                    fn()
                graph.replay()
                torch.cuda.synchronize()
                replay, how = graph.replay, "graph"
            except Exception:   # noqa: BLE001 - not capturable: time eager launches, and say so
                graph = None
                torch.cuda.synchronize()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(self.samples)]
        with torch.cuda.stream(self.stream):   # one stream for all: a backward runs on its forward's
            for start, end in events:
                self.flush_buf.sum()
                start.record()
                replay()
                end.record()
        torch.cuda.synchronize()
        del graph
        return statistics.median(s.elapsed_time(e) for s, e in events) * 1e3, how


class WallTimer:
    """--smoke: median wall-clock microseconds of one call on the CPU (no graphs, no cache flush)."""

    def __init__(self, samples: int):
        self.samples = samples

    @staticmethod
    def side():
        return contextlib.nullcontext()

    @staticmethod
    def sync() -> None:
        pass

    def time(self, fn) -> tuple[float, str]:
        fn()
        times = []
        for _ in range(self.samples):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return statistics.median(times) * 1e6, "wall"


# ---- kernels ---------------------------------------------------------------------------------------
def _rms(x, w):
    import torch.nn.functional as F
    return F.rms_norm(x, (x.shape[-1],), w, EPS)


def _add_rms(x, r, w):
    import torch.nn.functional as F
    h = x + r
    return F.rms_norm(h, (h.shape[-1],), w, EPS), h


def implementations(backend: str) -> dict[str, dict]:
    """mode -> {name: fn(x, w, b, r)}, ours first; None for Liger where it does not import. Ours and the
    eager peers are benchmarks/kernels.py's."""
    import kernels
    import torch

    from normswap.ops.autograd import rms_norm_triton
    plain = {i.name: i.fn for i in kernels.build_impls(False, {"F.rms_norm", "LayerNorm", "Liger"})}
    fused = {i.name: i.fn for i in kernels.build_impls(True, {"add + ours", "add + F.rms_norm", "Liger"})}
    rms_c, add_c = torch.compile(_rms, backend=backend), torch.compile(_add_rms, backend=backend)

    def rows_dynamic(t):   # one graph for every row count of a dtype x width (size 1 is specialised)
        torch._dynamo.maybe_mark_dynamic(t, 0)
        return t
    norm = {"ours": plain["ours"], "F.rms_norm": plain["F.rms_norm"],
            "compiled F.rms_norm": lambda x, w, b, r: rms_c(rows_dynamic(x), w),
            "F.layer_norm": plain["LayerNorm"], "Liger": plain.get("Liger")}
    return {"fwd": norm, "bwd": norm,
            "prms": {"ours": lambda x, w, b, r: rms_norm_triton(x, w, EPS, p=P)},
            "add": {"ours": fused["ours (fused)"], "add + ours": fused["add + ours"],
                    "add + F.rms_norm": fused["add + F.rms_norm"],
                    "compiled add + F.rms_norm": lambda x, w, b, r: add_c(rows_dynamic(x), rows_dynamic(r), w),
                    "Liger": fused.get("Liger")}}


def rel_err(out, ref) -> float:
    return float((out.double() - ref).norm() / ref.norm().clamp_min(1e-300))


def shape_data(n: int, d: int, dtype, device: str) -> dict:
    """Random inputs (never zeros), a gain around 1, a small bias, and bytes for the copy roof."""
    import torch
    g = torch.Generator(device=device).manual_seed(n * 100003 + d)
    t = {k: torch.randn(n, d, generator=g, device=device, dtype=dtype) for k in ("x", "r", "dy", "dh")}
    t["w"] = torch.rand(d, generator=g, device=device, dtype=dtype) + 0.5
    t["b"] = 0.1 * torch.randn(d, generator=g, device=device, dtype=dtype)
    t["src"] = torch.randint(0, 256, (2 * n * d * dtype.itemsize,), generator=g, device=device, dtype=torch.uint8)
    t["dst"] = torch.empty_like(t["src"])
    return t


def time_each(fns: dict, timer, prepare) -> tuple[dict, dict, set]:
    """(us by name, errors by name, timing methods): each fn's call that `prepare(name, fn)` returns, timed;
    None (Liger where it does not import) and a failing peer are said, not timed."""
    times, errors, hows = {}, {}, set()
    for name, fn in fns.items():
        if fn is None:
            errors[name] = "not installed"
            continue
        try:
            times[name], how = timer.time(prepare(name, fn))
            hows.add(how)
        except Exception as e:   # noqa: BLE001 - one failing peer must not end the run
            errors[name] = failed(e)
    return times, errors, hows


def forward_times(mode: str, fns: dict, t: dict, timer) -> tuple[dict, dict, set]:
    """`time_each` of the forward-only calls (no grad)."""
    import torch
    r = t["r"] if mode == "add" else None
    with torch.no_grad():
        return time_each(fns, timer, lambda name, fn: lambda: fn(t["x"], t["w"], t["b"], r))


def backward_times(fns: dict, t: dict, timer) -> tuple[dict, dict, set, object]:
    """`time_each` of the backward alone (autograd.grad of a graph built once), and ours' dx."""
    import torch
    dx = []

    def prepare(name, fn):
        with timer.side():
            x, w, b = (t[k].detach().requires_grad_() for k in ("x", "w", "b"))
            y = fn(x, w, b, None)
        timer.sync()
        if name == "ours":
            dx.append(torch.autograd.grad(y, [x], t["dy"], retain_graph=True)[0])
        return lambda: torch.autograd.grad(y, (x, w, b), t["dy"], retain_graph=True, allow_unused=True)
    return (*time_each(fns, timer, prepare), dx[0] if dx else None)


def reference_errors(t: dict, outs: dict) -> dict:
    """Relative errors of ours in each mode against float64 (`ops.reference`; autograd for dx)."""
    import torch

    from normswap.ops.reference import rms_norm_reference
    x, r, w = (t[k].double() for k in ("x", "r", "w"))
    errs = {}
    with torch.no_grad():
        if "fwd" in outs:
            errs["fwd"] = rel_err(outs["fwd"], rms_norm_reference(x, w, EPS))
        if "prms" in outs:
            errs["prms"] = rel_err(outs["prms"], rms_norm_reference(x, w, EPS, p=P))
        if "add" in outs:
            errs["add"] = rel_err(outs["add"], rms_norm_reference(x, w, EPS, residual=r)[0])
    if outs.get("bwd") is not None:
        xg = x.clone().requires_grad_()
        ref = torch.autograd.grad(rms_norm_reference(xg, w, EPS), [xg], t["dy"].double())[0]
        errs["bwd"] = rel_err(outs["bwd"], ref)
    return errs


def measure_shape(n: int, d: int, dtype, impls: dict, timer, device: str) -> dict:
    """mode -> {"times", "errors", "hows", "copy_us", "bytes", "rel_err"} at one shape."""
    import kernels
    import torch

    from normswap.ops import triton_kernels as K
    t = shape_data(n, d, dtype, device)
    tensor_bytes = n * d * dtype.itemsize
    copy_us = {}
    for k in sorted({kernels.ROW_TENSORS.get(m, 2) for m in MODES}):
        half = k * tensor_bytes // 2   # copied bytes: read once and written once, k row-tensors in all
        copy_us[k] = timer.time(lambda h=half: t["dst"][:h].copy_(t["src"][:h]))[0]
    out = {}
    for mode in MODES:
        if mode == "bwd":
            times, errors, hows, dx = backward_times(impls[mode], t, timer)
        else:
            times, errors, hows = forward_times(mode, impls[mode], t, timer)
        k = kernels.ROW_TENSORS.get(mode, 2)
        out[mode] = {"times": times, "errors": errors, "hows": hows, "copy_us": copy_us[k],
                     "bytes": k * tensor_bytes}
    if "ours" in out["prms"]["times"]:   # pRMSNorm's peers: the full norms, timed in "fwd"
        for peer, name in (("ours, p = 1", "ours"), ("F.rms_norm", "F.rms_norm")):
            if name in out["fwd"]["times"]:
                out["prms"]["times"][peer] = out["fwd"]["times"][name]
            else:
                out["prms"]["errors"][peer] = out["fwd"]["errors"].get(name, "failed")
    with torch.no_grad():
        ours = {"fwd": impls["fwd"]["ours"](t["x"], t["w"], t["b"], None),
                "prms": impls["prms"]["ours"](t["x"], t["w"], t["b"], None),
                "add": impls["add"]["ours"](t["x"], t["w"], t["b"], t["r"])[0], "bwd": dx}
    errs = reference_errors(t, ours)
    for mode in MODES:   # and the launch setting ours ran with (tuned or default)
        out[mode]["rel_err"] = errs.get(mode)
        kind = "bwd" if mode == "bwd" else "fwd"
        block, single = K._block(d, K.MAX_BLOCK if kind == "fwd" else K.MAX_BLOCK_BWD)
        out[mode]["launch"] = list(K.launch_for(kind, t["x"].device, n, dtype.itemsize, block, single))
    return out


def kernel_columns(mode: str) -> list[str]:
    ours = {"fwd": "ours", "bwd": "ours", "prms": f"pRMSNorm (p = {P})", "add": "ours (fused)"}[mode]
    return (["rows x width", "MB moved", f"{ours} us", "GB/s", "of copy", "copy us"]
            + [c for p in PEERS[mode] for c in (f"{p} us", f"{p} / ours")] + ["rel err", "timing"])


def add_kernel_row(report: Report, key: str, mode: str, n: int, d: int, res: dict) -> None:
    label = f"{n} x {d}"
    ours = res["times"].get("ours")
    if ours is None:
        report.skip(key, label, res["errors"].get("ours", "failed"))
        return
    gbs = res["bytes"] / ours / 1e3
    values = {"rows": n, "width": d, "bytes": res["bytes"], "ours_us": ours, "gbs": gbs,
              "copy_us": res["copy_us"], "copy_frac": res["copy_us"] / ours}
    cells = [f"{res['bytes'] / 1e6:.3g}", us(ours), f"{gbs:.0f}", f"{100 * res['copy_us'] / ours:.0f}%",
             us(res["copy_us"])]
    for peer in PEERS[mode]:
        t = res["times"].get(peer)
        if t is None:
            cells += [res["errors"].get(peer, "failed"), ""]
            continue
        values[f"{peer} us"], values[f"{peer} / ours"] = t, t / ours
        cells += [us(t), f"{t / ours:.2f}"]
    if res["rel_err"] is not None:
        values["rel_err"] = res["rel_err"]
    cells += ["" if res["rel_err"] is None else f"{res['rel_err']:.1e}", ",".join(sorted(res["hows"]))]
    report.add(key, label, cells, values, errors={k: v for k, v in res["errors"].items() if k != "ours"},
               dtype=key.split("/")[2], launch=res.get("launch"))


def run_kernels(prof: Profile, args, report: Report, budget: Budget, deadline: float | None, timer) -> None:
    import torch
    set_recompile_limits(torch)
    if prof.device == "cuda":
        src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        report.meta["copy_gbs"] = 2 * (1 << 30) / timer.time(lambda: dst.copy_(src))[0] / 1e3
        report.meta["l2_bytes"] = timer.l2
        del src, dst
    impls = None   # made at the first shape that runs: a spent budget imports no compiler
    dtypes = [d for d in DTYPE_ORDER if d in args.dtypes.split(",")]
    for name in dtypes:
        for mode in MODES:
            report.section(f"kernels/{mode}/{name}", f"Kernels: {mode}, {name}", kernel_columns(mode))
    first_s, next_s = prof.first_shape_s, prof.next_shape_s
    for name in dtypes:
        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[name]
        for d in prof.widths:
            # Compiled peers start afresh: else dynamo, seeing the width change, would compile the next
            # widths with a dynamic width (a looped reduction) instead of this one's static width.
            torch._dynamo.reset()
            for i, n in enumerate(prof.rows):
                reason = budget.skip_reason(first_s if i == 0 else next_s, deadline)
                if reason:
                    for mode in MODES:
                        report.skip(f"kernels/{mode}/{name}", f"{n} x {d}", reason)
                    continue
                t0 = time.monotonic()
                try:
                    impls = impls or implementations(prof.compile_backend)
                    results = measure_shape(n, d, dtype, impls, timer, prof.device)
                    for mode in MODES:
                        add_kernel_row(report, f"kernels/{mode}/{name}", mode, n, d, results[mode])
                except Exception as e:   # noqa: BLE001 - a shape that fails entirely: say so, go on
                    for mode in MODES:
                        report.skip(f"kernels/{mode}/{name}", f"{n} x {d}", failed(e))
                took = time.monotonic() - t0
                first_s, next_s = (took, next_s) if i == 0 else (first_s, took)
                print(f"  kernels {name} {n} x {d}: {took:.1f} s", flush=True)
                if prof.device == "cuda":
                    torch.cuda.empty_cache()


# ---- tuning ------------------------------------------------------------------------------------------
TUNE_DTYPES = ("bf16", "fp32")   # fp16 takes bf16's settings: they are keyed by itemsize
TUNE_MARGIN = 0.03               # a setting replaces the default only when this much faster: not for noise


def fwd_candidates(block: int) -> list:
    """The default, then one row or a tile of rows (up to MAX_TILE elements) at 4, 8 or 16 elements a thread."""
    from normswap.ops import triton_kernels as K
    out = [K.default_launch("fwd", block)]
    rows = 1
    while rows == 1 or rows * block <= K.MAX_TILE:
        out += [K.FwdLaunch(w, rows) for w in (1, 2, 4, 8, 16, 32) if rows * block // (32 * w) in (4, 8, 16)]
        rows *= 2
    return list(dict.fromkeys(out))


def bwd_candidates(block: int) -> list:
    """The default, then 4, 8 or 16 elements a thread, each at 1, 2, 4 or 8 programs per SM."""
    from normswap.ops import triton_kernels as K
    warps = [w for w in (1, 2, 4, 8, 16, 32) if block // (32 * w) in (4, 8, 16)]
    out = [K.default_launch("bwd", block)] + [K.BwdLaunch(w, p) for w in warps for p in (1, 2, 4, 8)]
    return list(dict.fromkeys(out))


def settings(launch) -> str:
    from normswap.ops import triton_kernels as K
    return f"{launch[0]} warps, {launch[1]} {'rows/prog' if isinstance(launch, K.FwdLaunch) else 'progs/SM'}"


def tune_shape(n: int, d: int, name: str, dtype, timer, device: str) -> dict:
    """mode -> [(launch, us or None, rel err or failure)], the default first: every candidate setting of the
    forward (no residual, with a weight) and of the backward (dx and dweight), each checked against float64."""
    import torch
    import triton

    from normswap.ops import triton_kernels as K
    from normswap.ops.reference import rms_norm_reference
    t = shape_data(n, d, dtype, device)
    x, w, dy = t["x"], t["w"], t["dy"]
    block = triton.next_power_of_2(d)
    x64 = x.double().requires_grad_()
    y64 = rms_norm_reference(x64, w.double(), EPS)
    dx64 = torch.autograd.grad(y64, [x64], dy.double())[0]
    y64 = y64.detach()
    with torch.no_grad():
        rstd = K.rms_norm_fwd(x, w, EPS, d, launch=K.default_launch("fwd", block))[2]
    calls = {"fwd": (fwd_candidates(block), lambda L: K.rms_norm_fwd(x, w, EPS, d, launch=L)[0], y64),
             "bwd": (bwd_candidates(block), lambda L: K.rms_norm_bwd(dy, x, rstd, w, d, launch=L)[0], dx64)}
    out = {}
    for mode, (candidates, call, ref) in calls.items():
        tried = out[mode] = []
        for launch in candidates:
            try:
                with torch.no_grad():
                    err = rel_err(call(launch), ref)
                    if not err <= REL_TOL[name]:
                        tried.append((launch, None, f"wrong: rel err {err:.1e}"))
                        continue
                    tried.append((launch, timer.time(lambda L=launch: call(L))[0], err))
            except Exception as e:   # noqa: BLE001 - a setting that does not compile or launch: say so
                tried.append((launch, None, failed(e)))
    del t, x64, dx64, y64
    return out


def add_tune_row(report: Report, name: str, mode: str, n: int, d: int, tried: list):
    """The row for one mode at one shape; returns the winning launch (the default unless a timed setting is
    TUNE_MARGIN faster), or None when the default itself failed."""
    default, default_us, _ = tried[0]
    timed = [(us_, launch) for launch, us_, _ in tried if us_ is not None]
    bad = [f"{settings(launch)}: {why}" for launch, us_, why in tried if us_ is None]
    label = f"{name} {mode} {n} x {d}"
    if default_us is None:
        report.skip("tune", label, f"default {settings(default)} {tried[0][2]}")
        return None
    best_us, best = min(timed)
    win = best if best_us < (1 - TUNE_MARGIN) * default_us else default
    worst_err = max(e for _, us_, e in tried if us_ is not None)
    report.add("tune", label, [settings(default), us(default_us), settings(best), us(best_us),
                               f"{default_us / best_us:.2f}", "yes" if win != default else "no (default kept)",
                               str(len(tried)), f"{worst_err:.1e}", "; ".join(bad) or "none"],
               {"rows": n, "width": d, "default_us": default_us, "best_us": best_us,
                "speedup": default_us / best_us},
               dtype=name, mode=mode, adopted=list(win), tried=[[list(L), u, None if u is None else e]
                                                                 for L, u, e in tried])
    return win


def run_tune(prof: Profile, args, report: Report, budget: Budget, deadline: float | None, timer) -> None:
    """Each candidate launch setting at each width and the prefill row counts, bf16 and fp32; what wins
    goes into `tuning.TUNED` for this architecture at once (the kernel tables after it measure it), and
    OUTDIR/tuned.py gets the TUNED assignment to paste into normswap/ops/tuning.py."""
    import torch
    import triton

    from normswap.ops import triton_kernels as K
    from normswap.ops import tuning
    arch = K._arch(torch.device(prof.device))
    report.section("tune", f"Tuning: launch settings on {arch}",
                   ["dtype mode rows x width", "default", "default us", "best", "best us", "default / best",
                    "adopted", "settings tried", "worst rel err", "failed"],
                   [f"Each setting timed as the kernels below are (median of {prof.samples}, cold L2, graph "
                    "replay), its output checked against float64. A setting is adopted when it is at least "
                    f"{TUNE_MARGIN:.0%} faster than the default; adopted settings are in effect for the rest of "
                    "this run (the kernel tables measure them), and `tuned.py` holds the TUNED assignment for "
                    "normswap/ops/tuning.py. Rows below the smallest row count tuned keep the default."])
    first_s, next_s = prof.first_shape_s, prof.next_shape_s
    for name in [d for d in TUNE_DTYPES if d in args.dtypes.split(",")]:
        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[name]
        for d in prof.widths:
            block = triton.next_power_of_2(d)
            wins = {"fwd": [], "bwd": []}
            for i, n in enumerate(prof.tune_rows):
                reason = budget.skip_reason(first_s if i == 0 else next_s, deadline)
                if reason:
                    for mode in wins:
                        report.skip("tune", f"{name} {mode} {n} x {d}", reason)
                    continue
                t0 = time.monotonic()
                try:
                    for mode, tried in tune_shape(n, d, name, dtype, timer, prof.device).items():
                        win = add_tune_row(report, name, mode, n, d, tried)
                        if win is not None:
                            wins[mode].append((n, *win))
                except Exception as e:   # noqa: BLE001 - a shape that fails entirely: say so, go on
                    for mode in wins:
                        report.skip("tune", f"{name} {mode} {n} x {d}", failed(e))
                took = time.monotonic() - t0
                first_s, next_s = (took, next_s) if i == 0 else (first_s, took)
                print(f"  tune {name} {n} x {d}: {took:.1f} s", flush=True)
            for mode, entries in wins.items():
                if any(tuple(e[1:]) != K.default_launch(mode, block) for e in entries):
                    tuning.TUNED.setdefault(arch, {})[(mode, dtype.itemsize, block)] = tuple(entries)
            (args.outdir / "tuned.py").write_text(tuning.render(tuning.TUNED))
            if prof.device == "cuda":
                torch.cuda.empty_cache()


# ---- models ------------------------------------------------------------------------------------------
@contextlib.contextmanager
def norm_backend(value: str):
    """NORMSWAP_BACKEND set for a while: the conversion's checks take the PyTorch path, apart from the kernels
    being measured (and, converting on the CPU, the GPU run never builds the C++ kernel)."""
    old = os.environ.get("NORMSWAP_BACKEND")
    os.environ["NORMSWAP_BACKEND"] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("NORMSWAP_BACKEND", None)
        else:
            os.environ["NORMSWAP_BACKEND"] = old


def model_pair(prof: Profile, size: str, report: Report) -> dict:
    """{"original", "converted"} on the device in bf16: benchmarks/cpu.py's random GPT-2 (perturbed norms)
    and its exact conversion, made in fp32 on the device (about 18 forwards: minutes on a CPU for the medium
    model); on the CPU should that fail (the table's notes then say so)."""
    import cpu as cpubench
    import torch
    import transformers
    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(**prof.sizes[size], vocab_size=prof.vocab, n_positions=prof.positions,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    orig = cpubench.random_gpt2(cfg)
    # GPT2LMHeadModel's class name maps to no loss type: transformers then logs a warning at every loss, a
    # graph break under torch.compile. Name the loss it falls back to (the same function) in both models.
    orig.loss_type = "ForCausalLM"
    with norm_backend("torch"):   # the conversion's own checks on the PyTorch path, whatever the device
        try:
            conv = cpubench.exact_conversion(orig.to(prof.device))
        except Exception as e:   # noqa: BLE001 - the CPU path is the tested one: slower, but a result
            if prof.device == "cpu":
                raise
            report.sections["models"]["notes"].append(f"{size}: converted on the CPU ({failed(e)} on the device)")
            conv = cpubench.exact_conversion(orig.cpu())
    return {k: m.to(prof.device, torch.bfloat16) for k, m in (("original", orig), ("converted", conv))}


def workload_calls(prof: Profile, models: list) -> dict:
    """workload -> {id(model): that model's call}; each call ends in a device synchronize. Decode steps
    reuse a cache made here, eagerly, of seq + 1 tokens cut back by one, so that every call (the first too)
    sees the same shapes and strides; each step appends a token and cuts it off again."""
    import torch
    from transformers import DynamicCache
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, prof.vocab, (prof.batch, prof.seq), generator=g).to(prof.device)
    more = torch.randint(0, prof.vocab, (prof.batch, prof.seq + 1), generator=g).to(prof.device)
    tok = more[:, -1:].contiguous()
    sync = torch.cuda.synchronize if prof.device == "cuda" else (lambda: None)
    calls = {w: {} for w in WORKLOADS}
    for m in models:
        cache = DynamicCache(config=m.config)
        with torch.no_grad():
            m(more, cache)   # positional: the argument is `past_key_values` in transformers 5.17, `cache` in 5.24
        cache.crop(-1)

        def prefill(m=m):
            with torch.no_grad():
                m(ids)
            sync()

        def decode(m=m, cache=cache):
            with torch.no_grad():
                m(tok, cache)
            cache.crop(-1)
            sync()

        def train(m=m):
            m.zero_grad(set_to_none=True)
            m(ids, labels=ids).loss.backward()
            sync()
        calls["prefill"][id(m)], calls["decode"][id(m)], calls["train"][id(m)] = prefill, decode, train
    return calls


def model_row(report: Report, prof: Profile, size: str, mode: str, workload: str, arms: dict, calls: dict):
    import cpu as cpubench
    models = cpubench.flat(arms)
    for m in models:
        m.train(workload == "train")
    t0 = time.monotonic()
    for m in models:   # compile (or warm) each copy, round-robin over the arms
        calls[id(m)]()
    warm = time.monotonic() - t0
    ratio, secs = cpubench.paired_ratio({k: [calls[id(m)] for m in ms] for k, ms in arms.items()}, prof.reps,
                                        prof.arm_seconds, now=time.perf_counter)
    r, aa = ratio["converted"], ratio["copy"]
    values = {"original_ms": secs["original"] * 1e3, "converted_ms": secs["converted"] * 1e3,
              "ratio": r[0], "ratio_lo": r[1], "ratio_hi": r[2], "aa": aa[0], "aa_lo": aa[1], "aa_hi": aa[2],
              "warmup_s": warm}
    shape = f"{prof.batch} x {'1 (after ' + str(prof.seq) + ')' if workload == 'decode' else prof.seq}"
    report.add("models", model_label(prof, size),
               [mode, workload, shape, f"{values['original_ms']:.2f}", f"{values['converted_ms']:.2f}",
                cpubench.ratio_cell(r), cpubench.ratio_cell(aa), f"{warm:.1f}"], values,
               size=size, mode=mode, workload=workload)


# Norm kernels by name: ours (_rms_norm_fwd_kernel, _rms_norm_bwd_kernel), F.rms_norm's, and LayerNorm's, whose
# CUDA backward's weight and bias gradients run in kernels named without "layer_norm" (ATen's layer_norm_kernel.cu).
NORM_KERNELS = re.compile(r"layer_?norm|rms_?norm|GammaBeta|RowwiseMoments|ComputeInternalGradients|"
                          r"ComputeGradientFusedParams", re.IGNORECASE)


def norm_share(call, device: str) -> tuple[float, float]:
    """(all, norms): the device time of one call's kernels, and of its norm kernels (LayerNorm's, F.rms_norm's,
    ours), in ms, by torch.profiler; on the CPU (--smoke), the ops' own CPU time instead."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    cuda = device == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as p:
        call()
    total = norms = 0.0
    for e in p.events():
        if cuda:   # the kernels themselves (and copies, memsets): their own span on the device
            if e.device_type != torch.autograd.DeviceType.CUDA:
                continue
            t = e.time_range.elapsed_us() / 1e3
        else:      # the ops' self time: no op counted twice through its children
            t = e.self_cpu_time_total / 1e3
        total += t
        norms += t if NORM_KERNELS.search(e.name) else 0.0
    return total, norms


def profile_rows(report: Report, prof: Profile, size: str, arms: dict, calls: dict) -> None:
    """Amdahl for the model goals: the norms' share of each model's device time, in prefill and training."""
    for w in ("prefill", "train"):
        shares = {}
        for arm in ("original", "converted"):
            m = arms[arm][0]
            m.train(w == "train")
            calls[w][id(m)]()   # warm
            shares[arm] = norm_share(calls[w][id(m)], prof.device)
        (ot, on), (ct, cn) = shares["original"], shares["converted"]
        if ot <= 0:
            report.skip("profile", f"{model_label(prof, size)} {w}", "no device time recorded")
            continue
        report.add("profile", f"{model_label(prof, size)} {w}",
                   [f"{ot:.2f}", f"{on:.3f}", f"{100 * on / ot:.1f}%", f"{1 - on / ot:.3f}", f"{ct:.2f}",
                    f"{cn:.3f}", f"{ct / ot:.3f}"],
                   {"orig_ms": ot, "orig_norm_ms": on, "share": on / ot, "ceiling": 1 - on / ot, "conv_ms": ct,
                    "conv_norm_ms": cn, "ratio": ct / ot}, size=size, workload=w)


def model_label(prof: Profile, size: str) -> str:
    return f"{size} ({prof.sizes[size]['n_layer']}x{prof.sizes[size]['n_embd']})"


def model_not_run(report: Report, prof: Profile, size: str, mode: str, workload: str, why: str) -> None:
    report.add("models", model_label(prof, size), [mode, workload, why] + [""] * 5, {}, status=why, size=size,
               mode=mode, workload=workload)


def model_set(prof: Profile, pair: dict, mode: str):
    """The arms (benchmarks/cpu.py's `with_control`: copies of each model and an A/A arm of the original)
    and their workload calls; compiled: each copy's forward torch.compile'd (after the decode caches are made)."""
    import cpu as cpubench
    import torch
    arms = cpubench.with_control(pair, prof.instances)
    calls = workload_calls(prof, cpubench.flat(arms))
    if mode == "compiled":
        for m in cpubench.flat(arms):
            m.forward = torch.compile(m.forward, backend=prof.compile_backend, dynamic=False)
    return arms, calls


def run_models(prof: Profile, report: Report, budget: Budget) -> None:
    """Eager then compiled, small then medium, each model row after a budget check: its estimate is what the
    same mode and workload took on the small model, scaled by the layer count (a prior before that)."""
    import torch
    set_recompile_limits(torch)
    columns = ["model", "mode", "workload", "batch x tokens", "original ms", "converted ms", "conv / orig (95% CI)",
               "A/A: copy / orig (95% CI)", "warm-up s"]
    report.section("models", "Models, bf16: original (LayerNorm) vs exact conversion (RMSNorm)", columns,
                   [f"{prof.reps} interleaved repeats of {prof.instances} copies per arm; ratio: median of the "
                    "per-repeat ratios of the copies' means, 95% interval; < 1: converted faster. Wall time, each "
                    f"call synchronized. Compiled: torch.compile(model.forward, backend={prof.compile_backend!r}, "
                    "dynamic=False); warm-up s: the first call of every copy, compiling both models included."])
    report.section("profile", "Models, bf16, eager: the norms' share of device time (Amdahl)",
                   ["model workload", "original ms", "its norms ms", "norms' share", "ceiling: 1 - share",
                    "converted ms", "its norms ms", "conv / orig"],
                   ["One call of each model under torch.profiler: the device time of its kernels, and of the norm "
                    "kernels among them (LayerNorm's; ours in the conversion). With the norms' share s, no change "
                    "to the norms alone can bring conv / orig below 1 - s (the ceiling): a goal below it is out "
                    "of reach. Profiled times include the profiler's own overhead; the timed rows above are the "
                    "measurement, these the breakdown."])
    pairs, per_layer = {}, {}   # per_layer[(mode, workload)]: seconds per small-model-sized row, as measured
    for mode in ("eager", "compiled"):
        for size in prof.sizes:
            scale = prof.sizes[size]["n_layer"] / prof.sizes["small"]["n_layer"]
            state = None   # (arms, calls) once made; a str when making them failed
            for w in WORKLOADS:
                need = per_layer.get((mode, w), prof.model_row_s[mode]) * scale
                if state is None and size not in pairs:
                    need += prof.model_row_s["build"] * scale
                reason = budget.skip_reason(need) or (state if isinstance(state, str) else None)
                if reason:
                    model_not_run(report, prof, size, mode, w, reason)
                    continue
                t0 = time.monotonic()
                try:
                    if state is None:
                        if size not in pairs:
                            pairs[size] = model_pair(prof, size, report)
                        state = model_set(prof, pairs[size], mode)
                    t1 = time.monotonic()
                    model_row(report, prof, size, mode, w, state[0], state[1][w])
                    per_layer[(mode, w)] = (time.monotonic() - t1) / scale
                except Exception as e:   # noqa: BLE001 - a failing row must not end the run
                    if state is None:
                        state = failed(e)
                    model_not_run(report, prof, size, mode, w, failed(e))
                print(f"  models {mode} {size} {w}: {time.monotonic() - t0:.1f} s", flush=True)
            if mode == "eager" and isinstance(state, tuple):
                reason = budget.skip_reason(prof.model_row_s["profile"] * scale)
                try:
                    if reason:
                        raise RuntimeError(reason)
                    profile_rows(report, prof, size, *state)
                except Exception as e:   # noqa: BLE001 - the profile is a reading beside the timing: say, go on
                    for w in ("prefill", "train"):
                        report.skip("profile", f"{model_label(prof, size)} {w}", reason or failed(e))
            del state
            if mode == "compiled":
                torch._dynamo.reset()
            if prof.device == "cuda":
                torch.cuda.empty_cache()


def set_recompile_limits(torch) -> None:
    """One compiled function serves many shapes and model structures: never fall back to eager for that."""
    for knob in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, max(4096, getattr(torch._dynamo.config, knob)))


# ---- goals and the run -------------------------------------------------------------------------------
ITEMSIZE = {"bf16": 2, "fp16": 2, "fp32": 4}
BIG = 8 << 20   # "every shape of >= 8 MB": x itself, rows x width x itemsize


def kernel_rows(report: Report, modes, dtypes):
    """("mode dtype", row) of every measured kernel row in those modes and dtypes."""
    for key, sec in report.sections.items():
        parts = key.split("/")
        if parts[0] == "kernels" and parts[1] in modes and parts[2] in dtypes:
            yield from ((f"{parts[1]} {parts[2]}", r) for r in sec["rows"] if r["status"] == "ok")


def extreme(rows, value, worst=min):
    """(worst value, where) over rows carrying `value`, or None."""
    found = [(r["values"][value], f"{key} {r['label']}") for key, r in rows if value in r["values"]]
    return worst(found, key=lambda f: f[0]) if found else None


def goal_row(report: Report, goal: str, found, ok, fmt="{:.2f}") -> None:
    if found is None:
        report.add("goals", goal, ["", "", "not measured"], {}, status="not measured")
        return
    value, where = found
    report.add("goals", goal, [fmt.format(value), where, "met" if ok(value) else "NOT met"], {"worst": value})


def goals(report: Report) -> None:
    """Issue 50's goals against what this run measured (only what it measured)."""
    report.section("goals", "Goals (issue 50), from this run", ["goal", "worst", "where", "verdict"],
                   [f"Kernel goals over shapes whose x is >= {BIG >> 20} MiB (rows x width x itemsize)."])
    both = ("bf16", "fp32")
    for mode, floor in (("fwd", 0.90), ("bwd", 0.85)):
        big = [(k, r) for k, r in kernel_rows(report, (mode,), both)
               if r["values"]["rows"] * r["values"]["width"] * ITEMSIZE[r["dtype"]] >= BIG]
        goal_row(report, f"{mode} >= {floor:.0%} of copy (bf16, fp32, x >= 8 MiB)",
                 extreme(big, "copy_frac"), lambda v, f=floor: v >= f, "{:.1%}")
    for peer in ("F.rms_norm", "Liger"):
        rows = list(kernel_rows(report, ("fwd", "bwd", "add") if peer == "Liger" else ("fwd", "bwd"), ITEMSIZE))
        goal_row(report, f"never slower than {peer} (peer / ours >= 1, every shape and dtype)",
                 extreme(rows, f"{peer} / ours"), lambda v: v >= 1.0)
    errs = [(k, {**r, "values": {"e": r["values"]["rel_err"] / REL_TOL[r["dtype"]]}})
            for k, r in kernel_rows(report, MODES, ITEMSIZE) if "rel_err" in r["values"]]
    goal_row(report, "rel err within tolerance (fp32 1e-5, bf16 1e-2, fp16 2e-3; worst err / tol)",
             extreme(errs, "e", max), lambda v: v <= 1.0)
    models = [r for r in report.sections.get("models", {"rows": []})["rows"] if r["status"] == "ok"]
    for w in ("prefill", "train"):
        rows = [("models", r) for r in models if (r["size"], r["mode"], r["workload"]) == ("small", "eager", w)]
        goal_row(report, f"small, eager, {w}: conv / orig <= 0.97", extreme(rows, "ratio", max),
                 lambda v: v <= 0.97, "{:.3f}")
    profiled = [r for r in report.sections.get("profile", {"rows": []})["rows"] if r["status"] == "ok"]
    rows = [("profile", r) for r in profiled if r["size"] == "small"]
    goal_row(report, "small, eager, prefill and train: 3% reachable (ceiling 1 - norms' share <= 0.97)",
             extreme(rows, "ceiling", max), lambda v: v <= 0.97, "{:.3f}")
    rows = [("models", {**r, "label": f"{r['label']} {r['mode']} {r['workload']}"}) for r in models]
    goal_row(report, "never slower, any model row (95% CI's low end <= 1)", extreme(rows, "ratio_lo", max),
             lambda v: v <= 1.0, "{:.3f}")


def versions(torch) -> dict:
    def version(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"
    return {"torch": torch.__version__, "triton": version("triton"), "transformers": version("transformers"),
            "liger_kernel": version("liger-kernel")}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.smoke:   # before normswap's Triton kernels are imported: triton.jit reads it then
        os.environ.setdefault("TRITON_INTERPRET", "1")
    sys.path.insert(0, str(Path(__file__).resolve().parent))   # kernels.py and cpu.py, also when imported
    import torch
    prof = SMOKE if args.smoke else GPU
    if args.smoke:   # one thread: on a busy machine, idle OpenMP workers made tiny CPU ops ~100x slower
        torch.set_num_threads(1)
    if prof.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: benchmarks/gpu.py needs a GPU (or --smoke, on the CPU)", file=sys.stderr)
        return 1
    device = (f"{torch.cuda.get_device_name()} ({torch.cuda.get_device_properties(0).multi_processor_count} SMs)"
              if prof.device == "cuda" else "CPU, --smoke (tiny shapes, Triton interpreted: the numbers mean nothing)")
    meta = {"device": device, **versions(torch), "smoke": args.smoke, "budget_s": args.budget,
            "date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
            "command": "python benchmarks/gpu.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    report, budget = Report(args.outdir, meta), Budget(args.budget)
    parts, ends = args.only, deadlines(args.only, args.budget)
    kernel_parts = [p for p in parts if p != "models"]
    if kernel_parts and meta["triton"] == "not installed":
        report.section("kernels", "Kernels", ["part", "status"])
        for part in kernel_parts:
            report.add("kernels", part, ["skipped: Triton is not installed"], {}, status="skipped")
    elif kernel_parts:   # one timer for both parts: on a GPU, one flush buffer of 8x the L2
        timer = WallTimer(prof.samples) if prof.device == "cpu" else CudaTimer(prof.samples, not args.no_graphs)
        if "tune" in parts:
            run_tune(prof, args, report, budget, ends["tune"], timer)
        if "kernels" in parts:
            run_kernels(prof, args, report, budget, ends["kernels"], timer)
        goals(report)   # now too: a run stopped during the models keeps the kernels' verdicts
    if "models" in parts:
        run_models(prof, report, budget)
    goals(report)
    print(report.markdown(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
