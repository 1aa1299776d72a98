"""`normswap export` of vision and audio encoders (issue 33 #12): each exported on its own inputs (pixel_values of
the config's image size, log-mel features, waveforms), batch size dynamic, validated in onnxruntime, and the
ORT graph equal to the converted PyTorch model on a batch size it was not traced with."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers as tf

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

import onnxruntime as ort  # noqa: E402
from helpers.cli import one_error_line, run  # noqa: E402
from helpers.exact_models import perturb, wav2vec2_config  # noqa: E402

import normswap  # noqa: E402

pytestmark = pytest.mark.slow   # ONNX exports of vision and speech models


D = 32
VIT = dict(hidden_size=D, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=32,
           patch_size=8)
WHISPER = dict(d_model=D, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
               encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=16, max_source_positions=30,
               max_target_positions=32, vocab_size=101, pad_token_id=0, bos_token_id=1, eos_token_id=2,
               decoder_start_token_id=1)
MODELS = {   # name -> (model, method, the graph's inputs for a batch of 3)
    "vit": (lambda: tf.ViTForImageClassification(tf.ViTConfig(num_labels=3, **VIT)), "exact",
            lambda g: {"pixel_values": torch.randn(3, 3, 32, 32, generator=g)}),
    "dinov2": (lambda: tf.Dinov2Model(tf.Dinov2Config(**{**VIT, "intermediate_size": None}, mlp_ratio=2)), "exact",
               lambda g: {"pixel_values": torch.randn(3, 3, 32, 32, generator=g)}),
    # its output is the raw stream (pre_layrnorm writes it): not exact, exported all the same
    "clip-vision": (lambda: tf.CLIPVisionModel(tf.CLIPVisionConfig(**VIT)), "naive",
                    lambda g: {"pixel_values": torch.randn(3, 3, 32, 32, generator=g)}),
    "whisper-encoder": (lambda: tf.WhisperForAudioClassification(tf.WhisperConfig(num_labels=2, **WHISPER)), "exact",
                        lambda g: {"input_features": torch.randn(3, 16, 60, generator=g)}),
    "wav2vec2": (lambda: tf.Wav2Vec2ForCTC(wav2vec2_config(do_stable_layer_norm=True, feat_extract_norm="layer")),
                 "exact", lambda g: {"input_values": torch.randn(3, 400, generator=g),
                                     "attention_mask": torch.ones(3, 400, dtype=torch.long)}),
}


def converted(name: str, method: str, root):
    torch.manual_seed(0)
    model = perturb(MODELS[name][0]()).eval()
    model.config.architectures = [type(model).__name__]
    report = normswap.convert(model, method=method)
    assert report.method == method or method == "exact" and not report.skipped, report
    normswap.save_pretrained(model, root / name)
    return model


@pytest.mark.parametrize("name", list(MODELS))
def test_a_vision_or_audio_encoder_exports_on_its_own_inputs(name, tmp_path):
    """Before: "ViTModel does not take input_ids: only text models export" (Whisper and wav2vec2: a traceback's
    last line)."""
    model = converted(name, MODELS[name][1], tmp_path)
    result = run("export", tmp_path / name, "--onnx", tmp_path / "m.onnx", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output[result.output.index("{"):])
    assert report["validated"]
    # the conversion's probe on the graph's inputs, the folder's recorded digest where the graph takes all of it
    found = report["fingerprint"]
    assert found["probe_from"] == "model" and found["checked"]
    dropped = {"none": "the graph takes no `bool_masked_pos`"}
    assert found["saved"] == (dropped if name == "dinov2" else found["outputs"])
    feed = MODELS[name][2](torch.Generator().manual_seed(5))
    sess = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    graph = {i.name: i.shape for i in sess.get_inputs()}
    assert set(graph) == set(feed) and all(isinstance(s[0], str) for s in graph.values())   # batch size dynamic
    if "pixel_values" in graph:
        assert graph["pixel_values"][1:] == [3, 32, 32]                                     # the config's size
    names = [o.name for o in sess.get_outputs()]
    got = dict(zip(names, sess.run(None, {k: v.numpy() for k, v in feed.items()})))
    with torch.no_grad():
        ref = model(**feed)
    main = "logits" if "logits" in got else "last_hidden_state"
    want = getattr(ref, main).numpy()
    assert got[main].shape == want.shape and np.abs(got[main] - want).max() <= 1e-4 * np.abs(want).max()


def test_an_encoder_decoder_speech_model_is_refused_in_one_line(tmp_path):
    torch.manual_seed(0)
    tf.WhisperForConditionalGeneration(tf.WhisperConfig(**WHISPER)).save_pretrained(tmp_path / "whisper")
    line = one_error_line(run("export", tmp_path / "whisper", "--onnx", tmp_path / "m.onnx"))
    assert line == ("error: cannot export WhisperForConditionalGeneration: an encoder-decoder (its decoder runs "
                    "once per generated token on the encoder's output); normswap exports decoder-only language "
                    "models, text encoders and vision and audio encoders")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["whisper"]


def test_a_text_encoder_decoder_is_refused_in_one_line(tmp_path):
    """Before: mBART's export failed in onnxruntime ("Unsqueeze ... axis 1 is not in valid range")."""
    from helpers.exact_models import build
    build("mbart").save_pretrained(tmp_path / "mbart")
    line = one_error_line(run("export", tmp_path / "mbart", "--onnx", tmp_path / "m.onnx"))
    assert line.startswith("error: cannot export MBartForConditionalGeneration: an encoder-decoder")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mbart"]


def test_a_vision_encoder_exports_a_deployment_folder_with_its_processor_settings(tmp_path):
    converted("vit", "exact", tmp_path)
    processor = '{"image_processor_type": "ViTImageProcessor", "size": {"height": 32, "width": 32}}'
    (tmp_path / "vit" / "preprocessor_config.json").write_text(processor)
    result = run("export", tmp_path / "vit", "-o", tmp_path / "onnx")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (tmp_path / "onnx").iterdir()) == ["config.json", "model.onnx",
                                                                     "preprocessor_config.json"]
    assert (tmp_path / "onnx" / "preprocessor_config.json").read_text() == processor
    assert json.loads((tmp_path / "onnx" / "config.json").read_text())["use_cache"] is False
