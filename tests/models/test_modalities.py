"""Encoder-decoders, speech and image models end to end: sample inputs, convert, save/reload, inspect, eval."""
from __future__ import annotations

import json

import pytest
import torch
import transformers as tf
from click.testing import CliRunner
from torch import nn

import normswap
from normswap.cli import main
from normswap.models.load import load_model
from normswap.models.inputs import sample_inputs
from normswap.parity import main_output

D, V = 32, 61
TOK = dict(pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=3)
ENC_DEC = dict(vocab_size=V, d_model=D, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
               decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, **TOK)
VISION = dict(hidden_size=D, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=16,
              patch_size=8)
TEXT = dict(vocab_size=V, hidden_size=D, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=24, bos_token_id=0, eos_token_id=2, pad_token_id=1)

MODELS = {
    "whisper": lambda: tf.WhisperForConditionalGeneration(tf.WhisperConfig(
        num_mel_bins=8, max_source_positions=12, max_target_positions=20, **ENC_DEC)),
    "mbart": lambda: tf.MBartForConditionalGeneration(tf.MBartConfig(max_position_embeddings=64, **ENC_DEC)),
    "vit": lambda: tf.ViTForImageClassification(tf.ViTConfig(num_labels=5, **VISION)),
    "clip": lambda: tf.CLIPModel(tf.CLIPConfig(text_config=TEXT, vision_config=VISION, projection_dim=16)),
    "clip-vision": lambda: tf.CLIPVisionModel(tf.CLIPVisionConfig(**VISION)),
    "dinov2": lambda: tf.Dinov2Model(tf.Dinov2Config(**VISION)),
}


def tiny(name: str) -> nn.Module:
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # norms far from init, so the naive swap visibly changes outputs
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(0.5 + torch.rand(m.weight.shape, generator=g))
                m.bias.copy_(0.5 * torch.randn(m.bias.shape, generator=g) + 0.2)
    return model


def n_layernorms(model: nn.Module) -> int:
    return sum(isinstance(m, nn.LayerNorm) for m in model.modules())


def test_sample_inputs_match_signature():
    w = tiny("whisper")
    batches = sample_inputs(w)
    assert [set(b) for b in batches] == [{"input_features", "decoder_input_ids"}] * 2
    assert batches[1]["input_features"].shape == (2, 8, 24)          # mel bins, 2 * max_source_positions
    assert batches[1]["decoder_input_ids"].shape[1] <= 20
    assert (batches[1]["decoder_input_ids"][:, 0] == 3).all()

    m = sample_inputs(tiny("mbart"))
    assert [set(b) for b in m] == [{"input_ids", "attention_mask", "decoder_input_ids"}] * 3
    assert m[2]["input_ids"].shape == (1, tiny("mbart").config.max_position_embeddings)   # the long row
    assert m[1]["decoder_input_ids"].shape == m[1]["input_ids"].shape and (m[1]["decoder_input_ids"][:, 0] == 3).all()
    assert m[1]["attention_mask"][1:].sum() < m[1]["attention_mask"][0].sum()   # a padded row
    assert int(max(b["input_ids"].max() for b in m)) < V

    (v,) = sample_inputs(tiny("vit"))
    assert set(v) == {"pixel_values"} and v["pixel_values"].shape == (2, 3, 16, 16)

    c = sample_inputs(tiny("clip"))
    assert all(set(b) == {"input_ids", "attention_mask", "pixel_values"} for b in c)
    assert max(b["input_ids"].shape[1] for b in c) <= 24          # the text tower's positions


@pytest.mark.parametrize("name", list(MODELS))
def test_naive_convert_save_reload_bit_exact(name, tmp_path):
    model = tiny(name)
    before = n_layernorms(model)
    report = normswap.convert(model, method="naive")
    assert report.num_converted == before > 0 and n_layernorms(model) == 0
    normswap.save_pretrained(model, tmp_path / "out")
    again = normswap.from_pretrained(tmp_path / "out")
    assert type(again) is type(model)
    with torch.no_grad():
        for batch in sample_inputs(model):
            assert torch.equal(main_output(model(**batch))[1], main_output(again(**batch))[1])


@pytest.mark.parametrize("name,cls", [("whisper", "WhisperForConditionalGeneration"),
                                      ("mbart", "MBartForConditionalGeneration"),
                                      ("vit", "ViTForImageClassification")])
def test_cli_inspect_convert_eval(name, cls, tmp_path):
    model = tiny(name)
    model.save_pretrained(tmp_path / "src")
    loaded, _ = load_model(str(tmp_path / "src"))
    assert type(loaded).__name__ == cls    # the head named in config.architectures, not AutoModel
    run = CliRunner()
    res = run.invoke(main, ["inspect", str(tmp_path / "src"), "--json"])
    assert res.exit_code == 0, res.output
    rows = [r for r in json.loads(res.output)["norms"] if r["action"].startswith("to RMSNorm")]
    assert len(rows) == n_layernorms(model)
    res = run.invoke(main, ["convert", str(tmp_path / "src"), "--to", "rmsnorm", "-o", str(tmp_path / "out"),
                            "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output.splitlines()[-1])
    assert out["report"]["converted"] and 0 < out["parity"]["max_rel"] < float("inf")
    res = run.invoke(main, ["eval", str(tmp_path / "out"), "--reference", str(tmp_path / "src"), "--json"])
    assert res.exit_code == 0, res.output
    ev = json.loads(res.output)
    assert ev["kind"] == "parity" and ev["max_rel"] == pytest.approx(out["parity"]["max_rel"], rel=1e-6)
    res = run.invoke(main, ["eval", str(tmp_path / "out")])
    assert res.exit_code == 1 and "no perplexity" in res.output and "--reference" in res.output
    assert "Traceback" not in res.output
