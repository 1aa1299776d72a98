"""A heal run's curves as a PNG, from its log (heal_log.json or `HealReport.log()`): the training loss of every
step (and its running mean), the held-out metric at every evaluation, the best one marked, the learning rate
on a second axis. Needs matplotlib (drawn with its object API: no pyplot, no global backend switch)."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from normswap.errors import NormswapError
from normswap.healing.tracking import LOG_FILE
from normswap.io.atomic import check_writable


def check_available() -> None:
    """Before a long run that ends in a plot: matplotlib must be there."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise NormswapError("drawing the curves needs matplotlib: pip install matplotlib (or 'normswap[heal]')") \
            from None


def check_target(png: str | Path, overwrite: bool | str, out: str | Path | None = None) -> Path:
    """The PNG path, refused if it exists (without overwrite), is not named *.png or lies inside `out` (a
    folder replaced whole when the run ends)."""
    png = Path(png)
    if png.suffix.lower() != ".png":
        raise NormswapError(f"{png}: the plot's file name must end in .png")
    if png.is_dir() or (png.exists() and not overwrite):
        raise NormswapError(f"{png} exists" + (" and is a folder" if png.is_dir() else
                                              ": pass `overwrite=True` to replace it"))
    check_writable(png)
    if out is not None and Path(out).resolve() in png.resolve().parents:
        raise NormswapError(f"{png} is inside `out` {out}, which is replaced whole when the run ends")
    return png


def read_log(path: str | Path) -> dict:
    """A run's log: a healed folder's heal_log.json, or such a file."""
    path = Path(path)
    file = path / LOG_FILE if path.is_dir() else path
    try:
        log = json.loads(file.read_text())
    except FileNotFoundError:
        raise NormswapError(f"{path} has no {LOG_FILE}: was it written by `normswap heal`?") from None
    except (OSError, ValueError) as e:
        raise NormswapError(f"cannot read {file}: {e}") from None
    if not isinstance(log, dict) or not isinstance(log.get("log_history"), list):
        raise NormswapError(f"{file} is not a heal log (no log_history)")
    wrong = _malformed(log)
    if wrong:
        raise NormswapError(f"{file} is not a heal log ({wrong})")
    return log


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _malformed(log: dict) -> str | None:
    """What in `log` is not as `normswap heal` writes it (None: nothing), for what `plot_log` reads."""
    for i, r in enumerate(log["log_history"]):
        if not isinstance(r, dict) or not _number(r.get("step")):
            return f"log_history[{i}] has no step number"
        bad = [k for k, v in r.items() if (k in ("loss", "learning_rate") or k.startswith("eval_")) and not _number(v)]
        if bad:
            return f"log_history[{i}].{bad[0]} is not a number"
    checks = {"best_step": _number, "restored_step": _number, "steps_done": _number, "trainable": _number,
              "train": lambda v: isinstance(v, str), "objective": lambda v: isinstance(v, str),
              "lora": lambda v: isinstance(v, dict) and _number(v.get("rank"))}
    return next((f"{k} is {type(log[k]).__name__}" for k, ok in checks.items() if log.get(k) is not None
                 and not ok(log[k])), None)


def plot_log(log: dict, png: str | Path, overwrite: bool | str = False) -> Path:
    """Draw `log` (see `read_log`) into `png`, written atomically."""
    check_available()
    png = check_target(png, overwrite)
    fig = figure(log)
    png.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{png.name}.", suffix=".tmp", dir=png.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            fig.savefig(f, format="png")
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)  # mkstemp makes 0600 files: give the mode a plain write would
        os.replace(tmp, png)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return png


def figure(log: dict):
    """The matplotlib Figure of `log`'s curves (see `read_log`)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    history = log["log_history"]
    train = [(r["step"], r["loss"]) for r in history if "loss" in r]
    rates = [(r["step"], r["learning_rate"]) for r in history if "learning_rate" in r]
    key = next((k for r in history for k in r if k.startswith("eval_")), None)
    evals = [(r["step"], r[key]) for r in history if key in r] if key else []
    if not train:
        raise NormswapError("the log has no training step to draw")
    fig = Figure(figsize=(8, 4.8), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    steps, losses = zip(*train)
    ax.plot(steps, losses, color="tab:blue", alpha=0.3, linewidth=0.8, label="training loss (each step)")
    k = len(losses) // 20   # a running mean over 5% of the run; none where that is one step (the curve itself)
    if k > 1:
        means = [sum(losses[max(0, i - k + 1):i + 1]) / len(losses[max(0, i - k + 1):i + 1])
                 for i in range(len(losses))]
        ax.plot(steps, means, color="tab:blue", linewidth=1.8, label=f"training loss (mean of the last {k} steps)")
    if evals:
        es, ev = zip(*evals)
        ax.plot(es, ev, "o-", color="tab:orange", linewidth=1.8, markersize=4, label=f"held-out {key[5:]}")
        best = log.get("best_step")
        if best is not None and best in es:
            ax.plot([best], [ev[es.index(best)]], "*", color="tab:red", markersize=14,
                    label=f"best: {ev[es.index(best)]:.4g} at step {best}"
                          + (" (kept)" if log.get("restored_step") is not None else ""))
    if all(v > 0 for v in [*losses, *(e for _, e in evals)]):
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel(key[5:] if key else "loss")
    ax.grid(True, which="both", alpha=0.25)
    if rates:
        lr_ax = ax.twinx()
        lr_ax.plot(*zip(*rates), color="0.5", linestyle="--", linewidth=1, label="learning rate")
        lr_ax.set_ylabel("learning rate", color="0.4")
        lr_ax.tick_params(axis="y", colors="0.4")
        lines = ax.get_legend_handles_labels()[0] + lr_ax.get_legend_handles_labels()[0]
        ax.legend(lines, [h.get_label() for h in lines], loc="upper right", fontsize=8)
    else:
        ax.legend(loc="upper right", fontsize=8)
    what = log.get("train", "?") + (f" r={log['lora']['rank']}" if log.get("lora") else "")
    ax.set_title(f"normswap heal: {what}, {log.get('objective', '?')}, {log.get('steps_done', len(train))} steps, "
                 f"{log.get('trainable', 0):,} trained parameters", fontsize=10)
    fig.tight_layout()
    return fig
