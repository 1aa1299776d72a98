"""`normswap plot` and `normswap.healing.plot`: a malformed heal_log.json says "not a heal log" in one line,
whatever is wrong in it (strings, nulls, a missing step, lora as a number), never a TypeError or KeyError
(issue 33 #20); the curves' legend says what each line is (issue 33 #15: "mean of 1")."""
from __future__ import annotations

import json

import pytest

from helpers.cli import one_error_line, run

GOOD = {"train": "norms", "objective": "kd", "steps_done": 2, "trainable": 10, "lora": None, "best_step": 2,
        "log_history": [{"step": 1, "loss": 1.0, "learning_rate": 0.1}, {"step": 2, "loss": 0.5, "eval_kl": 0.2}]}


@pytest.mark.parametrize("change,why", [
    ({"log_history": [{"step": 1, "loss": "high"}]}, "log_history[0].loss is not a number"),
    ({"log_history": [{"loss": 1.0}]}, "log_history[0] has no step number"),
    ({"log_history": [None]}, "log_history[0] has no step number"),
    ({"log_history": [{"step": "1", "loss": 1.0}]}, "log_history[0] has no step number"),
    ({"log_history": [{"step": 1, "loss": None}]}, "log_history[0].loss is not a number"),
    ({"lora": 4}, "lora is int"),
    ({"train": 3}, "train is int"),
    ({"best_step": "2"}, "best_step is str")])
def test_a_malformed_log_is_not_a_heal_log(tmp_path, change, why):
    log = tmp_path / "heal_log.json"
    log.write_text(json.dumps({**GOOD, **change}))
    assert one_error_line(run("plot", log, "-o", tmp_path / "p.png")) == f"error: {log} is not a heal log ({why})"
    assert not (tmp_path / "p.png").exists()


def test_a_well_formed_log_plots(tmp_path):
    pytest.importorskip("matplotlib")
    log = tmp_path / "heal_log.json"
    log.write_text(json.dumps(GOOD))
    result = run("plot", log, "-o", tmp_path / "p.png")
    assert result.exit_code == 0 and (tmp_path / "p.png").stat().st_size > 1000


def _labels(steps: int) -> list[str]:
    pytest.importorskip("matplotlib")
    from normswap.healing.plot import figure
    history = [{"step": s, "loss": 1.0 / s, "learning_rate": 1e-3} for s in range(1, steps + 1)]
    fig = figure({"log_history": history, "train": "norms", "objective": "kd", "steps_done": steps})
    return [label for ax in fig.axes for label in ax.get_legend_handles_labels()[1]]


def test_a_short_run_draws_no_running_mean_of_one_step():
    assert _labels(20) == ["training loss (each step)", "learning rate"]


def test_a_long_run_names_its_running_mean_in_steps():
    assert _labels(200)[:2] == ["training loss (each step)", "training loss (mean of the last 10 steps)"]
