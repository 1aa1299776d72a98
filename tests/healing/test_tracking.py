"""Evaluation while healing: held-out windows apart from the training tokens, the values trackers receive
(TensorBoard event files, a custom Accelerate tracker), heal_log.json, early stopping, the plot, bad values."""
from __future__ import annotations

import copy
import json
import math
import sys

import pytest
import torch
from accelerate.tracking import GeneralTracker
from click.testing import CliRunner
from helpers.heal_models import save_pair, text

import normswap
from normswap.cli import main
from normswap.errors import NormswapError
from normswap.healing import plot_log
from normswap.healing.options import HealOptions
from normswap.healing.tracking import hold_out
from normswap.models.rebuild import from_pretrained
from normswap.textdata import joined_ids

FAST = dict(seq_len=32, batch_size=4, progress=False)
TRAIN = [text(3000, seed=0)]


def test_held_out_windows_are_spread_and_never_trained_on():
    ids = torch.arange(1000)   # every token distinct: where each went is visible
    train, held = hold_out(ids, HealOptions(eval_every=1, eval_fraction=0.1, eval_windows=64), None, 20)
    assert held.shape == (5, 20)  # 10% of 50 windows
    assert [int(w[0]) for w in held] == [100, 300, 500, 700, 900]  # evenly spread, whole windows
    assert all(torch.equal(w, torch.arange(w[0], w[0] + 20)) for w in held)
    assert sorted(torch.cat([train, held.flatten()]).tolist()) == list(range(1000))  # a partition
    train, held = hold_out(ids, HealOptions(eval_every=1, eval_fraction=0.5, eval_windows=3), None, 20)
    assert held.shape == (3, 20) and len(train) == 940   # the window cap
    same, none = hold_out(ids, HealOptions(), None, 20)
    assert none is None and same is ids   # no evaluation: nothing held out


def test_held_out_value_is_the_kl_to_the_teacher(pair, tok):
    """The step-0 value is the mean per-position KL(teacher || student) over the held-out windows."""
    teacher, student = pair
    options = HealOptions(eval_every=1, eval_windows=4, seq_len=32, batch_size=4, steps=1)
    report = normswap.heal(copy.deepcopy(student), teacher, TRAIN, tokenizer=tok, options=options, progress=False)
    _, held = hold_out(joined_ids(tok, TRAIN), options, tok, 32)
    with torch.no_grad():
        lt = teacher(input_ids=held).logits.double().log_softmax(-1)
        ls = student(input_ids=held).logits.double().log_softmax(-1)
    kl = (lt.exp() * (lt - ls)).sum(-1).mean().item()
    assert report.eval_metric == "kl" and report.evals[0][0] == 0 and held.shape == (4, 32)
    assert math.isclose(report.evals[0][1], kl, rel_tol=1e-5), (report.evals[0][1], kl)


class Recorder(GeneralTracker):
    """A custom tracker through Accelerate's GeneralTracker: what heal sends, kept in memory."""
    name, requires_logging_directory, main_process_only = "recorder", False, True

    def __init__(self):
        super().__init__()
        self.config, self.logged, self.finished = None, [], 0

    @property
    def tracker(self):
        return self

    def store_init_configuration(self, values):
        self.config = dict(values)

    def log(self, values, step=None, **kwargs):
        self.logged.append((step, dict(values)))

    def finish(self):
        self.finished += 1


def test_a_custom_tracker_receives_losses_rates_and_held_out_values(pair, tok):
    teacher, student = pair
    rec = Recorder()
    report = normswap.heal(copy.deepcopy(student), teacher, TRAIN, tokenizer=tok, steps=10, eval_every=4,
                           report_to=[rec], lr=1e-2, **FAST)
    assert rec.finished == 1 and rec.config["steps"] == 10 and rec.config["train"] == "norms"
    train = [(s, v) for s, v in rec.logged if "train/loss" in v]
    assert [s for s, _ in train] == list(range(1, 11))
    assert [v["train/loss"] for _, v in train] == report.losses
    warm = 1  # 10% of 10 steps
    expected = [1e-2 * min(1.0, (i + 1) / warm) * 0.5 * (1 + math.cos(math.pi * i / 10)) for i in range(10)]
    assert [v["train/learning_rate"] for _, v in train] == pytest.approx(expected, rel=1e-12)
    evals = [(s, v["eval/kl"]) for s, v in rec.logged if "eval/kl" in v]
    assert evals == report.evals and [s for s, _ in evals] == [0, 4, 8, 10]  # step 0, every 4, the last
    assert evals[-1][1] < evals[0][1]


def test_tensorboard_writes_event_files_with_the_values(pair, tok, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    teacher, student = pair
    report = normswap.heal(copy.deepcopy(student), teacher, TRAIN, tokenizer=tok, steps=6, eval_every=3,
                           report_to="tensorboard", logging_dir=str(tmp_path / "runs"), **FAST)
    files = list((tmp_path / "runs").rglob("events.out.tfevents.*"))
    assert files
    scalars = {}
    for f in files:
        acc = EventAccumulator(str(f))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            scalars[tag] = [(e.step, e.value) for e in acc.Scalars(tag)]
    assert [s for s, _ in scalars["train/loss"]] == list(range(1, 7))
    assert [v for _, v in scalars["train/loss"]] == pytest.approx(report.losses, rel=1e-6)
    assert [s for s, _ in scalars["eval/kl"]] == [0, 3, 6]
    assert [v for _, v in scalars["eval/kl"]] == pytest.approx([v for _, v in report.evals], rel=1e-6)


def _sabotage_after(step: int, model, kept: dict):
    """A callback that keeps the trainable weights of `step` and then wrecks them: every later evaluation is
    worse, so early stopping must come back to exactly these weights."""
    def callback(done, loss):
        if done == step:
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if p.requires_grad:
                        kept[n] = p.detach().clone()
                        p.mul_(-3.0)
    return callback


@pytest.mark.parametrize("early_stop", [True, False])
def test_early_stop_restores_the_best_step(pair, tok, tmp_path, early_stop):
    teacher, student = pair
    s, kept = copy.deepcopy(student), {}
    report = normswap.heal(s, teacher, TRAIN, tokenizer=tok, steps=40, eval_every=5, early_stop=early_stop,
                           patience=2, callback=_sabotage_after(10, s, kept), out=tmp_path / "h", **FAST)
    assert report.best_step == 10 and [e[0] for e in report.evals][:3] == [0, 5, 10]
    weights = dict(s.named_parameters())
    same = all(torch.equal(weights[n], v) for n, v in kept.items())
    if early_stop:
        assert same and report.restored_step == 10 and report.stopped_early
        assert report.steps_done == 20 and not report.interrupted  # 2 worse evaluations, then stop
        saved = from_pretrained(tmp_path / "h").state_dict()
        assert all(torch.equal(saved[n], v) for n, v in kept.items())
    else:
        assert not same and report.restored_step is None and report.steps_done == 40
    log = json.loads((tmp_path / "h" / "heal_log.json").read_text())
    assert [r["loss"] for r in log["log_history"] if "loss" in r] == report.losses
    assert [[r["step"], r["eval_kl"]] for r in log["log_history"] if "eval_kl" in r] == [list(e) for e in
                                                                                       report.evals]
    assert log["best_step"] == 10 and log["restored_step"] == report.restored_step
    # a healed folder (heal_log.json included) is normswap's own: --overwrite replaces it
    again = normswap.heal(copy.deepcopy(student), teacher, TRAIN, tokenizer=tok, steps=1, out=tmp_path / "h",
                          overwrite=True, **FAST)
    assert again.saved_to == str(tmp_path / "h") and from_pretrained(tmp_path / "h") is not None


# --- CLI: plot, bad values ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def saved(tok, tmp_path_factory):
    return save_pair(tmp_path_factory.mktemp("track"), tok, TRAIN[0])


def _heal(saved, out, *extra):
    args = ["heal", saved / "conv", "--teacher", saved / "orig", "--data", saved / "train.txt", "--steps", 4,
            "--seq-len", 32, "--batch-size", 4, "-o", out, *extra]
    return CliRunner().invoke(main, [str(a) for a in args])


def test_cli_heal_plots_and_plot_redraws_from_the_folder(saved, tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread
    r = _heal(saved, tmp_path / "h", "--eval-every", 2, "--eval-fraction", 0.2, "--plot", tmp_path / "a.png",
              "--json")
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert [e[0] for e in report["evals"]] == [0, 2, 4] and report["eval_metric"] == "kl"
    assert imread(tmp_path / "a.png").shape[:2] == (528, 880)   # 8 x 4.8 inches at 110 dpi
    r = CliRunner().invoke(main, ["plot", str(tmp_path / "h"), "-o", str(tmp_path / "b.png")])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "b.png").read_bytes() == (tmp_path / "a.png").read_bytes()  # the log holds the curves
    r = CliRunner().invoke(main, ["plot", str(tmp_path / "h"), "-o", str(tmp_path / "b.png")])
    assert r.exit_code == 1 and "exists: pass --overwrite" in r.stderr


@pytest.mark.parametrize("extra, code, needle", [
    (["--report-to", "wandb"], 1, "--report-to wandb: wandb is not installed (pip install wandb)"),
    (["--report-to", "comet"], 1, "unknown tracker 'comet' (--report-to)"),
    (["--eval-every", 2, "--eval-fraction", 0], 1, "--eval-every needs held-out text"),
    (["--eval-every", 2, "--eval-fraction", 0.001], 1, "holds out no window of 32 tokens"),
    (["--early-stop"], 1, "--early-stop needs --eval-every"),
    (["--logging-dir", "logs"], 1, "--logging-dir is used only with --report-to"),
    (["--eval-every", 0], 2, "Invalid value for '--eval-every'"),
    (["--eval-fraction", 1], 2, "Invalid value for '--eval-fraction'"),
    (["--plot", "curves.jpg"], 1, "the plot's file name must end in .png"),
])
def test_cli_bad_values_are_one_line_errors(saved, tmp_path, monkeypatch, extra, code, needle):
    if "wandb" in extra:
        monkeypatch.setitem(sys.modules, "wandb", None)  # not installed, whatever this machine has
        import accelerate.utils.imports as imports
        monkeypatch.setattr(imports, "is_wandb_available", lambda: False)
    r = _heal(saved, tmp_path / "h", *extra)
    assert r.exit_code == code and needle in r.stderr, r.output
    assert r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "h").exists()


def test_plot_errors(saved, tmp_path, monkeypatch):
    r = CliRunner().invoke(main, ["plot", str(saved / "conv"), "-o", str(tmp_path / "x.png")])
    assert r.exit_code == 1 and "has no heal_log.json" in r.stderr
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    r = _heal(saved, tmp_path / "h", "--plot", tmp_path / "p.png")
    assert r.exit_code == 1 and r.stderr == "error: drawing the curves needs matplotlib: pip install matplotlib " \
                                            "(or 'normswap[heal]')\n", r.output
    assert not (tmp_path / "h").exists()
    with pytest.raises(NormswapError, match="needs matplotlib"):
        plot_log({"log_history": []}, tmp_path / "p.png")
