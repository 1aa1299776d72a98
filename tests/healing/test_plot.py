"""`normswap.healing.plot`: the curves' legend says what each line is (issue 33 #15: "mean of 1")."""
from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

from normswap.healing.plot import figure  # noqa: E402


def _log(steps: int) -> dict:
    history = [{"step": s, "loss": 1.0 / s, "learning_rate": 1e-3} for s in range(1, steps + 1)]
    return {"log_history": history, "train": "norms", "objective": "kd", "steps_done": steps}


def _labels(steps: int) -> list[str]:
    fig = figure(_log(steps))
    return [label for ax in fig.axes for label in ax.get_legend_handles_labels()[1]]


def test_a_short_run_draws_no_running_mean_of_one_step():
    assert _labels(20) == ["training loss (each step)", "learning rate"]


def test_a_long_run_names_its_running_mean_in_steps():
    assert _labels(200)[:2] == ["training loss (each step)", "training loss (mean of the last 10 steps)"]
