"""heal: Ctrl-C during the final save keeps the finished steps; Ctrl-C during start-up is one line."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.heal_models import save_pair, text
from click.testing import CliRunner

import normswap
import normswap.models.save
from normswap.cli import main
from normswap.healing.loop import heal
from normswap.models.rebuild import from_pretrained
from normswap.models.source import read_config

FAST = dict(seq_len=32, batch_size=4, progress=False)
TRAIN = [text(1500, seed=0)]


@pytest.fixture(scope="module")
def saved(tok, tmp_path_factory):
    return save_pair(tmp_path_factory.mktemp("m"), tok, TRAIN[0])


@pytest.fixture
def ctrl_c_on_first_save(monkeypatch):
    """KeyboardInterrupt from the first save_pretrained call (the final save), real saves after it."""
    real, calls = normswap.models.save.save_pretrained, []

    def save(model, out, *a, **k):
        calls.append(Path(out).name)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real(model, out, *a, **k)
    monkeypatch.setattr(normswap.models.save, "save_pretrained", save)
    return calls


def _state(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_ctrl_c_during_final_save_keeps_every_step_in_partial(saved, tok, tmp_path, ctrl_c_on_first_save):
    teacher, student = normswap.load_model(str(saved / "orig"))[0], from_pretrained(saved / "conv")
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text('{"normswap_heal": {"mine": true}}')   # an earlier output of ours
    before, handler = _state(out), signal.getsignal(signal.SIGINT)
    report = heal(student, teacher, TRAIN, tokenizer=tok, steps=3, train="all", out=out, overwrite=True, **FAST)
    assert ctrl_c_on_first_save == ["out", "out.partial"]
    assert report.steps_done == 3 and report.interrupted and report.save_interrupted
    assert report.saved_to == str(tmp_path / "out.partial") and _state(out) == before
    info = read_config(tmp_path / "out.partial")["normswap_heal"]
    assert info["interrupted"] and info["steps_done"] == info["steps"] == 3
    kept = from_pretrained(tmp_path / "out.partial").state_dict()
    assert all(torch.equal(kept[k], v) for k, v in student.state_dict().items())   # the trained weights
    assert not torch.equal(kept["transformer.h.0.attn.c_attn.weight"],
                           from_pretrained(saved / "conv").state_dict()["transformer.h.0.attn.c_attn.weight"])
    assert signal.getsignal(signal.SIGINT) is handler


def test_cli_ctrl_c_during_final_save_is_one_line_and_130(saved, tmp_path, ctrl_c_on_first_save):
    r = CliRunner().invoke(main, ["heal", str(saved / "conv"), "--teacher", str(saved / "orig"), "--data",
                                  str(saved / "train.txt"), "--steps", "2", "--seq-len", "32", "--batch-size", "4",
                                  "-o", str(tmp_path / "h"), "--json"])
    assert r.exit_code == 130, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "during the final save 2/2 steps: saved to" in lines[0] and "Traceback" not in r.output
    assert (tmp_path / "h.partial" / "config.json").exists() and not (tmp_path / "h").exists()


@pytest.mark.parametrize("where", ["normswap.pipeline.evaluate.load_model", "normswap.pipeline.heal.read_texts",
                                   "accelerate.Accelerator.__init__"])
def test_cli_ctrl_c_during_start_up_is_one_line_and_130(saved, tmp_path, monkeypatch, where):
    def boom(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(where, boom)
    r = CliRunner().invoke(main, ["heal", str(saved / "conv"), "--teacher", str(saved / "orig"), "--data",
                                  str(saved / "train.txt"), "--steps", "2", "-o", str(tmp_path / "h")])
    assert r.exit_code == 130 and r.stderr.strip() == "interrupted: nothing was written", r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == []


# `python -m normswap` as runpy does it (argv[0] is "-m" while the package imports), with a Ctrl-C
# raised from inside `import torch`, before any command runs.
START = """
import builtins, runpy, sys
real = builtins.__import__
def imp(name, *a, **k):
    if name == "torch" and "normswap" in sys.modules:
        raise KeyboardInterrupt
    return real(name, *a, **k)
builtins.__import__ = imp
sys.argv = ["-m", "--help"]
runpy.run_module("normswap", run_name="__main__", alter_sys=True)
"""


@pytest.mark.slow
def test_ctrl_c_while_the_cli_imports_is_one_line():
    root = str(Path(normswap.__file__).parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", START], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and r.stderr.strip() == "interrupted: nothing was written", r.stderr


@pytest.mark.parametrize("users", ["file", "folder"])
def test_cli_ctrl_c_with_a_users_partial_says_the_steps_were_not_saved(saved, tmp_path, ctrl_c_on_first_save, users):
    """Issue 33 (20): OUT.partial is the user's: it is left alone, exit 130, and the line says so."""
    partial = tmp_path / "h.partial"
    if users == "file":
        partial.write_text("mine")
    else:
        partial.mkdir()
        (partial / "notes.txt").write_text("mine")
    r = CliRunner().invoke(main, ["heal", str(saved / "conv"), "--teacher", str(saved / "orig"), "--data",
                                  str(saved / "train.txt"), "--steps", "2", "--seq-len", "32", "--batch-size", "4",
                                  "-o", str(tmp_path / "h")])
    assert r.exit_code == 130, r.output
    assert r.stderr.strip().splitlines() == [
        f"interrupted during the final save 2/2 steps: not saved ({partial} is not an interrupted run's "
        f"checkpoint of normswap's); {tmp_path / 'h'} untouched"]
    assert (partial.read_text() if users == "file" else (partial / "notes.txt").read_text()) == "mine"
    assert not (tmp_path / "h").exists()


def test_cli_signal_during_the_swap_says_out_was_written(saved, tmp_path, monkeypatch):
    """Issue 33 (20): a Ctrl-C held during the final rename is delivered after it: OUT is the healed model, and
    the line says so (not "untouched"); nothing goes to OUT.partial."""
    from normswap.io import rename
    real = rename.fsync_path

    def ctrl_c_at_the_swap(path):
        real(path)
        if path.name == tmp_path.name:   # the parent, right after the rename
            os.kill(os.getpid(), signal.SIGINT)
    monkeypatch.setattr(rename, "fsync_path", ctrl_c_at_the_swap)
    r = CliRunner().invoke(main, ["heal", str(saved / "conv"), "--teacher", str(saved / "orig"), "--data",
                                  str(saved / "train.txt"), "--steps", "2", "--seq-len", "32", "--batch-size", "4",
                                  "-o", str(tmp_path / "h")])
    assert r.exit_code == 130, r.output
    assert r.stderr.strip().splitlines() == [f"interrupted during the final save 2/2 steps: {tmp_path / 'h'} written"]
    assert read_config(tmp_path / "h")["normswap_heal"]["steps_done"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["h"]
