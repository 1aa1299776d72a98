"""Norms that cannot be exact stay LayerNorms while the rest of the model converts exactly (in memory and
streaming), and say why; where the cause concerns every norm (post-LN), nothing is kept back."""
from __future__ import annotations

import copy

import pytest
import torch
import transformers as tf
from helpers.exact_models import perturb

import normswap
from normswap.pipeline import lazy_convert
from normswap.parity import compare
from normswap.surgery.labels import Cause, NotExact

KEPT = "lm_head.layer_norm"   # reads gelu(dense(...)): no weight edit centres its input


def _roberta_preln():
    torch.manual_seed(0)
    return perturb(tf.RobertaPreLayerNormForMaskedLM(tf.RobertaPreLayerNormConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64))).eval()


def _inputs():
    g = torch.Generator().manual_seed(5)
    return [{"input_ids": torch.randint(0, 100, (3, 11), generator=g)}]   # not the sample inputs


@pytest.mark.parametrize("method", ["exact", "auto"])
def test_an_lm_head_norm_stays_and_the_rest_is_exact(method):
    model = _roberta_preln()
    reference = copy.deepcopy(model)
    report = normswap.convert(model, method=method)
    assert report.method == "exact" and report.num_converted == 6
    assert [s.name for s in report.skipped] == [KEPT] and report.skipped[0].refusal.cause is Cause.OPAQUE
    assert "gelu" in report.skipped[0].reason   # the operation named
    assert isinstance(model.get_submodule(KEPT), torch.nn.LayerNorm)
    assert not any(isinstance(m, torch.nn.LayerNorm) for n, m in model.named_modules() if n != KEPT)
    assert compare(reference, model, _inputs()).max_rel <= 1e-5
    naive = copy.deepcopy(reference)
    normswap.convert(naive, method="naive")
    assert compare(reference, naive, _inputs()).max_rel > 0.05   # the perturbed biases matter


def test_streaming_keeps_the_same_norm_and_writes_the_same_model(tmp_path):
    model = _roberta_preln()
    model.save_pretrained(tmp_path / "src")
    report, parity = lazy_convert.convert_folder(tmp_path / "src", tmp_path / "out", method="exact")
    assert report.method == "exact" and [s.name for s in report.skipped] == [KEPT]
    loaded = normswap.from_pretrained(tmp_path / "out")
    assert isinstance(loaded.get_submodule(KEPT), torch.nn.LayerNorm)
    assert compare(model, loaded, _inputs()).max_rel <= 1e-5
    in_memory = copy.deepcopy(model)
    normswap.convert(in_memory, method="exact")
    assert compare(in_memory, loaded, _inputs()).max_abs == 0.0


def test_post_ln_keeps_nothing_back():
    torch.manual_seed(0)
    bert = perturb(tf.BertModel(tf.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                                              num_attention_heads=4, intermediate_size=64))).eval()
    with pytest.raises(NotExact) as e:
        normswap.convert(bert, method="exact")
    assert e.value.cause is Cause.POST_LN


def _swin():
    torch.manual_seed(0)
    return perturb(tf.SwinForImageClassification(tf.SwinConfig(
        image_size=32, patch_size=2, embed_dim=8, depths=[1, 1, 2], num_heads=[1, 2, 2], window_size=4,
        num_labels=3))).eval()


@pytest.mark.parametrize("method", ["exact", "auto"])
def test_swin_keeps_the_stages_patch_merging_reads_and_the_last_is_exact(method):
    """Patch merging normalises four positions of the stream side by side: centring the stream shifts each
    by its own mean, which its LayerNorm does not ignore. That stream stays as it is, so every norm reading
    or writing it stays a LayerNorm, naming why; the last stage and the final norm convert exactly."""
    model = _swin()
    reference = copy.deepcopy(model)
    report = normswap.convert(model, method=method)
    last = [f"swin.encoder.layers.2.blocks.{b}.layernorm_{w}" for b in (0, 1) for w in ("before", "after")]
    assert report.method == "exact" and sorted(r.name for r in report.converted) == sorted(last + ["swin.layernorm"])
    reasons = {s.name: s.reason for s in report.skipped}
    assert "a concatenation along the hidden dim" in reasons["swin.encoder.layers.0.downsample.norm"]
    assert "whose input is not a plain sum" in reasons["swin.encoder.layers.1.blocks.0.layernorm_before"]
    assert "swin.encoder.layers.1.downsample.norm" in reasons["swin.encoder.layers.1.blocks.0.layernorm_before"]
    assert len(reasons) == 1 + 2 * (2 + 1) and all(isinstance(model.get_submodule(n), torch.nn.LayerNorm)
                                                   for n in reasons)   # embedding norm; 2 stages x (block, merging)
    x = [{"pixel_values": torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(9))}]
    assert compare(reference, model, x).max_rel <= 1e-5
    naive = copy.deepcopy(reference)
    normswap.convert(naive, method="naive")
    assert compare(reference, naive, x).max_rel > 1e-3
