"""benchmarks/architectures.py --rotate (issue 49): each rotation arm's outcome is what the model does, compared
with the original's outputs in memory and after save/load: rotated where it keeps them, WRONG where an output
differs, refused (with the one-line reason) where normswap says NotRotatable, error where another exception escapes."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import transformers as tf

import normswap
from normswap.models.inputs import sample_inputs
from normswap.parity import reference_outputs
from normswap.surgery.streams import NotRotatable

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import architectures as arch  # noqa: E402


def tiny_llama() -> tf.LlamaForCausalLM:
    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = tf.LlamaForCausalLM(config).eval()
    arch.perturb_gains(model)
    return model


@pytest.fixture
def llama():
    model = tiny_llama()
    refs = [reference_outputs(model, sample_inputs(model)),
            reference_outputs(model, sample_inputs(model, batch=3, seq=11, seed=1))]
    return model, refs


def test_perturb_gains_moves_the_rmsnorms_and_nothing_else():
    moved = tiny_llama()
    torch.manual_seed(0)
    plain = tf.LlamaForCausalLM(moved.config).eval()
    for (name, a), b in zip(plain.named_parameters(), moved.parameters()):
        assert torch.equal(a, b) != name.endswith("norm.weight"), name


def test_a_rotation_that_keeps_the_function_is_rotated_in_memory_and_reloaded(llama):
    model, refs = llama
    got = arch.rotated(lambda: model, "R1+R2", refs, {})
    assert got["outcome"] == "rotated", got
    assert set(got["errors"]) == {"memory", "reload"} and max(got["errors"].values()) <= arch.TOL
    assert "cache" in got["not_preserved"]   # R2 stores the values rotated per head, as its report says


def test_a_rotation_that_changes_an_output_is_wrong(llama, monkeypatch):
    model, refs = llama
    rotate = normswap.rotate

    def broken(m, **kw):   # a rotation that claims success and leaves the head off by 1e-3
        report = rotate(m, **kw)
        with torch.no_grad():
            m.lm_head.weight.mul_(1 + 1e-3)
        return report

    monkeypatch.setattr(normswap, "rotate", broken)
    got = arch.rotated(lambda: model, "R1", refs, {})
    assert got["outcome"] == "WRONG" and got["worst"].startswith("memory: logits"), got
    assert got["errors"]["memory"] > arch.TOL


@pytest.mark.parametrize("raised, outcome", [(NotRotatable("x.y is odd: because\nmore"), "refused"),
                                             (RuntimeError("a bug"), "error")])
def test_refusals_keep_their_one_line_reason_and_other_exceptions_are_errors(llama, monkeypatch, raised, outcome):
    model, refs = llama

    def refuse(m, **kw):
        raise raised

    monkeypatch.setattr(normswap, "rotate", refuse)
    got = arch.rotated(lambda: model, "R1", refs, {})
    assert got["outcome"] == outcome
    assert got["why"] == ("x.y is odd: because" if outcome == "refused" else "RuntimeError: a bug")
    assert arch.reason("a.b.c's output is read by 'mm' in b (Linear): 32 x 32") == \
        "<name>'s output is read by '…' in b (<class>): N x N"
    assert arch.reason("norm's output") == arch.reason("a.b_2's output") == "<name>'s output"


@pytest.mark.slow
@pytest.mark.parametrize("model_type, outcome", [("mistral", "no-layernorm"), ("gpt2", "exact")])
def test_the_sweep_rotates_an_rmsnorm_family_and_a_converted_layernorm_one_every_way(model_type, outcome):
    row = arch.one(model_type, rotate=True)
    assert row["outcome"] == outcome
    assert list(row["rotation"]) == list(arch.ARMS)
    for arm, got in row["rotation"].items():
        assert got["outcome"] == "rotated", (arm, got)
        assert set(got["errors"]) == {"memory", "reload"} and max(got["errors"].values()) <= arch.TOL


@pytest.mark.slow
def test_the_sweep_records_a_sandwich_norm_familys_refusal_by_name_for_every_arm():
    row = arch.one("gemma2", rotate=True)   # a norm after each block's output: it writes the stream
    r1 = row["rotation"]["R1"]
    assert r1["outcome"] == "refused" and r1["kind"] == "NotRotatable"
    assert r1["why"].startswith("model.layers.0.post_attention_layernorm writes the stream")
    assert [row["rotation"][a].get("as") for a in arch.ARMS] == [None, "R1", "R1"]
