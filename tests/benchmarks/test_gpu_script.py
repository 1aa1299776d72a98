"""benchmarks/gpu.py, the one-call GPU benchmark, run end to end on the CPU (--smoke), so that it cannot rot
between the sessions that have a GPU: every table is written, as markdown and JSON, with sane numbers, and
the budget skips rows rather than overrunning."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu.py"
MODES = ("fwd", "bwd", "prms", "add")
DTYPES = ("bf16", "fp32", "fp16")
PEERS = {"fwd": ("F.rms_norm", "compiled F.rms_norm", "F.layer_norm"),
         "bwd": ("F.rms_norm", "compiled F.rms_norm", "F.layer_norm"),
         "prms": ("ours, p = 1", "F.rms_norm"),
         "add": ("add + ours", "add + F.rms_norm", "compiled add + F.rms_norm")}
SECTIONS = {f"kernels/{m}/{d}" for m in MODES for d in DTYPES} | {"tune", "models", "profile", "goals"}


def run_script(out: Path, *extra: str) -> tuple[dict, str]:
    env = {k: v for k, v in os.environ.items() if k != "NORMSWAP_BACKEND"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, str(SCRIPT), str(out), "--smoke", *extra], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads((out / "gpu.json").read_text()), (out / "gpu.md").read_text()


def test_deadlines_follow_the_shares():
    sys.path.insert(0, str(SCRIPT.parent))
    import gpu
    assert gpu.deadlines(("tune", "kernels", "models"), 100) == pytest.approx({"tune": 20, "kernels": 50,
                                                                               "models": None})
    assert gpu.deadlines(("tune", "models"), 70) == pytest.approx({"tune": 20, "models": None})
    assert gpu.deadlines(("kernels",), 70) == {"kernels": None}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu")
    data, md = run_script(out)
    data["meta"]["outdir"] = str(out)
    return data, md


def sane(values: dict, keys) -> None:
    for k in keys:
        assert k in values, (k, values)
    for k, v in values.items():
        assert isinstance(v, (int, float)) and math.isfinite(v), (k, v)
        assert v > 0 or (k == "rel_err" and v == 0), (k, v)


def test_every_section_is_written_as_markdown_and_json(smoke):
    data, md = smoke
    assert set(data["sections"]) == SECTIONS
    for sec in data["sections"].values():
        assert f"### {sec['title']}" in md
        assert "| " + " | ".join(sec["columns"]) + " |" in md
        for row in sec["rows"]:
            assert len(row["cells"]) == len(sec["columns"]) - 1, row
            assert "| " + " | ".join([row["label"], *row["cells"]]) + " |" in md
    meta = data["meta"]
    assert meta["smoke"] is True and 0 < meta["elapsed_s"] < meta["budget_s"]
    assert {"device", "torch", "triton", "transformers", "liger_kernel", "date", "command"} <= set(meta)


def test_some_parts_share_the_budget_and_a_bad_part_is_refused(tmp_path):
    data, _ = run_script(tmp_path / "a", "--only", "tune,models")
    assert set(data["sections"]) == {"tune", "models", "profile", "goals"}
    proc = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "b"), "--smoke", "--only", "kernel"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "parts are tune, kernels, models, got 'kernel'" in proc.stderr
    assert not (tmp_path / "b").exists()


def test_tuning_times_every_setting_and_writes_what_won(smoke, tmp_path):
    data, _ = smoke
    rows = data["sections"]["tune"]["rows"]
    assert [r["label"] for r in rows] == [f"{d} {m} 8 x 48" for d in ("bf16", "fp32") for m in ("fwd", "bwd")]
    for r in rows:
        assert r["status"] == "ok", r
        sane(r["values"], ["rows", "width", "default_us", "best_us", "speedup"])
        timed = [us for _, us, _ in r["tried"] if us is not None]
        assert len(timed) == len(r["tried"]) >= 1 and r["values"]["best_us"] == min(timed)
        assert r["tried"][0][1] == r["values"]["default_us"]
        if r["mode"] == "fwd":   # tiles of several rows are among the settings tried
            assert len(r["tried"]) > 1 and {L[1] for L, _, _ in r["tried"]} >= {1, 2, 4}
    # tuned.py: the TUNED assignment, holding exactly the settings adopted (others kept the default)
    scope = {}
    exec((Path(data["meta"]["outdir"]) / "tuned.py").read_text(), scope)
    adopted = {(r["mode"], 2 if r["dtype"] == "bf16" else 4, 64): ((8, *r["adopted"]),) for r in rows
               if r["cells"][5] == "yes"}
    from normswap.ops import tuning   # the checked-in settings of other architectures are kept
    assert scope["TUNED"] == {**tuning.TUNED, **({"cpu": adopted} if adopted else {})}
    # and the kernel tables after it ran ours with them: at 8 rows the tuned setting, at 1 row the default
    for r in rows:
        modes = ("fwd", "prms", "add") if r["mode"] == "fwd" else ("bwd",)
        for mode in modes:
            used = {k["label"]: k["launch"] for k in data["sections"][f"kernels/{mode}/{r['dtype']}"]["rows"]}
            assert used["8 x 48"] == r["adopted"] and used["1 x 48"] == r["tried"][0][0], (mode, used)


def test_kernel_rows_cover_every_shape_with_sane_numbers(smoke):
    data, _ = smoke
    for mode in MODES:
        for dtype in DTYPES:
            rows = data["sections"][f"kernels/{mode}/{dtype}"]["rows"]
            assert [r["label"] for r in rows] == ["8 x 48", "1 x 48"]
            for r in rows:
                assert r["status"] == "ok", r
                sane(r["values"], ["rows", "width", "bytes", "ours_us", "gbs", "copy_us", "copy_frac", "rel_err"]
                     + [f"{p} {what}" for p in PEERS[mode] for what in ("us", "/ ours")])
                # Liger: measured where it imports, else said why not
                assert "Liger us" in r["values"] or "Liger" in r["errors"] or mode == "prms"


def test_model_rows_pair_both_sizes_modes_and_workloads_with_an_aa_control(smoke):
    data, _ = smoke
    rows = data["sections"]["models"]["rows"]
    assert [(r["mode"], r["size"], r["workload"]) for r in rows] == [
        (mode, size, w) for mode in ("eager", "compiled") for size in ("small", "medium")
        for w in ("prefill", "decode", "train")]
    for r in rows:
        assert r["status"] == "ok", r
        sane(r["values"], ["original_ms", "converted_ms", "ratio", "ratio_lo", "ratio_hi", "aa", "aa_lo", "aa_hi",
                           "warmup_s"])
        assert r["values"]["ratio_lo"] <= r["values"]["ratio"] <= r["values"]["ratio_hi"]


def test_profile_rows_give_the_norms_share_of_each_model(smoke):
    data, _ = smoke
    rows = data["sections"]["profile"]["rows"]
    assert [(r["size"], r["workload"]) for r in rows] == [(s, w) for s in ("small", "medium")
                                                          for w in ("prefill", "train")]
    for r in rows:
        assert r["status"] == "ok", r
        v = r["values"]
        sane({k: x for k, x in v.items() if k != "ceiling"}, ["orig_ms", "orig_norm_ms", "share", "conv_ms",
                                                             "conv_norm_ms", "ratio"])
        assert 0 < v["orig_norm_ms"] < v["orig_ms"] and v["ceiling"] == pytest.approx(1 - v["share"])
        assert 0 < v["conv_norm_ms"] < v["conv_ms"]   # the converted model's norms are found too


def test_goals_table_gives_a_verdict_for_every_goal(smoke):
    data, _ = smoke
    rows = data["sections"]["goals"]["rows"]
    assert len(rows) == 9
    assert {r["cells"][-1] for r in rows} <= {"met", "NOT met", "not measured"}


def test_a_spent_budget_skips_every_row_and_says_so(tmp_path):
    data, md = run_script(tmp_path, "--budget", "0")
    rows = [r for key, sec in data["sections"].items() if key != "goals" for r in sec["rows"]]
    assert rows and all(r["status"].startswith("skipped: budget") for r in rows)
    assert "skipped: budget" in md
    assert {r["cells"][-1] for r in data["sections"]["goals"]["rows"]} == {"not measured"}
