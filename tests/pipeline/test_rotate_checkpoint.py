"""`rotate_checkpoint`: its options are one frozen object; bad ones fail before any load, writing nothing; a
rotated folder reloads in normswap and in plain transformers."""
import copy
import dataclasses
import json

import pytest
import torch
import transformers as tf

import normswap
from normswap.errors import NormswapError
from normswap.parity import compare
from helpers.exact_models import build, padded_batches, perturb


def test_options_are_frozen_and_bad_ones_fail_before_any_work(tmp_path):
    options = normswap.RotateOptions(method="random", seed=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.seed = 4
    with pytest.raises(NormswapError, match="unknown rotation method 'givens'"):
        normswap.rotate("normswap-demo", tmp_path / "o", normswap.RotateOptions(method="givens"))
    with pytest.raises(NormswapError, match="shard"):
        normswap.rotate("normswap-demo", tmp_path / "o", normswap.RotateOptions(max_shard_size="lots"))
    assert not (tmp_path / "o").exists()


def test_the_demo_itself_is_refused_until_converted(tmp_path):
    with pytest.raises(NormswapError, match=r"transformer\.h\.0\.ln_1 \(LayerNorm\) is a LayerNorm: convert"):
        normswap.rotate("normswap-demo", tmp_path / "o")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("name, auto, norm", [
    ("bloom", "AutoModelForCausalLM", "transformer.word_embeddings_layernorm"), ("gpt2-headless", "AutoModel", "ln_f"),
    ("mbart", "AutoModelForSeq2SeqLM", "model.encoder.layer_norm")])
def test_a_rotated_folder_with_a_matrix_fix_reloads_in_normswap_and_plain_transformers(tmp_path, name, auto, norm):
    """A norm's d x d matrix (its input or output kept unrotated) is saved with the weights and applied by both
    loaders (one implementation: the shipped file's output fix); the section says format 3, which older
    normswap versions refuse rather than load without the matrix."""
    original = build(name)
    model = copy.deepcopy(original)
    normswap.convert(model, method="exact")
    normswap.save(model, tmp_path / "c")
    result = normswap.rotate(str(tmp_path / "c"), tmp_path / "r", normswap.RotateOptions(seed=2))
    assert norm in result.report.unrotated
    if name == "mbart":   # the head untied: the flag that tied it tied these too (loading would leave them missing)
        assert result.report.untied == ["lm_head.weight", "model.encoder.embed_tokens.weight",
                                        "model.decoder.embed_tokens.weight"]
    section = json.loads((tmp_path / "r" / "config.json").read_text())["normswap"]
    assert section["format"] == 4 and section["output_fixes"][norm]["matrix"] == 32
    plain, info = getattr(tf, auto).from_pretrained(tmp_path / "r", trust_remote_code=True, output_loading_info=True)
    assert not info["missing_keys"] and type(plain).__name__.startswith("Normswap")
    for loaded in (normswap.load(tmp_path / "r")[0], plain.eval()):
        assert bool((loaded.get_submodule(norm).normswap_matrix != 0).any())
        assert compare(original, loaded, padded_batches()).max_rel < 1e-5, type(loaded).__name__


def test_a_rotated_whisper_reloads_with_its_entry_rotated_in_the_input_fix(tmp_path):
    """Whisper's encoder stream starts after a GELU (an opaque value, centred by the input fix of its first
    layer): that fix multiplies it by Q too (`input_matrix`), in normswap and in plain transformers."""
    config = tf.WhisperConfig(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                              decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8,
                              max_source_positions=16, max_target_positions=16, vocab_size=60, pad_token_id=0,
                              bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    torch.manual_seed(0)
    original = perturb(tf.WhisperForConditionalGeneration(config)).eval()
    model = copy.deepcopy(original)
    normswap.convert(model, method="exact")
    normswap.save(model, tmp_path / "c")
    report = normswap.rotate(str(tmp_path / "c"), tmp_path / "r").report
    assert sorted(report.unrotated) == ["model.encoder.layer_norm", "model.encoder.layers.0"]
    fixes = json.loads((tmp_path / "r" / "config.json").read_text())["normswap"]["output_fixes"]
    assert fixes["model.encoder.layers.0"] == {"bias": 0, "centre": False, "input": True, "input_matrix": 32}
    x = {"input_features": torch.randn(2, 8, 32), "decoder_input_ids": torch.randint(0, 60, (2, 5))}
    plain = tf.AutoModelForSpeechSeq2Seq.from_pretrained(tmp_path / "r", trust_remote_code=True).eval()
    for loaded in (normswap.load(tmp_path / "r")[0], plain):
        with torch.no_grad():
            want, got = original(**x).logits, loaded(**x).logits
        assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5, type(loaded).__name__
