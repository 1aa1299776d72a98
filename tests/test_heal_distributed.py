"""Healing on 2 CPU processes (Accelerate, gloo) follows the 1-process loss curve with the same global batch."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch
from _heal_models import save_pair, text, tokenizer

import normswap
from normswap.io import from_pretrained

ACCELERATE = shutil.which("accelerate", path=os.path.dirname(sys.executable))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return save_pair(tmp_path_factory.mktemp("dist"), tokenizer(), text(3000, seed=0))


def _heal(d, out, launcher: list[str]) -> dict:
    args = ["-m", "normswap", "heal", d / "conv", "--teacher", d / "orig", "--data", d / "train.txt",
            "--steps", 6, "--seq-len", 32, "--batch-size", 4, "--train", "all", "-o", out, "--json"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run([*launcher, *map(str, args)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert len(lines) == 1, r.stdout  # one report, from rank 0
    return json.loads(lines[0])


@pytest.mark.skipif(ACCELERATE is None, reason="accelerate CLI not installed")
def test_two_processes_follow_the_one_process_curve(folders, tmp_path):
    one = _heal(folders, tmp_path / "one", [sys.executable])
    launch = [ACCELERATE, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
              "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(_free_port())]
    two = _heal(folders, tmp_path / "two", launch)
    assert one["steps_done"] == two["steps_done"] == 6 and two["batch_size"] == 4
    a, b = torch.tensor(one["losses"], dtype=torch.float64), torch.tensor(two["losses"], dtype=torch.float64)
    assert a[-1] < a[0]  # it trained
    assert torch.allclose(a, b, rtol=1e-4, atol=0), (a, b)
    sa, sb = from_pretrained(tmp_path / "one").state_dict(), from_pretrained(tmp_path / "two").state_dict()
    worst = max(((sa[k].double() - sb[k].double()).abs().max() / sa[k].double().abs().max().clamp_min(1e-12)).item()
                for k in sa)
    assert worst < 1e-4, worst
    # a different global batch gives a visibly different curve: the comparison above can fail
    other = _heal_batch(folders, tmp_path / "b2")
    assert not torch.allclose(a, torch.tensor(other["losses"], dtype=torch.float64), rtol=1e-3)


def _heal_batch(d, out):
    args = ["-m", "normswap", "heal", d / "conv", "--teacher", d / "orig", "--data", d / "train.txt",
            "--steps", 6, "--seq-len", 32, "--batch-size", 2, "--train", "all", "-o", out, "--json"]
    r = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.splitlines()[-1])


def test_global_batch_must_split_evenly(folders, tmp_path):
    launch = [ACCELERATE, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
              "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(_free_port())]
    args = ["-m", "normswap", "heal", folders / "conv", "--teacher", folders / "orig", "--data",
            folders / "train.txt", "--steps", 2, "--batch-size", 3, "-o", tmp_path / "x"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run([*launch, *map(str, args)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode != 0 and "divisible by the 2 processes" in r.stderr
    assert not (tmp_path / "x").exists()
