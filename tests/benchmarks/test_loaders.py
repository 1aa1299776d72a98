"""benchmarks/loaders.py (issue 46's before/after measurement) keeps running and keeps its table's shape: one
tiny GPT-2, every save path by every loader."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "loaders.py"
OUTCOMES = ("OK", "WRONG", "REFUSED", "n/a")
LOADERS = ("1", "2", "3", "4", "5a", "5b")
COLUMNS = [f"{save}.{loader}" for save in "abc" for loader in LOADERS]   # every save path by every loader
CONTROL = [f"o.{loader}" for loader in LOADERS]   # the original saved by transformers, by every loader


@pytest.fixture(scope="module")
def gpt2_run(tmp_path_factory):
    """(stdout, JSONL rows) of `loaders.py --types gpt2`, with this checkout's normswap."""
    out = tmp_path_factory.mktemp("loaders") / "gpt2.jsonl"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--types", "gpt2", "--out", str(out)], cwd=out.parent,
                          env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, [json.loads(line) for line in out.read_text().splitlines()]


def test_the_table_has_every_save_path_by_every_loader(gpt2_run):
    stdout, rows = gpt2_run
    lines = stdout.splitlines()
    header = next(line for line in lines if line.startswith("| type |"))
    assert [c.strip() for c in header.strip("|").split("|")] == ["type", "class", "method", "renamed", *COLUMNS]
    body = next(line for line in lines if line.startswith("| gpt2 |"))
    cells = [c.strip() for c in body.strip("|").split("|")][4:]
    assert len(cells) == len(COLUMNS) and all(c.replace("**", "").split(" ")[0] in OUTCOMES for c in cells), body
    control = next(line for line in lines if line.startswith("| type | memory |"))
    assert [c.strip() for c in control.strip("|").split("|")] == ["type", "memory", "after saves", *CONTROL]
    counted = [line.split("|")[1].strip() for line in lines if line.startswith("| ") and line.count("|") == 6]
    assert counted == ["column", *COLUMNS, "column", *CONTROL]   # the counts tables: a row per column

    (row,) = rows
    assert row["outcome"] == "measured" and row["method"] == "exact" and row["class"] == "GPT2LMHeadModel", row
    assert sorted(row["cells"]) == sorted(COLUMNS + CONTROL)
    for name, cell in row["cells"].items():
        assert cell["outcome"] in OUTCOMES, (name, cell)
        if cell["outcome"] in ("OK", "WRONG"):   # the control is compared to the original alone
            assert isinstance(cell["rel"], float), (name, cell)
            assert name in CONTROL or isinstance(cell["rel_original"], float), (name, cell)
        else:
            assert cell["why"], (name, cell)
    assert row["cells"]["a.1"]["outcome"] == "OK"   # normswap's own round trip
    assert row["cells"]["o.2"]["outcome"] == "OK"   # the original in plain transformers: the loader works
    assert row["memory_after_saves"]["outcome"] == "OK"   # no save changed the model in memory


# No save path and no loader gives another model without an error (issue 46).
def test_no_load_returns_another_model(gpt2_run):
    _, (row,) = gpt2_run
    assert {name: cell for name, cell in row["cells"].items() if cell["outcome"] == "WRONG" and name in COLUMNS} == {}
