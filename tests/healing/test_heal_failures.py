"""Issue 20: heal never saves a NaN model (lr validated, divergence detected), never replaces what it reads
(resuming from OUT.partial), writes OUT.partial beside OUT/ (trailing slash), and signals before or after
the first step end in one line with 130 (Ctrl-C) or 143 (SIGTERM)."""
from __future__ import annotations

import json
import math
import os
import signal

import pytest
import torch
from click.testing import CliRunner
from helpers.cli import snapshot
from helpers.heal_models import save_pair, text, tokenizer

import normswap
import normswap.healing.loop as loop
from normswap.cli import main
from normswap.errors import NormswapError
from normswap.models.rebuild import from_pretrained
from normswap.models.source import read_config

TRAIN = [text(1500, seed=0)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return save_pair(tmp_path_factory.mktemp("m"), tokenizer(), TRAIN[0])


def heal_cli(saved, out, *extra, src=None):
    return CliRunner().invoke(main, ["heal", str(src or saved / "conv"), "--teacher", str(saved / "orig"), "--data",
                                     str(saved / "train.txt"), "--seq-len", "32", "--batch-size", "4",
                                     "-o", str(out), *extra])


@pytest.fixture
def signals_in_first_loss(monkeypatch):
    """signals_in_first_loss(sig, n): the first loss computation receives `n` signals `sig`."""
    real = loop.window_losses
    plan = {"sig": None, "n": 0, "calls": 0}

    def loss(*a, **k):
        plan["calls"] += 1
        if plan["calls"] == 1:
            for _ in range(plan["n"]):
                os.kill(os.getpid(), plan["sig"])
        return real(*a, **k)
    monkeypatch.setattr(loop, "window_losses", loss)

    def arm(sig, n):
        plan.update(sig=sig, n=n, calls=0)
    return arm


@pytest.mark.parametrize("lr", ["inf", "nan", "-inf"])
def test_non_finite_lr_is_refused_before_anything(saved, tmp_path, lr):
    r = heal_cli(saved, tmp_path / "h", "--steps", "2", "--lr", lr)
    lines = r.output.strip().splitlines()
    assert r.exit_code in (1, 2) and len(lines) == 1 and "--lr" in lines[0], r.output
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(NormswapError, match="lr must be a finite number > 0"):
        loop.heal(from_pretrained(saved / "conv"), None, TRAIN, tokenizer=tokenizer(), steps=1,
                  objective="lm", lr=float(lr))


@pytest.mark.parametrize("extra", [["--lr", "1e30"], ["--lr", "1e12", "--train", "all"]])
def test_diverged_training_saves_nothing_and_json_stays_valid(saved, tmp_path, extra):
    r = heal_cli(saved, tmp_path / "h", "--steps", "6", "--json", *extra)
    assert r.exit_code == 1, r.output
    assert r.stdout == "" and r.stderr.startswith("error: training diverged") and "--lr" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_two_signals_before_the_first_step_are_one_line(saved, tmp_path, signals_in_first_loss, sig, code):
    signals_in_first_loss(sig, 2)
    r = heal_cli(saved, tmp_path / "h", "--steps", "3")
    assert r.exit_code == code, r.output
    assert r.stderr.strip() == f"interrupted after 0/3 steps: nothing saved; {tmp_path / 'h'} untouched"
    assert "no step finished" in r.stdout and list(tmp_path.iterdir()) == []


def test_sigterm_after_a_step_saves_the_partial_and_exits_143(saved, tmp_path, signals_in_first_loss):
    signals_in_first_loss(signal.SIGTERM, 1)   # stop after the step it lands in
    r = heal_cli(saved, tmp_path / "h", "--steps", "3", "--json")
    assert r.exit_code == 143, r.output
    report = json.loads(r.stdout)
    assert report["steps_done"] == 1 and report["signum"] == 15 and math.isfinite(report["loss_last"])
    assert read_config(tmp_path / "h.partial")["normswap_heal"]["steps_done"] == 1
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_resuming_from_out_partial_never_replaces_it(saved, tmp_path, signals_in_first_loss):
    signals_in_first_loss(signal.SIGINT, 1)
    out = tmp_path / "h"
    assert heal_cli(saved, out, "--steps", "3").exit_code == 130   # h.partial: 1 step
    before = snapshot(tmp_path / "h.partial")
    signals_in_first_loss(signal.SIGINT, 1)
    r = heal_cli(saved, out, "--steps", "3", src=tmp_path / "h.partial")   # resume, interrupted again
    assert r.exit_code == 130 and f"saved to {tmp_path / 'h.partial-2'}" in r.stderr, r.output
    assert snapshot(tmp_path / "h.partial") == before
    resumed = from_pretrained(tmp_path / "h.partial-2").state_dict()
    first = from_pretrained(tmp_path / "h.partial").state_dict()
    assert any(not torch.equal(resumed[k], first[k]) for k in first)   # it trained on from the partial
    assert sorted(p.name for p in tmp_path.iterdir()) == ["h.partial", "h.partial-2"]


def test_out_with_a_trailing_slash_saves_the_partial_beside_it(saved, tmp_path, signals_in_first_loss):
    signals_in_first_loss(signal.SIGINT, 1)
    r = heal_cli(saved, f"{tmp_path / 'h'}/", "--steps", "3")
    assert r.exit_code == 130 and f"saved to {tmp_path / 'h.partial'};" in r.stderr, r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["h.partial"]


def test_library_heal_partial_path_is_beside_out():
    assert loop.partial_path("a/b/") == loop.partial_path("a/b") == normswap.healing.loop.Path("a/b.partial")


def test_sigterm_while_convert_heals_exits_143_with_nothing_written(saved, tmp_path, signals_in_first_loss):
    signals_in_first_loss(signal.SIGTERM, 1)
    r = CliRunner().invoke(main, ["convert", str(saved / "orig"), "--to", "rmsnorm", "--method", "naive",
                                  "--finetune-steps", "3", "--data", str(saved / "train.txt"), "-o",
                                  str(tmp_path / "c")])
    assert r.exit_code == 143 and r.stderr.strip() == "interrupted: nothing was written", r.output
    assert list(tmp_path.iterdir()) == []


def test_a_teacher_of_another_kind_is_one_line_error(saved, tmp_path):
    """Issue 46 #5: a teacher that is not a causal LM failed with AttributeError on `.logits` (a headless one) or
    on `.dtype` (an image model fed token ids)."""
    from transformers import GPT2Config, GPT2Model
    from helpers.tiny import tiny_model
    GPT2Model(GPT2Config.from_pretrained(saved / "orig")).save_pretrained(tmp_path / "headless")
    tiny_model("vit").save_pretrained(tmp_path / "vit")
    cases = {"headless": "the student gives logits and the teacher none (a model without its head)",
             "vit": "the teacher (ViTModel) reads pixel_values, the student (GPT2LMHeadModel) input_ids"}
    for teacher, message in cases.items():
        r = CliRunner().invoke(main, ["heal", str(saved / "conv"), "--teacher", str(tmp_path / teacher), "--data",
                                      str(saved / "train.txt"), "--steps", "1", "-o", str(tmp_path / "o")])
        assert r.exit_code == 1 and r.stderr.strip().splitlines()[-1].startswith(f"error: {message}"), r.output
    assert not (tmp_path / "o").exists()
    student, tok = from_pretrained(saved / "conv"), tokenizer()
    with pytest.raises(NormswapError, match=r"the teacher \(ViTModel\) reads pixel_values"):
        normswap.heal(student, tiny_model("vit"), TRAIN, tokenizer=tok, steps=1)
