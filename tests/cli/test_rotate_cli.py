"""`normswap rotate`: a rotated folder reloads in normswap and in plain transformers with the original's
outputs; every bad input is one line and a non-zero exit, and nothing on disk is lost."""
from __future__ import annotations

import json

import pytest
import torch
import transformers as tf

import normswap
from normswap.parity import compare
from helpers.cli import one_error_line, run, snapshot
from helpers.exact_models import build, padded_batches


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(the original model, its folder, the folder of its exact conversion)."""
    root = tmp_path_factory.mktemp("rotate")
    original = build("gpt2")
    original.save_pretrained(root / "src")
    normswap.convert(str(root / "src"), root / "conv", normswap.ConvertOptions(method="exact"))
    return original, root / "src", root / "conv"


def test_rotated_folder_reloads_with_the_originals_outputs(folders, tmp_path):
    original, _, conv = folders
    result = run("rotate", conv, "-o", tmp_path / "r", "--seed", 7, "--method", "random", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output.strip().splitlines()[-1])["report"]
    assert report["seed"] == 7 and report["untied"] == ["lm_head.weight"]
    assert report["streams"][0]["q"] == "random orthogonal" and report["verification"]["max_rel"] < 1e-4
    mine = normswap.load(tmp_path / "r")[0]
    plain = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "r", trust_remote_code=True).eval()
    for loaded in (mine, plain):
        assert compare(original, loaded, padded_batches()).max_rel < 1e-5
        assert loaded.lm_head.weight is not loaded.transformer.wte.weight   # untied on disk too
    # really rotated: the stored embedding is not the converted one
    converted = normswap.load(conv)[0]
    assert not torch.allclose(converted.transformer.wte.weight, mine.transformer.wte.weight, atol=1e-3)
    assert json.loads((tmp_path / "r" / "config.json").read_text())["normswap"]["rotations"][0]["seed"] == 7


def test_an_unconverted_source_is_one_line_and_writes_nothing(folders, tmp_path):
    _, src, _ = folders
    line = one_error_line(run("rotate", src, "-o", tmp_path / "r"))
    assert "is a LayerNorm: convert the model exactly to RMSNorm first" in line
    assert not (tmp_path / "r").exists()


def test_bad_inputs_are_one_line_and_nothing_is_lost(folders, tmp_path):
    _, _, conv = folders
    (tmp_path / "keep").mkdir()
    (tmp_path / "keep" / "mine.txt").write_text("mine")
    before = snapshot(tmp_path / "keep")
    assert "exists" in one_error_line(run("rotate", conv, "-o", tmp_path / "keep"))
    assert snapshot(tmp_path / "keep") == before
    assert "'givens' is not one of" in one_error_line(run("rotate", conv, "-o", tmp_path / "x", "--method",
                                                          "givens"), code=2)
    assert "no such folder" in one_error_line(run("rotate", tmp_path / "nope", "-o", tmp_path / "x"))
    assert "--seed" in one_error_line(run("rotate", conv, "-o", tmp_path / "x", "--seed", "two"), code=2)
    assert not (tmp_path / "x").exists()


# ---- `normswap convert --method exact --rotate`: one run, one atomic output -------------------------------

def test_convert_rotate_writes_a_rotated_folder_with_the_originals_outputs(folders, tmp_path):
    original, src, conv = folders
    result = run("convert", src, "--to", "rmsnorm", "--method", "exact", "--rotate", "--rotate-method", "random",
                 "--seed", 3, "--device", "cpu", "-o", tmp_path / "r", "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.output.strip().splitlines()[-1])
    rotation = out["rotation"]
    assert rotation["method"] == "random" and rotation["seed"] == 3 and rotation["untied"] == ["lm_head.weight"]
    assert rotation["streams"][0]["q"] == "random orthogonal" and rotation["verification"]["max_rel"] < 1e-4
    assert out["parity"]["max_rel"] < 1e-4   # the rotated model against the original
    section = json.loads((tmp_path / "r" / "config.json").read_text())["normswap"]
    assert section["rotations"] == [{"method": "random", "seed": 3, "widths": [32], "untied": ["lm_head.weight"],
                                     "unrotated": []}]
    rotated = normswap.load(tmp_path / "r")[0]
    assert compare(original, rotated, padded_batches()).max_rel < 1e-5
    plain = normswap.load(conv)[0]   # the same conversion, not rotated: other weights
    assert not torch.allclose(plain.transformer.h[0].mlp.c_fc.weight, rotated.transformer.h[0].mlp.c_fc.weight,
                              atol=1e-3)


def test_convert_rotate_heads_and_online_as_rotate_does(folders, tmp_path):
    """`convert --rotate --rotate-heads --rotate-online` does in one run what `rotate --heads --online` does."""
    original, src, _ = folders
    result = run("convert", src, "--to", "rmsnorm", "--method", "exact", "--rotate", "--rotate-heads",
                 "--rotate-online", "-o", tmp_path / "r", "--json")
    assert result.exit_code == 0, result.output
    rotation = json.loads(result.output.strip().splitlines()[-1])["rotation"]
    skip = rotation["not_preserved"]   # the cache, stored rotated per head (generation unchanged)
    assert set(skip) == {"cache", "hidden_states"} and len(rotation["heads"]["pairs"]) == 2
    assert [r["layer"] for r in rotation["online"]] == [f"transformer.h.{i}.mlp.c_proj" for i in range(2)]
    for loaded in (normswap.load(tmp_path / "r")[0],
                   tf.AutoModelForCausalLM.from_pretrained(tmp_path / "r", trust_remote_code=True).eval()):
        assert compare(original, loaded, padded_batches(), skip=skip).max_rel < 1e-5
    line = one_error_line(run("convert", src, "--to", "rmsnorm", "--rotate-online", "-o", tmp_path / "x"))
    assert "--rotate-online is used only with --rotate" in line and not (tmp_path / "x").exists()

def test_convert_rotate_text_report_names_the_rotation(folders, tmp_path):
    _, src, _ = folders
    result = run("convert", src, "--to", "rmsnorm", "--method", "exact", "--rotate", "-o", tmp_path / "r")
    assert result.exit_code == 0, result.output
    assert "rotated 1 stream(s) (hadamard, seed 0):" in result.output and "randomised Hadamard" in result.output


def test_convert_rotate_refusals_are_one_line_and_write_nothing(folders, tmp_path, monkeypatch):
    _, src, _ = folders
    out = tmp_path / "x"
    assert "--rotate needs --method exact" in one_error_line(run("convert", src, "--to", "rmsnorm", "--rotate",
                                                                 "-o", out))
    assert "--rotate needs --to rmsnorm" in one_error_line(run("convert", src, "--to", "prmsnorm", "--method",
                                                               "exact", "--rotate", "-o", out))
    assert "--rotate-method is used only with --rotate" in one_error_line(
        run("convert", src, "--to", "rmsnorm", "--rotate-method", "random", "-o", out))
    assert "--seed is used only with --rotate" in one_error_line(run("convert", src, "--to", "rmsnorm", "--seed", 1,
                                                                     "-o", out))
    from normswap.surgery import rotate as rotate_module

    def refuse(*args):   # a model the exact conversion keeps but the rotation refuses, after converting it
        raise rotate_module.NotRotatable("probe (Linear) reads the unnormalised stream")
    monkeypatch.setattr(rotate_module, "find_streams", refuse)
    line = one_error_line(run("convert", src, "--to", "rmsnorm", "--method", "exact", "--rotate", "-o", out))
    assert "probe (Linear) reads the unnormalised stream" in line
    assert not out.exists() and list(tmp_path.iterdir()) == []   # no temp folder left
