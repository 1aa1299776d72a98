"""What the fingerprint check (issue 46) costs a load: `normswap.from_pretrained` and plain transformers'
`from_pretrained(trust_remote_code=True)` of a converted folder, with the check and without it, interleaved.

    python benchmarks/fingerprint.py                 # the demo and a GPT-2-small-sized model (~3 min)
    python benchmarks/fingerprint.py --repeats 11 --models demo

Each folder is written once (converted exactly, saved by normswap); each repeat loads it once per arm in a
new order, in this process, after a warm-up load per arm (page cache warm: the load's own work, not the disk).
Two measures: the load alone, and the load followed by the first forward a user runs (a batch of 8 x 64
tokens): the check runs the model's first forward inside the load (its first call pays for mapping the weights
in and warming the kernels, which transformers' lazy load leaves to that call), so "load + first forward"
is what a user waits for either way. The table gives the medians and the check's share: (with - without) /
without.
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


def arms(folder: Path, first: bool) -> dict:
    """Each loader with and without the check; with `first`, each followed by a forward of FIRST."""
    plain = transformers.AutoModelForCausalLM.from_pretrained
    loads = {
        "normswap, checked": lambda: normswap.from_pretrained(folder),
        "normswap, unchecked": lambda: normswap.from_pretrained(folder, check_fingerprint=False),
        "plain, checked": lambda: plain(folder, trust_remote_code=True),
        "plain, unchecked": lambda: plain(folder, trust_remote_code=True, normswap_fingerprint=False),
    }
    def then_forward(load):
        def run():
            model = load()
            with torch.no_grad():
                model(FIRST)
        return run
    return {name: then_forward(load) for name, load in loads.items()} if first else loads


FIRST = torch.randint(0, 8000, (8, 64))   # the first batch a user runs


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def timed(fn, clock=time.perf_counter) -> float:
    start = clock()
    fn()
    return clock() - start


def measure(folder: Path, repeats: int, first: bool, seed: int = 0, clock=time.perf_counter) -> dict[str, float]:
    runs = arms(folder, first)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for fn in runs.values():   # warm-up: page cache, imports, the shipped module's first import
        fn()
    order = list(runs)
    rng = random.Random(seed)
    for _ in range(repeats):
        rng.shuffle(order)
        for name in order:
            times[name].append(timed(runs[name], clock))
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--models", default="demo,gpt2-small")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                    help="wall: elapsed time (a quiet machine); cpu: this process's CPU time, all threads (a busy "
                         "one: other jobs' time left out)")
    ap.add_argument("--threads", type=int, help="torch's intra-op threads (default: torch's choice)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, threads {torch.get_num_threads()}, "
          f"clock {args.clock}, repeats {args.repeats}")
    print("| model | loader | measured | with the check (s) | without (s) | check's share |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, folder in folders(Path(tmp), args.models.split(",")).items():
            for first in (False, True):
                med = measure(folder, args.repeats, first, clock=CLOCKS[args.clock])
                for loader in ("normswap", "plain"):
                    on, off = med[f"{loader}, checked"], med[f"{loader}, unchecked"]
                    what = "load + first forward" if first else "load"
                    print(f"| {name} | {loader} | {what} | {on:.3f} | {off:.3f} | {(on - off) / off:+.1%} |")


if __name__ == "__main__":
    main()
