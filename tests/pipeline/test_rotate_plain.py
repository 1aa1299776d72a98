"""A rotated model that was RMSNorm already (a Llama-class folder) is saved as its own architecture: config and
weights that plain transformers loads with its own class, no custom code, no trust_remote_code; its logits are the
original's, greedy generation identical (here, and in a child that cannot import normswap)."""
from __future__ import annotations

import json

import pytest
import torch
import transformers as tf

import normswap
from helpers.plain import plain_transformers

TINY = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
            pad_token_id=0, bos_token_id=1, eos_token_id=2)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture
def llama(tmp_path):
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**TINY)).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
    model.save_pretrained(tmp_path / "llama")
    return model, tmp_path / "llama"


def test_a_rotated_llama_folder_loads_in_plain_transformers_with_its_own_class(llama, tmp_path):
    original, src = llama
    result = normswap.rotate(src, tmp_path / "rotated", seed=3, heads=True)   # QuaRot's R1 and R2
    out = tmp_path / "rotated"
    assert result.report.untied == ["lm_head.weight"]
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is False
    assert "auto_map" not in config and "normswap" not in config   # nothing for transformers to run but its own
    assert config["normswap_rotations"] == [{"method": "hadamard", "seed": 3, "widths": [32],
                                             "untied": ["lm_head.weight"], "unrotated": [], "heads": 8}]
    model = tf.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(model) is tf.LlamaForCausalLM
    ids = torch.randint(3, 61, (2, 13), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = original(input_ids=ids).logits
        assert rel(model(input_ids=ids).logits, want) <= 1e-4
        assert (model.model.embed_tokens.weight - original.model.embed_tokens.weight).norm() > \
            0.5 * original.model.embed_tokens.weight.norm()   # really rotated
        settings = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
        assert torch.equal(model.generate(ids[:1], **settings), original.generate(ids[:1], **settings))
    # normswap loads it as the plain folder it is, and rotates it again
    again, _ = normswap.load(out)
    assert normswap.rotate(again, method="random", seed=1).verification["max_rel"] <= 1e-4
    assert len(again.config.normswap_rotations) == 2


@pytest.mark.slow   # a child interpreter (NORMSWAP_PLAIN_PYTHON: transformers 4.57 too, as CI runs it)
def test_a_rotated_llama_folder_loads_where_normswap_cannot_be_imported(llama, tmp_path):
    original, src = llama
    out = tmp_path / "rotated"
    normswap.rotate(src, out, heads=True)
    ids = torch.randint(3, 61, (2, 13), generator=torch.Generator().manual_seed(5))
    torch.save([{"input_ids": ids}], tmp_path / "inputs.pt")
    results = plain_transformers(tmp_path, {str(out): str(tmp_path / "inputs.pt")})
    assert results[str(out)] == {"cls": "LlamaForCausalLM", "auto": "LlamaForCausalLM"}
    [plain] = torch.load(f"{out}-plain.pt")
    with torch.no_grad():
        assert rel(plain["logits"], original(input_ids=ids).logits) <= 1e-4
