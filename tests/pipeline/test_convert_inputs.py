"""`convert_checkpoint(..., ConvertOptions(example_inputs=...))` and `normswap convert --inputs FILE`: the user's
batches reach the trace and the verification, streamed and in memory alike."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from helpers.cli import one_error_line, run, snapshot
from helpers.exact_models import FAMILIES, perturb
from safetensors.torch import save_file

import normswap
from normswap.errors import NormswapError


@pytest.fixture
def src(tmp_path):
    config_cls, kw, model_cls = FAMILIES["gpt2"]
    torch.manual_seed(0)
    perturb(model_cls(config_cls(vocab_size=101, **kw))).save_pretrained(tmp_path / "src")
    return tmp_path / "src"


@pytest.mark.parametrize("streamed", [True, False])
def test_examples_are_run_and_leave_the_weights_as_without(tmp_path, src, streamed):
    """Same weights with and without examples; examples the model fails on (a token past its vocabulary)
    make the conversion fail, which shows they ran, in the streamed path and in memory."""
    # (allowing missing weights keeps the model in memory)
    o = normswap.ConvertOptions(method="exact", load=normswap.LoadOptions(allow_missing_weights=not streamed))
    plain = normswap.convert(src, tmp_path / "plain", o)
    good = [torch.randint(0, 101, (2, 9)), {"input_ids": torch.randint(0, 101, (1, 3))}]
    with_examples = normswap.convert(src, tmp_path / "ex", replace(o, example_inputs=good))
    assert plain.streamed is with_examples.streamed is streamed
    weights = "model.normswap.safetensors"
    assert snapshot(tmp_path / "plain")[weights] == snapshot(tmp_path / "ex")[weights]
    with pytest.raises(NormswapError, match="IndexError|index out of range"):
        normswap.convert(src, tmp_path / "bad", replace(o, example_inputs=torch.full((1, 4), 5000)))
    assert not (tmp_path / "bad").exists()


def test_cli_inputs_file(tmp_path, src):
    save_file({"0.input_ids": torch.randint(0, 101, (2, 7)), "1.input_ids": torch.randint(0, 101, (1, 30))},
              tmp_path / "in.safetensors")
    ok = run("convert", src, "--to", "rmsnorm", "--method", "exact", "--inputs", tmp_path / "in.safetensors",
             "-o", tmp_path / "out")
    assert ok.exit_code == 0, ok.output
    line = one_error_line(run("convert", src, "--to", "rmsnorm", "--inputs", tmp_path / "none.pt",
                              "-o", tmp_path / "o2"))
    assert "--inputs" in line and "does not exist" in line and not (tmp_path / "o2").exists()
    torch.save({"input_ids": torch.full((1, 3), 999)}, tmp_path / "far.pt")
    line = one_error_line(run("convert", src, "--to", "rmsnorm", "--method", "exact", "--inputs", tmp_path / "far.pt",
                              "-o", tmp_path / "o3"))
    assert "IndexError" in line and not (tmp_path / "o3").exists()


@pytest.mark.parametrize("streamed", [True, False])
def test_a_batch_of_the_users_that_fails_is_called_theirs(tmp_path, src, streamed):
    """Issue 46 #5: examples the model fails on were blamed on "the sample inputs normswap built"."""
    far = [torch.randint(0, 101, (2, 5)), {"input_ids": torch.full((1, 4), 5000)}]
    o = normswap.ConvertOptions(example_inputs=far, load=normswap.LoadOptions(allow_missing_weights=not streamed))
    with pytest.raises(NormswapError) as e:
        normswap.convert(src, tmp_path / "o", o)
    assert str(e.value).startswith("GPT2LMHeadModel fails on your example_inputs batch 1 (IndexError: ")
    assert not (tmp_path / "o").exists()
    torch.save({"input_ids": torch.full((1, 3), 999)}, tmp_path / "far.pt")
    line = one_error_line(run("convert", src, "--to", "rmsnorm", "--inputs", tmp_path / "far.pt", "-o", tmp_path / "o"))
    assert line.startswith("error: GPT2LMHeadModel fails on your --inputs batch 0 (IndexError: ")
