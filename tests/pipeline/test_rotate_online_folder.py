"""A model rotated with online rotations (`normswap rotate --online`) runs code at run time, so it is no longer its
plain architecture: it is saved with the shipped modeling_normswap.py and auto_map (as a converted model is), and
normswap, plain transformers (trust_remote_code=True) and `restore` (a module without a config) all rebuild it with
the rotated model's outputs."""
from __future__ import annotations

import copy
import json

import pytest
import torch
import transformers as tf

import normswap
from helpers.cli import run
from helpers.plain import plain_transformers
from pipeline.test_rotate_plain import llama, rel   # noqa: F401  (the fixture)
from surgery.test_rotate import LinearGPT


def _downs(model) -> list:
    return [layer.mlp.down_proj for layer in model.model.layers]   # the test's knowledge of Llama's names


def test_an_online_rotated_llama_folder_ships_its_code_and_loads_everywhere(llama, tmp_path):   # noqa: F811
    original, src = llama
    out = tmp_path / "rotated"
    result = run("rotate", src, "-o", out, "--heads", "--online", "--seed", 2, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output.strip().splitlines()[-1])["report"]
    assert [o["layer"] for o in report["online"]] == [f"model.layers.{i}.mlp.down_proj" for i in range(2)]
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json",
                                                     "model.normswap.safetensors", "modeling_normswap.py"]
    config = json.loads((out / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_normswap.NormswapLlamaForCausalLM"
    assert config["normswap"]["norms"] == {} and config["normswap"]["rotations"][0]["online"] == \
        [o["layer"] for o in report["online"]]
    assert config["normswap"]["output_fixes"]["model.layers.0.mlp.down_proj"] == {
        "centre": False, "bias": 0, "online": 48, "online_factor": 12}
    ids = torch.randint(3, 61, (2, 13), generator=torch.Generator().manual_seed(5))
    mine = normswap.load(out)[0]
    plain = tf.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    settings = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = original(input_ids=ids).logits
        for loaded in (mine, plain):
            assert rel(loaded(input_ids=ids).logits, want) <= 1e-5
            assert torch.equal(loaded.generate(ids[:1], **settings), original.generate(ids[:1], **settings))
            assert all(set(d.normswap_online_signs.tolist()) == {-1.0, 1.0} for d in _downs(loaded))
    assert "online, before 2 layer(s)" in run("rotate", src, "-o", tmp_path / "text", "--online").output


@pytest.mark.slow   # a child interpreter (NORMSWAP_PLAIN_PYTHON: transformers 4.57 too)
def test_an_online_rotated_llama_folder_loads_where_normswap_cannot_be_imported(llama, tmp_path):   # noqa: F811
    original, src = llama
    out = tmp_path / "rotated"
    normswap.rotate(src, out, online=True, method="random")
    ids = torch.randint(3, 61, (2, 13), generator=torch.Generator().manual_seed(5))
    torch.save([{"input_ids": ids}], tmp_path / "inputs.pt")
    results = plain_transformers(tmp_path, {str(out): str(tmp_path / "inputs.pt")})
    assert results[str(out)]["cls"] == "NormswapLlamaForCausalLM"
    [loaded] = torch.load(f"{out}-plain.pt")
    with torch.no_grad():
        assert rel(loaded["logits"], original(input_ids=ids).logits) <= 1e-5


def test_a_module_without_a_config_restores_its_online_rotations(tmp_path):
    torch.manual_seed(0)
    examples = [torch.randint(0, 61, (2, 16))]
    original = LinearGPT().eval()
    model = copy.deepcopy(original)
    normswap.convert(model, method="exact", example_inputs=examples)
    normswap.rotate(model, online=True, example_inputs=examples)
    normswap.save(model, tmp_path / "m")
    fresh = LinearGPT().eval()
    normswap.restore(fresh, tmp_path / "m")
    y = torch.randint(0, 61, (3, 40))
    with torch.no_grad():
        assert rel(fresh(y), original(y)) < 1e-5
        assert torch.equal(fresh.mlp[0][2].normswap_online_factor, model.mlp[0][2].normswap_online_factor)
