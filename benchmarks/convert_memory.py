"""Peak memory and wall time of `normswap convert` (exact) on random pre-LN GPT-2 checkpoints.

    python benchmarks/convert_memory.py --size medium --work /tmp/bench [--modes api,stream]

Builds the checkpoint tensor by tensor (GPT-2-medium: 355M parameters, 1.4 GB fp32; xl: 1.5B, 6.2 GB)
with perturbed norms (gains off 1, non-zero biases) and mean offsets in every writer, so the exact
conversion has real work to do. Each mode runs in a child process whose resident memory (with its
children) is polled every 20 ms:
  api    - normswap.load_model + normswap.convert(method="exact") + save_pretrained (in memory)
  stream - the CLI on the folder: `normswap convert SRC --to rmsnorm --method exact -o OUT` (streams)
Prints one JSON line per mode: wall_s, peak_rss_gb, baseline_gb (RSS once the libraries are imported,
before any weight is read), checkpoint_gb, ratio (peak / checkpoint) and used_ratio ((peak - baseline) /
checkpoint: the memory the conversion itself takes).
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch

SIZES = {"medium": dict(n_layer=24, n_embd=1024, n_head=16), "xl": dict(n_layer=48, n_embd=1600, n_head=25),
         "small": dict(n_layer=12, n_embd=768, n_head=12)}
# Each child prints its RSS once the libraries are imported, before any weight is read: `used` is the
# peak above that (what converting costs, without the ~0.4 GB Python + torch + transformers take).
BASELINE = ("import sys, psutil, normswap, normswap.pipeline.lazy_convert, transformers.models.gpt2.modeling_gpt2; "
            "print('BASELINE', psutil.Process().memory_info().rss, flush=True); ")
API = BASELINE + ("m, t = normswap.load_model(sys.argv[1]); normswap.convert(m, method='exact'); "
                  "normswap.save_pretrained(m, sys.argv[2], tokenizer=t)")
CLI = BASELINE + "from normswap.cli import main; main(sys.argv[1:])"


def build(size: str, path: Path) -> int:
    """Write a random perturbed GPT-2 checkpoint to `path` without holding it; its size in bytes."""
    import transformers
    from accelerate import init_empty_weights

    from normswap.io import safetensors as shards
    config = transformers.GPT2Config(vocab_size=50257, n_positions=1024, architectures=["GPT2LMHeadModel"],
                                     **SIZES[size])
    with init_empty_weights():
        model = transformers.GPT2LMHeadModel(config)
    model.tie_weights()
    specs = shards.saved_specs(model)
    g = torch.Generator().manual_seed(0)

    def tensors():
        for name, _, shape in specs:
            if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
                yield 1 + 0.3 * torch.randn(shape, generator=g)
            elif len(shape) == 1:
                yield 0.2 + 0.3 * torch.randn(shape, generator=g)
            else:  # per-output offsets: the stream writers are far from zero-mean
                yield 0.02 * torch.randn(shape, generator=g) + 0.01 * torch.randn(shape[0], 1, generator=g)

    path.mkdir(parents=True)
    config.save_pretrained(path)
    shards.write(path, specs, tensors(), "2GB")
    return shards.total_bytes(specs)


def measure(cmd: list[str]) -> tuple[float, int, int, int]:
    """(wall seconds, peak RSS of the process tree in bytes, RSS after imports, return code)."""
    start = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    root = psutil.Process(proc.pid)
    peak = 0
    while proc.poll() is None:
        try:
            rss = sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
            peak = max(peak, rss)
        except psutil.Error:
            pass
        time.sleep(0.02)
    out, err = proc.communicate()
    if proc.returncode:
        print(err[-2000:], file=sys.stderr)
    base = next((int(line.split()[1]) for line in out.splitlines() if line.startswith("BASELINE")), 0)
    return time.time() - start, peak, base, proc.returncode


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", choices=SIZES, default="medium")
    ap.add_argument("--work", type=Path, required=True, help="Scratch folder (checkpoint + outputs).")
    ap.add_argument("--modes", default="api,stream")
    args = ap.parse_args()
    src = args.work / f"gpt2-{args.size}"
    if not src.exists():
        t = time.time()
        build(args.size, src)
        print(f"built {src} in {time.time() - t:.0f} s", file=sys.stderr)
    from normswap.io import safetensors as shards
    size = shards.Reader(src).total_size()
    for mode in args.modes.split(","):
        out = args.work / f"out-{args.size}-{mode}"
        shutil.rmtree(out, ignore_errors=True)
        cmd = ([sys.executable, "-c", API, str(src), str(out)] if mode == "api" else
               [sys.executable, "-c", CLI, "-q", "convert", str(src), "--to", "rmsnorm", "--method", "exact",
                "-o", str(out), "--max-shard-size", "2GB"])
        wall, peak, base, rc = measure(cmd)
        print(json.dumps({"size": args.size, "mode": mode, "ok": rc == 0, "wall_s": round(wall, 1),
                          "peak_rss_gb": round(peak / 1e9, 3), "baseline_gb": round(base / 1e9, 3),
                          "checkpoint_gb": round(size / 1e9, 3), "ratio": round(peak / size, 3),
                          "used_ratio": round((peak - base) / size, 3)}), flush=True)
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
