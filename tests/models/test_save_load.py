"""save_pretrained / from_pretrained: bit-exact round trips, safetensors only, atomic writes."""
import json

import pytest
import safetensors.torch
import torch

import normswap
import normswap.io.safetensors
from normswap.errors import NormswapError
from normswap.models.inputs import sample_inputs

from helpers.tiny import tiny_model


def outputs(model):
    out = model(**sample_inputs(model)[-1])
    return out.logits if hasattr(out, "logits") and out.logits is not None else out.last_hidden_state


@pytest.mark.parametrize("family,to", [("gpt2", "rmsnorm"), ("opt", "prmsnorm"), ("bert", "rmsnorm"),
                                       ("vit", "rmsnorm"), ("gpt_neox", "rmsnorm")])
def test_round_trip_is_bit_exact(tmp_path, family, to):
    model = tiny_model(family)
    normswap.convert(model, method="naive", to=to)
    expected = outputs(model)
    normswap.save_pretrained(model, tmp_path / "m")
    loaded = normswap.from_pretrained(tmp_path / "m")
    assert torch.equal(outputs(loaded), expected)
    assert loaded.config.normswap == json.loads(json.dumps(model.config.normswap))
    state, loaded_state = model.state_dict(), loaded.state_dict()
    assert state.keys() == loaded_state.keys()
    assert all(torch.equal(state[k], loaded_state[k]) for k in state)


def test_layout_is_safetensors_with_normswap_section(tmp_path):
    model = tiny_model("gpt2")
    normswap.convert(model, method="naive", to="rmsnorm")
    normswap.save_pretrained(model, tmp_path / "m")
    files = sorted(p.name for p in (tmp_path / "m").iterdir())
    assert "model.normswap.safetensors" in files and "config.json" in files
    assert not [f for f in files if f.endswith((".bin", ".pt", ".pth", ".pkl"))]
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["architectures"] == ["NormswapGPT2LMHeadModel"]  # the generated class (tests/folder/test_modeling.py)
    assert config["normswap"]["base"]["architecture"] == "GPT2LMHeadModel"
    assert set(config["normswap"]["norms"]) == {f"transformer.h.{i}.ln_{j}" for i in (0, 1) for j in (1, 2)} | {
        "transformer.ln_f"}
    assert config["normswap"]["conversions"][0]["method"] == "naive"
    # The tied LM head is stored once and comes back tied.
    keys = safetensors.torch.load_file(tmp_path / "m" / "model.normswap.safetensors").keys()
    assert ("lm_head.weight" in keys) != ("transformer.wte.weight" in keys)
    loaded = normswap.from_pretrained(tmp_path / "m")
    assert loaded.lm_head.weight is loaded.transformer.wte.weight


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_round_trip_half_precision(tmp_path, dtype):
    model = tiny_model("gpt2", dtype=dtype)
    normswap.convert(model, method="naive", to="rmsnorm")
    normswap.save_pretrained(model, tmp_path / "m")
    loaded = normswap.from_pretrained(tmp_path / "m")
    assert loaded.transformer.ln_f.weight.dtype == dtype
    assert torch.equal(outputs(loaded), outputs(model))


def test_existing_output_needs_overwrite_and_is_kept(tmp_path):
    out = tmp_path / "m"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    model = tiny_model("gpt2")
    normswap.convert(model, method="naive", to="rmsnorm")
    with pytest.raises(NormswapError, match="exists: pass overwrite=True"):
        normswap.save_pretrained(model, out)
    assert (out / "keep.txt").read_text() == "precious"
    with pytest.raises(NormswapError, match="not written by normswap"):  # not ours: needs "any"
        normswap.save_pretrained(model, out, overwrite=True)
    normswap.save_pretrained(model, out, overwrite="any")
    assert not (out / "keep.txt").exists() and (out / "model.normswap.safetensors").exists()


def test_failed_save_leaves_old_output_and_no_temp(tmp_path, monkeypatch):
    out = tmp_path / "m"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    model = tiny_model("gpt2")
    normswap.convert(model, method="naive", to="rmsnorm")

    def broken(*a, **k):
        raise OSError("disk full")
    monkeypatch.setattr(normswap.io.safetensors, "save_model", broken)
    with pytest.raises(OSError, match="disk full"):
        normswap.save_pretrained(model, out, overwrite="any")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]
    assert (out / "keep.txt").read_text() == "precious"


def test_from_pretrained_refuses_plain_hf_folder(tmp_path):
    model = tiny_model("gpt2")
    model.save_pretrained(tmp_path / "plain")
    with pytest.raises(NormswapError, match="not saved by normswap"):
        normswap.from_pretrained(tmp_path / "plain")


def test_load_model_reads_plain_hf_folder_as_causal_lm(tmp_path):
    model = tiny_model("gpt2")
    model.save_pretrained(tmp_path / "plain")
    loaded, tokenizer = normswap.load_model(str(tmp_path / "plain"))
    assert type(loaded).__name__ == "GPT2LMHeadModel" and tokenizer is None
    assert torch.equal(outputs(loaded), outputs(model))


def test_load_model_encoder_as_automodel(tmp_path):
    tiny_model("bert").save_pretrained(tmp_path / "bert")
    loaded, _ = normswap.load_model(str(tmp_path / "bert"))
    assert type(loaded).__name__ == "BertModel"
