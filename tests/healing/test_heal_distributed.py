"""Healing on 2 CPU processes (Accelerate, gloo) follows the 1-process loss curve with the same global batch:
DDP, and FSDP2 (the student sharded with fully_shard) launched with examples/accelerate_fsdp.yaml."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.heal_models import save_pair, text, tokenizer

import normswap
from normswap.models.rebuild import from_pretrained
from normswap.folder.checksum import raw_header

from helpers.folders import same_fingerprint, split_config

pytestmark = pytest.mark.slow   # each test launches processes (accelerate) that import torch and train


ACCELERATE = shutil.which("accelerate", path=os.path.dirname(sys.executable))
FSDP_CONFIG = Path(__file__).parents[2] / "examples" / "accelerate_fsdp.yaml"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return save_pair(tmp_path_factory.mktemp("dist"), tokenizer(), text(3000, seed=0))


@pytest.fixture(scope="module")
def one(folders):
    """The 1-process reference run (report), saved to folders / "one"."""
    return _heal(folders, folders / "one", [sys.executable])


@pytest.fixture(scope="module")
def one_norms(folders):
    return _heal(folders, folders / "one-norms", [sys.executable], train="norms")


def _heal(d, out, launcher: list[str], train: str = "all", extra: tuple = ()) -> dict:
    args = ["-m", "normswap", "heal", d / "conv", "--teacher", d / "orig", "--data", d / "train.txt",
            "--steps", 6, "--seq-len", 32, "--batch-size", 4, "--train", train, "-o", out, "--json", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run([*launcher, *map(str, args)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert len(lines) == 1, r.stdout  # one report, from rank 0
    return json.loads(lines[0])


@pytest.mark.skipif(ACCELERATE is None, reason="accelerate CLI not installed")
def test_two_processes_follow_the_one_process_curve(folders, one, tmp_path):
    launch = [ACCELERATE, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
              "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(_free_port())]
    two = _heal(folders, tmp_path / "two", launch)
    assert one["steps_done"] == two["steps_done"] == 6 and two["batch_size"] == 4
    a, b = torch.tensor(one["losses"], dtype=torch.float64), torch.tensor(two["losses"], dtype=torch.float64)
    assert a[-1] < a[0]  # it trained
    assert torch.allclose(a, b, rtol=1e-4, atol=0), (a, b)
    assert one["parallel"] == "none" and two["parallel"] == "ddp" and two["processes"] == 2
    sa, sb = from_pretrained(folders / "one").state_dict(), from_pretrained(tmp_path / "two").state_dict()
    worst = max(((sa[k].double() - sb[k].double()).abs().max() / sa[k].double().abs().max().clamp_min(1e-12)).item()
                for k in sa)
    assert worst < 1e-4, worst
    # a different global batch gives a visibly different curve: the comparison above can fail
    other = _heal_batch(folders, tmp_path / "b2")
    assert not torch.allclose(a, torch.tensor(other["losses"], dtype=torch.float64), rtol=1e-3)


@pytest.mark.skipif(ACCELERATE is None, reason="accelerate CLI not installed")
@pytest.mark.parametrize("train", ["all", "norms"])  # norms: frozen parameters inside the FSDP units
def test_fsdp_shards_and_follows_the_one_process_curve(folders, train, request, tmp_path):
    one = request.getfixturevalue("one" if train == "all" else "one_norms")
    launch = [ACCELERATE, "launch", "--config_file", str(FSDP_CONFIG), "--num_processes", "2",
              "--main_process_port", str(_free_port())]
    two = _heal(folders, tmp_path / "fsdp", launch, train)
    # sharded for real (not Accelerate's silent DDP on CPU): the 2 GPT-2 blocks and the root, all DTensors
    assert (two["parallel"], two["processes"], two["fsdp_units"]) == ("fsdp", 2, 3), two
    assert two["steps_done"] == 6 and two["trainable"] == one["trainable"]
    a, b = torch.tensor(one["losses"], dtype=torch.float64), torch.tensor(two["losses"], dtype=torch.float64)
    assert torch.allclose(a, b, rtol=1e-5, atol=0), (a, b)
    d1, d2 = folders / ("one" if train == "all" else "one-norms"), tmp_path / "fsdp"
    sa, sb = from_pretrained(d1).state_dict(), from_pretrained(d2).state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.allclose(sa[k], sb[k], rtol=1e-5, atol=1e-6), (k, (sa[k] - sb[k]).abs().max())
    # the same folder as a 1-process heal: files, config (normswap sections included), tensor layout
    assert sorted(p.name for p in d1.iterdir()) == sorted(p.name for p in d2.iterdir())
    (c1, f1), (c2, f2) = split_config(d1), split_config(d2)   # the digests of two equal models: within tolerance
    assert c1 == c2
    same_fingerprint(f1, f2)
    assert raw_header(d1 / "model.normswap.safetensors") == raw_header(d2 / "model.normswap.safetensors")
    conv = from_pretrained(folders / "conv").state_dict()
    changed = {k for k in sb if not torch.equal(sb[k], conv[k])}  # it trained, and only what it was asked to
    assert changed == ({k for k in sb if ".ln_" in k} if train == "norms" else set(sb)), changed


# LoRA with held-out evaluation: the evaluation is reduced over the processes (the value one process gets).
# FSDP also stops early: at lr 0.05 the step-2 evaluation is far worse than step 0's, so the weights of step 0
# must come back into the shards (DTensors) before they are gathered and the adapters merged.
LORA = {"ddp": ("--lora-rank", 2, "--eval-every", 3, "--eval-fraction", 0.2),
        "fsdp": ("--lora-rank", 2, "--eval-every", 2, "--eval-fraction", 0.2, "--early-stop", "--patience", 1,
                 "--lr", 0.05)}


@pytest.mark.skipif(ACCELERATE is None, reason="accelerate CLI not installed")
@pytest.mark.parametrize("how", ["ddp", "fsdp"])
def test_lora_on_two_processes_follows_one(folders, how, tmp_path):
    pytest.importorskip("peft")
    one = _heal(folders, tmp_path / "one", [sys.executable], "lora", LORA[how])
    launch = [ACCELERATE, "launch", "--num_processes", "2", "--main_process_port", str(_free_port()), *(
        ["--config_file", str(FSDP_CONFIG)] if how == "fsdp" else
        ["--multi_gpu", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"])]
    two = _heal(folders, tmp_path / "two", launch, "lora", LORA[how])
    assert two["parallel"] == how and two["trainable"] == one["trainable"]
    for key in ("losses", "evals"):
        a, b = torch.tensor(one[key], dtype=torch.float64), torch.tensor(two[key], dtype=torch.float64)
        assert torch.allclose(a, b, rtol=1e-5, atol=0), (key, a, b)
    sa, sb = from_pretrained(tmp_path / "one").state_dict(), from_pretrained(tmp_path / "two").state_dict()
    assert sa.keys() == sb.keys() and not any("lora" in k for k in sb)
    for k in sa:
        assert torch.allclose(sa[k], sb[k], rtol=1e-5, atol=1e-6), (k, (sa[k] - sb[k]).abs().max())
    conv = from_pretrained(folders / "conv").state_dict()
    if how == "ddp":  # trained: the adapters' targets and the norm gains changed
        assert two["steps_done"] == 6 and [e[0] for e in two["evals"]] == [0, 3, 6]
        assert {k for k in sb if not torch.equal(sb[k], conv[k])} == {
            k for k in sb if k.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")) or ".ln_" in k}
    else:  # stopped at step 2, step 0's weights back: the converted model as it was
        assert (two["steps_done"], two["best_step"], two["restored_step"]) == (2, 0, 0), two
        assert all(torch.equal(sb[k], conv[k]) for k in sb)


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


def test_fsdp_needs_several_processes(folders, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from normswap.cli import main
    args = [folders / "conv", "--teacher", folders / "orig", "--data", folders / "train.txt", "--steps", 1,
            "-o", tmp_path / "x"]
    r = CliRunner().invoke(main, ["heal", *map(str, args), "--fsdp"])
    assert r.exit_code == 1 and r.stderr.startswith("error: FSDP shards the model over processes"), r.output
    assert len(r.stderr.strip().splitlines()) == 1
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # what an FSDP config sets, here with 1 process
    r = CliRunner().invoke(main, ["heal", *map(str, args)])
    assert r.exit_code == 1 and "launch 2 or more" in r.stderr, r.output
    assert not (tmp_path / "x").exists()


def test_fsdp_units():
    from transformers import BertConfig, BertForMaskedLM

    from helpers.heal_models import gpt2
    from normswap.healing.fsdp import blocks
    g = gpt2(160)
    assert blocks(g) == list(g.transformer.h)  # GPT-2's _no_split_modules: GPT2Block
    # no _no_split_modules: the largest ModuleList; the embeddings, tied to the MLM head, are no unit of their own
    m = BertForMaskedLM(BertConfig(vocab_size=160, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
                                   intermediate_size=64, max_position_embeddings=64))
    assert m.cls.predictions.decoder.weight is m.bert.embeddings.word_embeddings.weight
    assert blocks(m) == list(m.bert.encoder.layer)
    m._no_split_modules = ["BertEmbeddings", "BertLayer"]
    assert blocks(m) == list(m.bert.encoder.layer)
    with pytest.raises(normswap.NormswapError, match="no list of transformer blocks"):
        blocks(torch.nn.Sequential(torch.nn.Linear(2, 2)))
