"""Which of transformers 5's renamed families normswap converts exactly: the cases of tests/models/test_renamed.py.

    python benchmarks/renamed.py                      # every key of the table (~30 min on 2 cores)
    python benchmarks/renamed.py --keys videomae,ViTModel
    python benchmarks/renamed.py --report renamed.jsonl

transformers 5 renames a checkpoint's tensors when it loads them, by the model's (or a sub-model's) class name or
model_type (`transformers/conversion_mapping.py`); a converted folder loads right in plain transformers only if
its generated class registers the original's renaming (`register_base_mapping`). Each key of that table is built
tiny as architectures.py builds a model type (a class name: that class; a model type: each of its classes in
transformers' Auto tables in turn, until one converts exactly), then converted with `method="auto"`, saved and
reloaded (architectures.py's `one`, in a process of its own). A key is a case when its model ends exact or
exact+kept and the key's renaming applies to it (`renamed`: the table's keys that match it or a sub-model).
"""
from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
from pathlib import Path

import architectures

GOOD = ("exact", "exact+kept")
MOST = 4   # classes tried per model type


def keys() -> list[str]:
    """The table's keys, but the renaming every model gets ("legacy")."""
    from transformers.conversion_mapping import _build_checkpoint_conversion_mapping
    return sorted(k for k in _build_checkpoint_conversion_mapping() if k != "legacy")


def candidates(key: str) -> list[str]:
    """What to build for a key: the class it names, or (a model type) its classes, architectures.build's first."""
    import transformers as tf
    from transformers.models.auto import modeling_auto as auto
    if isinstance(getattr(tf, key, None), type):
        return [key]
    tables = ["MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
              "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "MODEL_MAPPING_NAMES",
              *sorted(n for n in dir(auto) if n.endswith("_MAPPING_NAMES"))]
    out = []
    for table in tables:
        name = getattr(auto, table).get(key)
        for n in name if isinstance(name, (list, tuple)) else [name]:
            cls = getattr(tf, n, None) if n else None
            if isinstance(cls, type) and issubclass(cls, tf.PreTrainedModel) and n not in out:
                out.append(n)
    return out or [key]   # nothing to build: the key itself, which reports why


def sweep(key: str, timeout: int) -> dict:
    """The first candidate that converts exactly with the key's renaming applied, else the first's row."""
    rows = []
    for name in candidates(key)[:MOST]:
        row = {"key": key, **next(architectures.isolated(architectures.__file__, [name], 1, timeout))}
        if row["outcome"] in GOOD and key in row.get("renamed", []):
            return row
        rows.append(row)
        if row["outcome"] in ("unbuilt", "no-layernorm") and name == key:
            break
    return rows[0]


def report(path: Path) -> None:
    rows = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
    counts = collections.Counter(r["outcome"] for r in rows)
    built = [r for r in rows if r["outcome"] != "unbuilt"]
    cases = sorted(r["key"] for r in rows if r["outcome"] in GOOD and r["key"] in r.get("renamed", []))
    print(f"{len(rows)} keys in the renaming table; built tiny: {len(built)}; exact (renaming applied): {len(cases)}")
    for outcome, n in sorted(counts.items()):
        print(f"  {outcome:<13} {n}")
    for r in rows:
        if r["outcome"] in GOOD:
            print(f"  {r['key']:<36} {r['class']:<44} renamed by {r.get('renamed')}")
    by_class = collections.defaultdict(list)   # one case per class built: the keys it covers
    for r in rows:
        if r["key"] in cases:
            by_class[r["class"]].append(r["key"])
    print(f"{len(by_class)} cases (classes built), for tests/helpers/renamed_models.py:")
    for cls, covered in sorted(by_class.items()):
        print(f"    {cls!r}: {tuple(covered)!r},")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", help="comma-separated keys of the table (default: all)")
    ap.add_argument("--out", type=Path, default=Path("renamed.jsonl"))
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--timeout", type=int, default=180)
    ap.add_argument("--report", type=Path, help="summarise an earlier run's JSONL")
    a = ap.parse_args()
    if not a.report:
        with a.out.open("w") as f, concurrent.futures.ThreadPoolExecutor(a.jobs) as pool:
            for row in pool.map(lambda k: sweep(k, a.timeout), a.keys.split(",") if a.keys else keys()):
                f.write(json.dumps(row) + "\n")
                f.flush()
                print(f"{row['key']:<36} {row.get('class', ''):<40} {row['outcome']:<11} "
                      f"{row.get('why', row.get('worst', ''))[:100]}", flush=True)
    report(a.report or a.out)


if __name__ == "__main__":
    main()
