"""ORT CPU latency: LayerNorm original vs RMSNorm-converted GPT-2, both exported by normswap alike.

For each model: export original and converted (method "exact" when registered, else "naive") with
the same settings, time the two ORT sessions interleaved (median per session, ratio
converted/original), then profile both with ORT's profiler and sum the norm ops' kernel time.

    python benchmarks/onnx_latency.py                       # demo model + GPT-2-small-sized, seq 128
    python benchmarks/onnx_latency.py --models demo --seq 64 --runs 20 --profile-runs 10   # quick
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
import transformers

import normswap
from normswap.models.demo import DEMO_DIR, DEMO_NAME
from normswap.export import fuse
from normswap.export.validate import session

NORM_OPS = set(fuse.RMS_OPS + fuse.LN_OPS)


def build(name: str):
    """(model, description): the demo model if it is bundled, else random GPT-2 of that size."""
    transformers.logging.set_verbosity_error()
    if name == "demo" and (DEMO_DIR / "config.json").exists():
        return normswap.load_model(DEMO_NAME)[0], "normswap-demo (trained, 4x256)"
    torch.manual_seed(0)
    if name == "demo":
        cfg = transformers.GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=8192, n_positions=256)
        desc = "random GPT-2 4x256, vocab 8192 (demo shape; demo not bundled yet)"
    else:
        cfg, desc = transformers.GPT2Config(), "random GPT-2-small (12x768)"
    return transformers.GPT2LMHeadModel(cfg).eval(), desc


def feed(vocab: int, batch: int, seq: int) -> dict:
    ids = np.random.default_rng(0).integers(0, vocab, (batch, seq))
    return {"input_ids": ids, "attention_mask": np.ones_like(ids)}


def interleaved(sessions: dict, inputs: dict, runs: int) -> dict[str, float]:
    """Median ms per session; sessions alternate every run (order flipped too) so drift hits both."""
    times = defaultdict(list)
    for s in sessions.values():
        s.run(None, inputs)
    for i in range(runs):
        for key in (list(sessions) if i % 2 == 0 else list(sessions)[::-1]):
            t = time.perf_counter()
            sessions[key].run(None, inputs)
            times[key].append((time.perf_counter() - t) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def norm_profile(path: Path, inputs: dict, runs: int, threads: int) -> dict:
    """ORT profiler: mean per-run kernel time (ms) of norm ops and of all ops."""
    prefix = str(path.with_suffix(""))
    sess = session(path, profile_prefix=prefix, threads=threads)
    sess.run(None, inputs)
    Path(sess.end_profiling()).unlink()   # drop the warm-up run
    sess = session(path, profile_prefix=prefix, threads=threads)
    for _ in range(runs):
        sess.run(None, inputs)
    events = json.loads(Path(sess.end_profiling()).read_text())
    norm = total = 0.0
    for e in events:
        if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time"):
            total += e["dur"]
            norm += e["dur"] if e.get("args", {}).get("op_name") in NORM_OPS else 0.0
    return {"norm_ms": norm / runs / 1e3, "total_ms": total / runs / 1e3}


def bench(name: str, args, tmp: Path) -> dict:
    original, desc = build(name)
    method = "exact"
    converted = copy.deepcopy(original)
    normswap.convert(converted, method=method)
    paths, reports = {}, {}
    for key, model in (("layernorm", original), ("rmsnorm", converted)):
        paths[key] = tmp / f"{name}-{key}.onnx"
        reports[key] = normswap.export_onnx(model, paths[key], target=args.target,
                                            dtype="fp16" if args.fp16 else "fp32")
    inputs = feed(original.config.vocab_size, args.batch, args.seq)
    sessions = {k: session(p, threads=args.threads) for k, p in paths.items()}
    lat = interleaved(sessions, inputs, args.runs)
    prof = {k: norm_profile(p, inputs, args.profile_runs, args.threads) for k, p in paths.items()}
    return {"model": desc, "method": method, "fused": {k: r.fused for k, r in reports.items()},
            "max_abs": {k: r.max_abs for k, r in reports.items()}, "latency_ms": lat,
            "ratio": lat["rmsnorm"] / lat["layernorm"], "profile": prof,
            "norm_speedup": prof["layernorm"]["norm_ms"] / max(prof["rmsnorm"]["norm_ms"], 1e-9)}


def table(rows: list[dict], args) -> str:
    head = (f"target {args.target}{', fp16' if args.fp16 else ''}, batch {args.batch}, seq {args.seq}, "
            f"{args.threads} ORT thread(s), {args.runs} interleaved runs, {args.profile_runs} profiled runs")
    lines = [head, "",
             "| model | method | LN ms | RMS ms | ratio RMS/LN | LN norm-op ms | RMS norm-op ms | norm-op speedup "
             "| norm share LN / RMS |", "|" + "---|" * 9]
    for r in rows:
        p, lat = r["profile"], r["latency_ms"]
        share = " / ".join(f"{100 * p[k]['norm_ms'] / max(p[k]['total_ms'], 1e-9):.1f}%"
                           for k in ("layernorm", "rmsnorm"))
        lines.append(f"| {r['model']} | {r['method']} | {lat['layernorm']:.2f} | {lat['rmsnorm']:.2f} | "
                     f"{r['ratio']:.3f} | {p['layernorm']['norm_ms']:.3f} | {p['rmsnorm']['norm_ms']:.3f} | "
                     f"{r['norm_speedup']:.2f}x | {share} |")
    lines += [""] + [f"- {r['model']}: fused nodes {r['fused']}, max |Δ| vs PyTorch {r['max_abs']}" for r in rows]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="demo,gpt2-small", help="comma list of: demo, gpt2-small")
    ap.add_argument("--target", default="ort", choices=["ort", "onnx23"])
    ap.add_argument("--fp16", action="store_true")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--profile-runs", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1, help="ORT intra-op threads (1: steadier on a shared CPU)")
    ap.add_argument("--json", action="store_true", help="also print the raw numbers as JSON")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [bench(m.strip(), args, Path(tmp)) for m in args.models.split(",")]
    print(table(rows, args))
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
