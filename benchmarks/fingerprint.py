"""What the fingerprint check (issue 46) costs a load: `normswap.from_pretrained` and plain transformers'
`from_pretrained(trust_remote_code=True)` of a converted folder, with the check and without it, interleaved.

    python benchmarks/fingerprint.py                 # the demo and a GPT-2-small-sized model (~2 min)
    python benchmarks/fingerprint.py --repeats 11 --models demo

Each folder is written once (converted exactly, saved by normswap); each repeat loads it once per arm in a
new order, in this process, after a warm-up load per arm (page cache warm: the load's own work, not the disk).
The table gives the median load time per arm and the check's share: (with - without) / without.
"""
from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
import transformers

import normswap


def folders(root: Path, which: list[str]) -> dict[str, Path]:
    out = {}
    if "demo" in which:
        model, tok = normswap.load_model("normswap-demo")
        normswap.convert(model, method="exact")
        out["demo"] = normswap.save_pretrained(model, root / "demo", tokenizer=tok)
    if "gpt2-small" in which:
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config()).eval()   # 124M parameters, fp32
        normswap.convert(model, method="exact")
        out["gpt2-small"] = normswap.save_pretrained(model, root / "gpt2-small")
    return out


def arms(folder: Path) -> dict:
    plain = transformers.AutoModelForCausalLM.from_pretrained
    return {
        "normswap, checked": lambda: normswap.from_pretrained(folder),
        "normswap, unchecked": lambda: normswap.from_pretrained(folder, check_fingerprint=False),
        "plain, checked": lambda: plain(folder, trust_remote_code=True),
        "plain, unchecked": lambda: plain(folder, trust_remote_code=True, normswap_fingerprint=False),
    }


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(folder: Path, repeats: int, seed: int = 0) -> dict[str, float]:
    runs = arms(folder)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for fn in runs.values():   # warm-up: page cache, imports, the shipped module's first import
        fn()
    order = list(runs)
    rng = random.Random(seed)
    for _ in range(repeats):
        rng.shuffle(order)
        for name in order:
            times[name].append(timed(runs[name]))
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--models", default="demo,gpt2-small")
    args = ap.parse_args()
    transformers.logging.set_verbosity_error()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, threads {torch.get_num_threads()}")
    print("| model | loader | load with check (s) | without (s) | check's share |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, folder in folders(Path(tmp), args.models.split(",")).items():
            med = measure(folder, args.repeats)
            for loader in ("normswap", "plain"):
                on, off = med[f"{loader}, checked"], med[f"{loader}, unchecked"]
                print(f"| {name} | {loader} | {on:.3f} | {off:.3f} | {(on - off) / off:+.1%} |")


if __name__ == "__main__":
    main()
