"""Issue 46: the ways users save and load a converted model by hand. transformers' own `save_pretrained` (and
Trainer's checkpoints, a pickled model) writes a complete, self-verifying folder; the original class, a state
dict or safetensors' own loader either work or fail loudly: none returns a different model quietly."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import safetensors.torch
import torch
import transformers as tf

import normswap
from normswap.errors import NormswapError
from normswap.folder.portable import InvalidConversion

from helpers.exact_models import perturb

IDS = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])


@pytest.fixture(scope="module")
def demo():
    """The demo model, its logits before converting, and the converted model (in place)."""
    model, tokenizer = normswap.load_model("normswap-demo")
    with torch.no_grad():
        want = model(IDS).logits
    normswap.convert(model, method="exact")
    return model, tokenizer, want


def rel(a, b) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def test_transformers_own_save_writes_a_folder_every_loader_reads_as_the_converted_model(demo, tmp_path):
    model, tokenizer, want = demo
    assert type(model).__name__ == "NormswapGPT2LMHeadModel" and isinstance(model, tf.GPT2LMHeadModel)
    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["model_type"] == "normswap_gpt2" and config["normswap"]["format"] == 4
    assert "outputs" in config["normswap"]["fingerprint"] and "auto_map" in config
    with torch.no_grad():
        assert rel(normswap.from_pretrained(tmp_path / "m")(IDS).logits, want) < 1e-5
        plain = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "m", trust_remote_code=True)
        assert rel(plain(IDS).logits, want) < 1e-5
    with pytest.raises(ValueError):   # plain transformers without the folder's code: refused, not the original
        tf.AutoModelForCausalLM.from_pretrained(tmp_path / "m")


def test_the_original_class_a_state_dict_and_safetensors_fail_loudly(demo, tmp_path):
    model, _, _ = demo
    model.save_pretrained(tmp_path / "m")
    with pytest.raises(OSError, match="no file named model.safetensors"):   # the weights are the "normswap" variant
        tf.GPT2LMHeadModel.from_pretrained(tmp_path / "m")
    fresh = tf.GPT2LMHeadModel(tf.GPT2Config.from_dict(model.config.to_dict()))
    with pytest.raises(RuntimeError, match="Missing key|Unexpected key"):
        fresh.load_state_dict(model.state_dict())
    with pytest.raises(RuntimeError, match="Missing key|Unexpected key"):
        safetensors.torch.load_model(fresh, tmp_path / "m" / "model.normswap.safetensors")


def olmo() -> torch.nn.Module:
    config = tf.OlmoConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=64, max_position_embeddings=64, pad_token_id=1)
    torch.manual_seed(0)
    return perturb(tf.OlmoForCausalLM(config)).eval()


def test_a_state_dict_of_the_same_names_loads_as_the_same_function():
    """OLMo's norms have no parameters, so its converted state dict has the original's names and shapes:
    loaded into the original class it gives the original's logits (LayerNorm ignores the centring the
    conversion folded into the writers), not a different model."""
    model = olmo()
    with torch.no_grad():
        want = model(IDS).logits
    normswap.convert(model, method="exact")
    fresh = olmo()
    fresh.load_state_dict(model.state_dict(), strict=True)
    with torch.no_grad():
        assert rel(fresh(IDS).logits, want) < 1e-5


def test_the_original_weights_copied_over_a_resaved_folder_are_refused(tmp_path):
    """The hostile probe's OLMo case: a converted folder re-saved by plain transformers, then the original's
    weights copied over it (same header: the checksum passes). Copied beside it, they are not read at all."""
    original = olmo()
    original.save_pretrained(tmp_path / "orig")
    model = olmo()
    normswap.convert(model, method="exact")
    model.save_pretrained(tmp_path / "m")
    with torch.no_grad():
        want = model(IDS).logits
    resaved = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "m", trust_remote_code=True)
    resaved.save_pretrained(tmp_path / "r")
    (tmp_path / "r" / "model.safetensors").write_bytes((tmp_path / "orig" / "model.safetensors").read_bytes())
    with torch.no_grad():
        assert rel(normswap.from_pretrained(tmp_path / "r")(IDS).logits, want) < 1e-5
    (tmp_path / "r" / "model.normswap.safetensors").write_bytes((tmp_path / "orig" / "model.safetensors").read_bytes())
    with pytest.raises(NormswapError, match="does not reproduce the outputs recorded"):
        normswap.from_pretrained(tmp_path / "r")
    with pytest.raises(ValueError, match="does not reproduce the outputs recorded"):   # the folder's own class
        tf.AutoModelForCausalLM.from_pretrained(tmp_path / "r", trust_remote_code=True)


@pytest.mark.slow
def test_trainer_checkpoints_and_a_pickled_model(demo, tmp_path):
    model, _, want = demo
    args = tf.TrainingArguments(output_dir=str(tmp_path / "run"), report_to=[], use_cpu=True)
    tf.Trainer(model=model, args=args).save_model(str(tmp_path / "t"))
    with torch.no_grad():
        assert rel(normswap.from_pretrained(tmp_path / "t")(IDS).logits, want) < 1e-5
    torch.save(model, tmp_path / "model.pt")
    code = ("import sys, torch; m = torch.load(sys.argv[1], weights_only=False); "
            "print(type(m).__name__, float(m(torch.tensor([[5, 6, 7, 8, 9, 10, 11]])).logits.abs().sum()))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "model.pt")], capture_output=True, text=True,
                         timeout=300, check=True).stdout.split()
    assert out[0] == "NormswapGPT2LMHeadModel" and abs(float(out[1]) - float(model(IDS).logits.abs().sum())) < 1e-2


def test_save_pretrained_refuses_what_it_cannot_complete(demo, tmp_path):
    model, _, _ = demo
    with pytest.raises(InvalidConversion, match="push_to_hub"):
        model.save_pretrained(tmp_path / "p", push_to_hub=True)
    with pytest.raises(InvalidConversion, match="variant"):
        model.save_pretrained(tmp_path / "v", variant="fp16")
    assert not (tmp_path / "p").exists() and not (tmp_path / "v").exists()


class MyGPT2(tf.GPT2LMHeadModel):
    """A user's subclass: no folder could rebuild it without the user's code."""


def test_a_converted_model_of_a_class_transformers_does_not_define_refuses_to_save(tmp_path):
    model = MyGPT2(tf.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=97, n_positions=64))
    normswap.convert(model, method="naive")
    with pytest.raises(InvalidConversion, match="not transformers' own"):
        model.save_pretrained(tmp_path / "m")
    assert not (tmp_path / "m").exists()
