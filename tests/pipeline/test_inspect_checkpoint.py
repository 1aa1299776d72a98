"""`inspect_checkpoint`: the norms of a SRC and what `convert` would do with each, from Python; the CLI prints it."""
from __future__ import annotations

import json

from helpers.cli import run

import normswap
from normswap.pipeline import InspectOptions, inspect_checkpoint
from normswap.surgery.walk import find_norms


def test_inspect_lists_every_norm_with_its_fate(gpt2_dir):
    result = inspect_checkpoint(str(gpt2_dir))
    model, _ = normswap.load(str(gpt2_dir))
    sites, skipped, rms = find_norms(model)
    assert result.model == "GPT2LMHeadModel"
    assert (result.to_convert, result.rms, result.skipped) == (len(sites), 0, 0) and len(sites) == 5
    assert [r["name"] for r in result.norms] == [s.name for s in sites]
    assert result.exact_unavailable is None and all(r["exact"] for r in result.norms)
    assert all(r["action"].startswith("to RMSNorm (exact") for r in result.norms)   # biases kept, exactly
    assert set(result.plans) == {s.name for s in sites}
    first = result.to_text().splitlines()[0]
    assert first == "GPT2LMHeadModel: 5 LayerNorm to convert, 0 RMSNorm, 0 skipped"


def test_inspect_of_a_converted_folder_finds_rmsnorms_only(gpt2_dir, tmp_path):
    normswap.convert(str(gpt2_dir), tmp_path / "conv")
    result = inspect_checkpoint(str(tmp_path / "conv"), InspectOptions(load=normswap.LoadOptions(dtype="fp16")))
    assert (result.to_convert, result.rms) == (0, 5)
    assert {r["action"] for r in result.norms} == {"already RMSNorm: kept"}


def test_the_cli_prints_what_the_function_returns(gpt2_dir):
    r = run("inspect", gpt2_dir, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout) == json.loads(json.dumps(inspect_checkpoint(str(gpt2_dir)).to_dict()))
    text = run("inspect", gpt2_dir)
    assert text.stdout.strip() == inspect_checkpoint(str(gpt2_dir)).to_text()


def test_inspect_takes_device_as_every_loading_command_does(gpt2_dir):
    """Issue 33 #10: `inspect` had no --device (the README said every command takes it)."""
    result = run("inspect", gpt2_dir, "--device", "cpu", "--json")
    assert result.exit_code == 0, result.output
    assert len(json.loads(result.stdout)["norms"]) == 5
    bad = run("inspect", gpt2_dir, "--device", "tpu")
    assert bad.exit_code == 1 and bad.output.strip() == "error: unknown device 'tpu': use auto, cpu, cuda or cuda:N"
