"""Decoders that splice images or audio into their text convert exactly, their towers included: the sample
inputs run the towers (patch lists with grids, audio features at audio tokens), so the plan covers them; so
do the towers and encoders alone (Video-LLaMA 3's, Parakeet's frames-first mel features)."""
from __future__ import annotations

import copy

import pytest
import torch
import transformers as tf
from helpers.exact_models import perturb

import normswap
from normswap.models.inputs import sample_inputs
from normswap.parity import compare
from normswap.surgery.walk import Skip

TEXT = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
            intermediate_size=64, max_position_embeddings=128)


def _qwen2_vl():
    return tf.Qwen2VLModel(tf.Qwen2VLConfig(
        text_config=dict(TEXT, rope_parameters=dict(rope_type="default", rope_theta=1e4, mrope_section=[4, 2, 2])),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=32, num_heads=2, patch_size=8, spatial_merge_size=2,
                           temporal_patch_size=2),
        image_token_id=98, video_token_id=97, vision_start_token_id=96))


def _video_llama_3_tower():
    return tf.VideoLlama3VisionModel(tf.VideoLlama3VisionConfig(hidden_size=32, num_hidden_layers=2,
                                                                num_attention_heads=2, intermediate_size=64,
                                                                patch_size=8))


def _qwen2_audio():
    return tf.Qwen2AudioForConditionalGeneration(tf.Qwen2AudioConfig(
        audio_config=dict(num_mel_bins=16, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64,
                          d_model=32, max_source_positions=16),
        text_config=dict(TEXT, model_type="qwen2"), audio_token_index=98))


def _parakeet():
    return tf.ParakeetEncoder(tf.ParakeetEncoderConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                                       intermediate_size=64, num_mel_bins=16, subsampling_factor=4,
                                                       subsampling_conv_channels=8))


@pytest.mark.parametrize("make", [_qwen2_vl, _video_llama_3_tower, _qwen2_audio, _parakeet],
                         ids=lambda f: f.__name__[1:])
def test_media_decoders_and_grid_towers_convert_exactly(make):
    torch.manual_seed(0)
    model = perturb(make()).eval()
    reference = copy.deepcopy(model)
    report = normswap.convert(model, method="exact")
    assert report.method == "exact" and report.num_converted >= 4
    assert not [s for s in report.skipped if s.cls == "LayerNorm"]   # Parakeet's BatchNorms are not ours
    assert not any(isinstance(m, torch.nn.LayerNorm) for m in model.modules())
    unseen = sample_inputs(reference, batch=3, seed=7)   # other values, another batch
    kept = report.unverified   # the towers' own streams, returned centred (Qwen2-VL's image_outputs), as said
    assert compare(reference, model, unseen, skip=kept).max_rel <= 1e-4
    naive = copy.deepcopy(reference)
    normswap.convert(naive, method="naive")
    assert compare(reference, naive, unseen, skip=kept).max_rel > 0.05   # the perturbed biases matter


def test_images_placed_by_a_position_mask_convert_exactly():
    """Kosmos-2 places its image features by `image_embeds_position_mask`: the sample inputs open that path,
    so its vision tower and projector are planned; its inner norms (read after a gelu, or mid-attention) stay
    LayerNorms, said so, and every output but the tower's own stream is kept."""
    torch.manual_seed(0)
    model = perturb(tf.Kosmos2Model(tf.Kosmos2Config(
        latent_query_num=4, text_config=dict(vocab_size=99, embed_dim=32, layers=2, attention_heads=2, ffn_dim=64,
                                             max_position_embeddings=128),
        vision_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                           image_size=16, patch_size=8)))).eval()
    reference = copy.deepcopy(model)
    report = normswap.convert(model, method="exact")
    kept = {s.name for s in report.skipped if s.cause is Skip.KEPT}
    assert report.method == "exact" and report.num_converted >= 8
    assert kept and all(n.endswith(("inner_attn_ln", "ffn_layernorm")) for n in kept)
    assert any(r.name.startswith("vision_model.") for r in report.converted)
    unseen = sample_inputs(reference, batch=3, seed=7)
    assert "image_embeds_position_mask" in unseen[0]
    assert compare(reference, model, unseen, skip=report.unverified).max_rel <= 1e-4
    naive = copy.deepcopy(reference)
    normswap.convert(naive, method="naive")
    assert compare(reference, naive, unseen, skip=report.unverified).max_rel > 0.05
