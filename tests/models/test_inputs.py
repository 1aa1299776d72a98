"""Sample inputs for every modality, from the forward signature and the (nested) config: shapes as the
config says, and every parameter that hand-written inputs exercising each path run is run by them too."""
from __future__ import annotations

import types

import pytest
import torch
import transformers as tf
from torch import nn

import normswap
from normswap.errors import NormswapError
from normswap.models.inputs import sample_inputs

TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
VIT = dict(TINY, image_size=32, patch_size=8)
DINO = dict(model_type="dinov2", image_size=28, patch_size=14, out_indices=[1, 2],
            out_features=["stage1", "stage2"], reshape_hidden_states=False, **TINY)


def used(model: nn.Module, batches: list[dict]) -> set[str]:
    """Parameters that receive a gradient from the sum of every floating output over `batches`."""
    model.zero_grad(set_to_none=True)
    for x in batches:
        out = model(**x)
        values = [v for v in (out.to_tuple() if hasattr(out, "to_tuple") else [out])
                  if isinstance(v, torch.Tensor) and v.is_floating_point()]
        sum(v.double().sum() for v in values).backward()
    return {n for n, p in model.named_parameters() if p.grad is not None}


def build(cls, **config) -> nn.Module:
    torch.manual_seed(0)
    return cls(cls.config_class(**config)).eval()


def ids(n: int, shape) -> torch.Tensor:
    return torch.randint(3, n, shape, generator=torch.Generator().manual_seed(5))


VIDEO = [
    (tf.VivitModel, dict(TINY, image_size=32, num_frames=4, tubelet_size=[2, 8, 8])),
    (tf.VideoMAEModel, dict(VIT, num_frames=4, tubelet_size=2, use_mean_pooling=False)),
    (tf.TimesformerModel, dict(VIT, num_frames=4)),
]


@pytest.mark.parametrize("cls,config", VIDEO, ids=lambda v: getattr(v, "__name__", ""))
def test_video_models_get_clips_with_a_frames_axis(cls, config):
    model = build(cls, **config)
    batches = sample_inputs(model)
    assert batches[-1]["pixel_values"].shape == (2, 4, 3, 32, 32)     # (batch, frames, channels, h, w)
    if "bool_masked_pos" in batches[0]:                                # VideoMAE: the same count per row
        mask = batches[0]["bool_masked_pos"]
        assert mask.shape == (2, 2 * 16) and len(set(mask.sum(1).tolist())) == 1 and mask.any()
    clip = torch.randn(2, 4, 3, 32, 32)
    assert used(model, batches) >= used(model, [{"pixel_values": clip}])


def test_mel_features_in_the_layout_the_first_convolution_reads():
    """Whisper's Conv1d reads the mel bins as channels: (b, mels, 2 x positions); Parakeet's 2-D subsampling
    reads (b, frames, mels), frames the subsampling factor times the sequence length."""
    parakeet = build(tf.ParakeetEncoder, num_mel_bins=16, subsampling_factor=4, subsampling_conv_channels=8, **TINY)
    (x,) = sample_inputs(parakeet)
    assert x["input_features"].shape == (2, 4 * 16, 16)
    assert {n for n, _ in parakeet.named_parameters()} == used(parakeet, [x])
    whisper = build(tf.WhisperModel, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                    decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=16,
                    max_source_positions=8, vocab_size=60, pad_token_id=0, decoder_start_token_id=1,
                    bos_token_id=1, eos_token_id=2)
    assert sample_inputs(whisper)[0]["input_features"].shape[1:] == (16, 16)


def test_spectrogram_and_raw_waveform_audio():
    ast = build(tf.ASTModel, **dict(TINY, max_length=32, num_mel_bins=16, patch_size=8, frequency_stride=8,
                                    time_stride=8))
    (x,) = sample_inputs(ast)
    assert x["input_values"].shape == (2, 32, 16)                      # (batch, max_length frames, mel bins)
    moon = build(tf.MoonshineForConditionalGeneration, hidden_size=32, intermediate_size=64, vocab_size=50,
                 encoder_num_hidden_layers=1, decoder_num_hidden_layers=1, encoder_num_attention_heads=2,
                 decoder_num_attention_heads=2, encoder_num_key_value_heads=2, decoder_num_key_value_heads=2,
                 decoder_start_token_id=1)
    batches = sample_inputs(moon)
    assert [x["input_values"].dim() for x in batches] == [2, 2] and (batches[1]["decoder_input_ids"][:, 0] == 1).all()
    assert batches[1]["attention_mask"][1:].sum() < batches[1]["attention_mask"][0].sum()   # a padded row
    own = {"input_values": torch.randn(1, 4000), "decoder_input_ids": ids(50, (1, 5))}
    assert used(moon, batches) >= used(moon, [own])


def test_multi_codebook_ids_and_trajectories_and_time_series():
    music = build(tf.MusicgenForCausalLM, num_codebooks=2, vocab_size=64, hidden_size=32, ffn_dim=64,
                  num_hidden_layers=2, num_attention_heads=2)
    one, two, *_ = sample_inputs(music)
    assert one["input_ids"].shape[0] == 2 and two["input_ids"].shape[0] == 4    # batch x codebooks rows
    assert two["attention_mask"].shape == (2, two["input_ids"].shape[1])
    dt = build(tf.DecisionTransformerModel, state_dim=5, act_dim=3, hidden_size=32, n_layer=2, n_head=2,
               max_ep_len=32, n_positions=64)
    x = sample_inputs(dt)[-1]
    assert x["states"].shape[-1] == 5 and x["actions"].shape[-1] == 3 and x["returns_to_go"].shape[-1] == 1
    assert int(x["timesteps"].max()) < 32 and x["attention_mask"][1:].sum() < x["attention_mask"][0].sum()
    tst = build(tf.TimeSeriesTransformerModel, prediction_length=4, context_length=8, lags_sequence=[1, 2, 3],
                num_time_features=2, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32)
    x = sample_inputs(tst)[-1]
    assert x["past_values"].shape == (2, 8 + 3) and x["past_time_features"].shape == (2, 11, 2)
    assert x["future_values"].shape == (2, 4)                          # the decoder runs too
    patch = build(tf.PatchTSTModel, num_input_channels=2, context_length=32, patch_length=8, patch_stride=8,
                  d_model=32, num_attention_heads=2, num_hidden_layers=2, ffn_dim=64)
    assert sample_inputs(patch)[-1]["past_values"].shape == (2, 32, 2)
    fm = build(tf.TimesFmModel, patch_length=8, context_length=32, horizon_length=8, num_hidden_layers=2,
               hidden_size=32, intermediate_size=32, head_dim=16, num_attention_heads=2, freq_size=3)
    x = sample_inputs(fm)[-1]   # TimesFM: one variable, every step real, a frequency class per series
    assert x["past_values"].shape == x["past_values_padding"].shape == (2, 32) and not x["past_values_padding"].any()
    assert x["freq"].shape == (2, 1) and int(x["freq"].max()) < 3
    assert any(n.startswith("layers.1.") for n in used(fm, [x]))


def test_masked_positions_reach_a_backbone_through_kwargs():
    """Dinov2ForImageClassification takes bool_masked_pos only through **kwargs, which it hands to Dinov2Model:
    the first batch passes it, so the mask token runs and the classifier converts exactly."""
    model = build(tf.Dinov2ForImageClassification, **{k: v for k, v in DINO.items() if "out_" not in k})
    one, two, *_ = sample_inputs(model)
    assert one["bool_masked_pos"].shape == (2, 4) and one["bool_masked_pos"].any() and "bool_masked_pos" not in two
    assert "dinov2.embeddings.mask_token" in used(model, [one])
    assert normswap.convert(model, method="exact").method == "exact"


def test_a_decoder_that_cross_attends_gets_encoder_states():
    """MusicGen's decoder has cross-attention layers its config does not announce: the first batch passes
    encoder states, so every parameter runs and the cross-attention norms convert exactly; GPT-2 without
    cross-attention rejects them and gets none."""
    music = build(tf.MusicgenForCausalLM, num_codebooks=2, vocab_size=64, hidden_size=32, ffn_dim=64,
                  num_hidden_layers=2, num_attention_heads=2)
    one, two, *_ = sample_inputs(music)
    assert one["encoder_hidden_states"].shape[::2] == (1, 32) and "encoder_hidden_states" not in two
    assert used(music, [one, two]) == {n for n, _ in music.named_parameters()}
    report = normswap.convert(music, method="exact")
    assert report.method == "exact" and "model.decoder.layers.1.encoder_attn_layer_norm" in \
        [r.name for r in report.converted]
    gpt2 = build(tf.GPT2LMHeadModel, vocab_size=64, n_embd=32, n_layer=2, n_head=2)
    assert all("encoder_hidden_states" not in x for x in sample_inputs(gpt2))
    gpt2x = build(tf.GPT2LMHeadModel, vocab_size=64, n_embd=32, n_layer=2, n_head=2, add_cross_attention=True)
    assert sample_inputs(gpt2x)[0]["encoder_hidden_states"].shape[-1] == 32


@pytest.mark.parametrize("cls,config", [
    (tf.DepthAnythingForDepthEstimation, dict(backbone_config=DINO, neck_hidden_sizes=[16, 32], fusion_hidden_size=16,
                                              reassemble_hidden_size=32, reassemble_factors=[2, 1], patch_size=14)),
    (tf.VitPoseForPoseEstimation, dict(backbone_config=dict(model_type="vitpose_backbone", image_size=[32, 24],
                                                            patch_size=[8, 8], out_indices=[2], mlp_ratio=2,
                                                            out_features=["stage2"], **TINY))),
], ids=["depth_anything", "vitpose"])
def test_image_size_from_a_backbone_config(cls, config):
    """The size sits in backbone_config only (it was TypeError: 'NoneType' object is not iterable); a stand-in
    like streaming's (config and forward, no weights) gets the same shapes."""
    model = build(cls, **config)
    size = model.config.backbone_config.image_size
    size = (size, size) if isinstance(size, int) else tuple(size)
    (x,) = sample_inputs(model)
    assert x["pixel_values"].shape == (2, 3, *size)
    stand_in = types.SimpleNamespace(config=model.config, main_input_name="pixel_values", forward=model.forward,
                                     parameters=lambda: iter([torch.empty(0)]))
    assert [set(b) for b in sample_inputs(stand_in)] == [{"pixel_values"}]


@pytest.mark.parametrize("cls", [tf.DeiTForMaskedImageModeling, tf.Dinov2Model, tf.BeitForMaskedImageModeling])
def test_masked_image_paths_run(cls):
    """bool_masked_pos in the first batch (the mask token writes the stream), none in the second."""
    extra = dict(encoder_stride=8) if cls is not tf.Dinov2Model else {}
    model = build(cls, **VIT, **extra, **(dict(use_mask_token=True) if cls is tf.BeitForMaskedImageModeling else {}))
    first, second, *_ = sample_inputs(model)
    assert first["bool_masked_pos"].shape == (2, 16) and "bool_masked_pos" not in second
    mine = used(model, [first, second])
    assert any(n.endswith("mask_token") for n in mine)
    assert mine >= used(model, [{"pixel_values": torch.randn(2, 3, 32, 32),
                                 "bool_masked_pos": torch.ones(2, 16, dtype=torch.bool)}])


def test_a_mask_slot_left_empty_gets_no_mask():
    swin = build(tf.SwinModel, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=2, image_size=32,
                 patch_size=4)
    assert all("bool_masked_pos" not in x for x in sample_inputs(swin))


def test_fuyu_gets_patches_and_image_tokens():
    """Fuyu's image path (vision_embed_tokens) runs: flattened patches and as many image tokens as patches."""
    model = build(tf.FuyuForCausalLM, image_size=16, patch_size=8, num_channels=3, image_token_id=98,
                  text_config=dict(vocab_size=99, max_position_embeddings=64, **TINY))
    first, second, *_ = sample_inputs(model)
    assert first["pixel_values"].shape == (1, 4, 3 * 8 * 8) and int((first["input_ids"] == 98).sum()) == 4
    assert "pixel_values" not in second and not (second["input_ids"] == 98).any()   # text alone, padded
    assert {"model.vision_embed_tokens.weight", "model.vision_embed_tokens.bias"} <= used(model, [first])


def test_llava_image_tokens_counted_by_the_model():
    vision = dict(TINY, image_size=32, patch_size=8, projection_dim=16)
    text = dict(TINY, vocab_size=120, num_key_value_heads=2, max_position_embeddings=128)
    model = build(tf.LlavaForConditionalGeneration, vision_config=dict(model_type="clip_vision_model", **vision),
                  text_config=dict(model_type="llama", **text), image_token_id=110, image_seq_length=3,
                  vision_feature_layer=-1)
    first, second, *_ = sample_inputs(model)
    assert int((first["input_ids"] == 110).sum()) == 16          # 16 patches, not the config's stale 3
    assert first["pixel_values"].shape == (1, 3, 32, 32) and not (second["input_ids"] == 110).any()
    assert any(n.startswith("model.vision_tower") for n in used(model, [first]))


def test_image_forms_the_model_asks_for():
    """Idefics3 takes an images axis; LLaVA-OneVision each image's size and as many tiles as its grid makes
    (told by its error): the trial forward finds both, so their vision towers run and are planned."""
    vision = dict(TINY, image_size=32, patch_size=8)
    text = dict(TINY, vocab_size=120, num_key_value_heads=2, max_position_embeddings=512)
    idefics = build(tf.Idefics3ForConditionalGeneration, vision_config=vision, image_token_id=110, scale_factor=2,
                    text_config=dict(model_type="llama", **text))
    first, *_ = sample_inputs(idefics)
    assert first["pixel_values"].shape == (1, 1, 3, 32, 32) and int((first["input_ids"] == 110).sum()) == 4
    assert any(n.startswith("model.vision_model.encoder") for n in used(idefics, [first]))
    one = build(tf.LlavaOnevisionForConditionalGeneration, vision_config=dict(model_type="siglip_vision_model",
                **vision), text_config=dict(model_type="qwen2", **text), image_token_id=110,
                image_grid_pinpoints=[[32, 64], [64, 32]], vision_feature_layer=-1)
    first, *_ = sample_inputs(one)
    assert first["pixel_values"].shape == (1, 3, 3, 32, 32) and first["image_sizes"].tolist() == [[32, 32]]
    assert any(n.startswith("model.vision_tower.encoder") for n in used(one, [first]))


def test_token_types_padding_and_decoder_inputs():
    bert = build(tf.BertModel, vocab_size=60, type_vocab_size=2, max_position_embeddings=64, **TINY)
    first, second, *_ = sample_inputs(bert)
    types_ = second["token_type_ids"]
    assert (types_[:, 0] == 0).all() and (types_[:, -1] == 1).all() and types_.shape == second["input_ids"].shape
    assert (second["input_ids"][second["attention_mask"] == 0] == bert.config.pad_token_id).all()
    mbart = build(tf.MBartForConditionalGeneration, vocab_size=60, d_model=32, encoder_layers=1, decoder_layers=1,
                  encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
                  max_position_embeddings=20, decoder_start_token_id=3)
    x = sample_inputs(mbart)[1]
    assert x["attention_mask"][1:].sum() < x["attention_mask"][0].sum()   # padded encoder rows, kept
    assert x["decoder_input_ids"].shape[1] <= 20 and (x["decoder_input_ids"][:, 0] == 3).all()


def test_vit_mae_noise_makes_runs_agree():
    """ViT-MAE masks at random unless given `noise`: sample inputs carry it, so two runs give the same."""
    model = build(tf.ViTMAEForPreTraining, **VIT, decoder_hidden_size=32, decoder_num_hidden_layers=1,
                  decoder_num_attention_heads=2, decoder_intermediate_size=64, mask_ratio=0.5)
    (x,) = sample_inputs(model)
    assert x["noise"].shape == (2, 16)
    with torch.no_grad():
        assert torch.equal(model(**x).logits, model(**x).logits)


class Unknown(nn.Module):
    main_input_name = "inputs"

    def __init__(self):
        super().__init__()
        self.config = types.SimpleNamespace(vocab_size=10)
        self.layer = nn.Linear(2, 2)

    def forward(self, inputs, attention_mask=None):
        return self.layer(inputs)


class NeedsMore(Unknown):
    main_input_name = "input_ids"

    def forward(self, input_ids, spatial_shapes):
        return self.layer(input_ids.float())


@pytest.mark.parametrize("model,message", [
    (Unknown(), "cannot build sample inputs for Unknown: its main input inputs is not one normswap can build"),
    (NeedsMore(), "cannot build sample inputs for NeedsMore: no sample for its required input spatial_shapes"),
    (build(tf.PerceiverModel, d_model=32, d_latents=32, num_latents=4, num_blocks=1, num_self_attends_per_block=1,
           num_self_attention_heads=2, num_cross_attention_heads=2), "its main input inputs"),
])
def test_what_cannot_be_built_is_named_in_one_line(model, message):
    with pytest.raises(NormswapError) as e:
        sample_inputs(model)
    assert message in str(e.value) and "\n" not in str(e.value)


GRID_TOWER = dict(hidden_size=32, depth=2, num_heads=2, intermediate_size=64, patch_size=8, spatial_merge_size=2,
                  out_hidden_size=32)


def test_grid_towers_read_patch_lists_in_the_shape_they_take():
    """Qwen-VL-style towers take all images as one list of patches with each image's (frames, rows, columns):
    flat rows of what the patch embedding reads (GLM-4V: 3 x 2 x 8 x 8), or small images (Kimi's Conv2d)."""
    glm = build(tf.Glm4vVisionModel, temporal_patch_size=2, image_size=32, **GRID_TOWER)
    batches = sample_inputs(glm)
    x = batches[0]
    assert set(x) == {"hidden_states", "grid_thw"} and x["hidden_states"].shape == (2 * 16, 3 * 2 * 8 * 8)
    assert x["grid_thw"].tolist() == [[1, 4, 4]] * 2 and batches[-1]["grid_thw"].tolist() == [[1, 4, 8]] * 2
    assert {n for n, _ in glm.named_parameters()} == used(glm, batches)
    kimi = build(tf.Kimi_K25VisionModel, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                 intermediate_size=64, patch_size=8)
    x = sample_inputs(kimi)[0]
    assert x["pixel_values"].shape == (2 * 16, 3, 8, 8) and x["grid_thw"].tolist() == [[1, 4, 4]] * 2
    assert any(n.startswith("layers.") for n in used(kimi, [x]))


def test_grid_decoders_get_image_tokens_grids_and_token_types():
    """Qwen2-VL: flat patches, their grid, as many image tokens as the grid merges into (16 / 2^2), and
    mm_token_type_ids marking them (its 3-D rotary positions need it): its vision tower runs."""
    text = dict(TINY, vocab_size=99, num_key_value_heads=2, max_position_embeddings=64,
                rope_parameters=dict(rope_type="default", rope_theta=1e4, mrope_section=[4, 2, 2]))
    vision = dict(depth=2, embed_dim=32, hidden_size=32, num_heads=2, patch_size=8, spatial_merge_size=2,
                  temporal_patch_size=2)
    model = build(tf.Qwen2VLModel, text_config=text, vision_config=vision, image_token_id=98, video_token_id=97,
                  vision_start_token_id=96)
    first, second, *_ = sample_inputs(model)
    assert first["pixel_values"].shape == (16, 3 * 2 * 8 * 8) and first["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert int((first["input_ids"] == 98).sum()) == 4
    assert torch.equal(first["mm_token_type_ids"], (first["input_ids"] == 98).long())
    assert "pixel_values" not in second and not (second["input_ids"] == 98).any()
    assert any(n.startswith("visual.blocks") for n in used(model, [first]))


def test_audio_decoders_get_features_and_audio_tokens_counted_by_the_model():
    """Qwen2-Audio splices its audio tower's frames at audio tokens: the first batch carries log-mel features,
    their frame mask, and the audio tokens the model takes (one it expands, as its legacy inputs do)."""
    audio = dict(num_mel_bins=16, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64, d_model=32,
                 max_source_positions=16)
    model = build(tf.Qwen2AudioForConditionalGeneration, audio_config=audio, audio_token_index=98,
                  text_config=dict(model_type="qwen2", vocab_size=99, num_key_value_heads=2,
                                   max_position_embeddings=128, **TINY))
    first, second, *_ = sample_inputs(model)
    assert first["input_features"].shape == (1, 16, 32) and first["feature_attention_mask"].shape == (1, 32)
    assert int((first["input_ids"] == 98).sum()) == 1
    assert "input_features" not in second and not (second["input_ids"] == 98).any()
    assert any(n.startswith("model.audio_tower.layers") for n in used(model, [first]))


def test_native_resolution_images_get_patch_masks_and_shapes():
    """SigLIP 2 reads images as flattened patches with a mask of real ones and each image's (rows, columns)."""
    model = build(tf.Siglip2VisionModel, patch_size=8, num_patches=64, **TINY)
    first, *rest = sample_inputs(model)
    assert first["pixel_values"].shape == (2, 16, 3 * 8 * 8) and first["spatial_shapes"].tolist() == [[4, 4]] * 2
    assert first["pixel_attention_mask"].shape == (2, 16) and bool(first["pixel_attention_mask"].all())
    assert rest[-1]["spatial_shapes"].tolist() == [[4, 8]] * 2
    assert {n for n, _ in model.named_parameters()} == used(model, [first])


def test_videos_at_video_tokens_run_the_video_tower():
    """Video-LLaVA reads videos through a tower of their own: the first batch carries a clip (frames axis) at
    as many video tokens as the model reports (8 frames x 5 tokens), beside an image at image tokens."""
    model = build(tf.VideoLlavaForConditionalGeneration, image_token_index=98, video_token_index=97,
                  vision_config=dict(model_type="clip_vision_model", **dict(TINY, image_size=16, patch_size=8)),
                  text_config=dict(model_type="llama", vocab_size=99, num_key_value_heads=2,
                                   max_position_embeddings=256, **TINY))
    first, second, *_ = sample_inputs(model)
    assert first["pixel_values_videos"].shape == (1, 8, 3, 16, 16) and int((first["input_ids"] == 97).sum()) == 40
    assert "pixel_values" in first and "pixel_values_videos" not in second
    assert any(n.startswith("model.video_tower.") for n in used(model, [first]))


def test_an_encoder_that_requires_a_frame_mask_gets_one():
    """Audio Flamingo 3's encoder fails without `input_features_mask`: every frame is marked real."""
    model = build(tf.AudioFlamingo3Encoder, num_mel_bins=16, max_source_positions=8, **TINY)
    (x,) = sample_inputs(model)
    assert x["input_features"].shape == (2, 16, 16) and torch.equal(x["input_features_mask"], torch.ones(2, 16).long())
    assert any(n.startswith("layers.") for n in used(model, [x]))


def test_cross_attended_images_get_an_images_axis_and_their_mask():
    """Idefics cross-attends to its images: (batch, images, channels, h, w) and an `image_attention_mask`
    over (text, images), found by a trial forward, so its vision tower and gated cross-attention run."""
    model = build(tf.IdeficsModel, **dict(TINY, vocab_size=99, max_position_embeddings=64),
                  vision_config=dict(embed_dim=32, image_size=32, patch_size=8, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=64),
                  perceiver_config=dict(use_resampler=False), cross_layer_interval=1,
                  freeze_text_layers=False, freeze_vision_layers=False)   # its default trains only the new layers
    first, second, *_ = sample_inputs(model)
    assert first["pixel_values"].shape == (1, 1, 3, 32, 32) and second["pixel_values"].shape[:2] == (2, 1)
    assert torch.equal(first["image_attention_mask"], torch.ones(1, 16, 1).long())
    names = used(model, [first])
    assert any(n.startswith("vision_model.encoder") for n in names)
    assert any(n.startswith("gated_cross_attn_layers.0.cross_attn") for n in names)


def test_a_video_model_whose_only_token_is_a_video_token_reads_its_clips_there():
    """InstructBLIP-Video takes its clips as `pixel_values` (an axis of frames) at video tokens: the query
    tokens of each frame, as the model counts them."""
    model = build(tf.InstructBlipVideoForConditionalGeneration, num_query_tokens=4, video_token_index=98,
                  vision_config=dict(TINY, image_size=16, patch_size=8),
                  qformer_config=dict(TINY, vocab_size=99, encoder_hidden_size=32),
                  text_config=dict(model_type="opt", vocab_size=99, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                   num_attention_heads=2, word_embed_proj_dim=32, max_position_embeddings=128))
    first, *_ = sample_inputs(model)
    frames = first["pixel_values"].shape[1]
    assert first["pixel_values"].dim() == 5 and int((first["input_ids"] == 98).sum()) == 4 * frames
    assert any(n.startswith("vision_model.encoder") for n in used(model, [first]))


def test_images_placed_by_a_position_mask_and_region_features():
    """Kosmos-2 places its image features where `image_embeds_position_mask` says (as many as its latent
    queries); LXMERT reads detected regions' features and boxes; X-MOD a language per row; CANINE code points."""
    kosmos = build(tf.Kosmos2Model, latent_query_num=4,
                   text_config=dict(vocab_size=99, embed_dim=32, layers=2, attention_heads=2, ffn_dim=64,
                                    max_position_embeddings=128),
                   vision_config=dict(TINY, image_size=16, patch_size=8))
    first, *_ = sample_inputs(kosmos)
    mask = first["image_embeds_position_mask"]
    assert mask.shape == first["input_ids"].shape and mask[0].tolist() == [0] + [1] * 4 + [0] * (mask.shape[1] - 5)
    assert any(n.startswith("image_to_text_projection") for n in used(kosmos, [first]))
    lxmert = build(tf.LxmertModel, hidden_size=32, num_attention_heads=2, intermediate_size=64, l_layers=1,
                   x_layers=1, r_layers=1, visual_feat_dim=12, visual_pos_dim=4, vocab_size=99)
    x = sample_inputs(lxmert)[0]
    assert x["visual_feats"].shape == (1, 8, 12) and x["visual_pos"].shape == (1, 8, 4)
    assert any(n.startswith("encoder.visn_fc") for n in used(lxmert, [x]))
    xmod = build(tf.XmodModel, **TINY, vocab_size=99, languages=["en_XX", "de_DE"])
    assert sample_inputs(xmod)[1]["lang_ids"].tolist() == [0, 1]
    canine = build(tf.CanineModel, **TINY, downsampling_rate=2, num_hash_buckets=64)
    assert int(sample_inputs(canine)[0]["input_ids"].max()) < 128


def test_navit_packed_images_get_a_strip_of_patches_and_their_sizes():
    """MiniCPM-V reads its images' patches side by side in one strip of pixels with each image's (rows, columns)
    in `target_sizes`; the decoder gets as many image tokens as the model reports (its merges: 1 per image)."""
    vision = dict(TINY, image_size=32, patch_size=8, insert_layer_id=0)
    tower = build(tf.MiniCPMV4_7VisionModel, **vision)
    (x,) = sample_inputs(tower)
    assert x["pixel_values"].shape == (1, 3, 8, 2 * 16 * 8) and x["target_sizes"].tolist() == [[4, 4]] * 2
    assert any(n.startswith("vit_merger.") for n in used(tower, [x]))
    model = build(tf.MiniCPMV4_6Model, vision_config=vision, insert_layer_id=0, image_token_id=98,
                  text_config=dict(model_type="qwen2", vocab_size=99, num_key_value_heads=2, **TINY))
    first, *_ = sample_inputs(model)
    assert first["target_sizes"].tolist() == [[4, 4]] and int((first["input_ids"] == 98).sum()) == 1
    assert any(n.startswith("vision_tower.encoder") for n in used(model, [first]))
    rope = dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.25, mrope_section=[0, 0, 1])
    v47 = build(tf.MiniCPMV4_7Model, vision_config=vision, insert_layer_id=0, image_token_id=98,
                text_config=dict(TINY, model_type="qwen3_5_text", vocab_size=99, num_key_value_heads=2, head_dim=8,
                                 layer_types=["linear_attention", "full_attention"], rope_parameters=rope))
    first, *_ = sample_inputs(v47)   # 4.7 also wants the image tokens marked in `mm_token_type_ids`
    assert torch.equal(first["mm_token_type_ids"], (first["input_ids"] == 98).long()) and "target_sizes" in first
    assert any(n.startswith("vision_tower.encoder") for n in used(v47, [first]))


def test_omni_thinker_gets_patches_and_mel_features_in_the_order_its_towers_read():
    """Qwen3-Omni's thinker registers its vision mergers before its patch embedding (the patch width is read
    from the embedding); its audio encoder's 2-D convolution reads (mels, frames), an order the trial forward
    finds. Images and audio reach their towers, at their tokens."""
    rope = dict(rope_type="default", rope_theta=1e4, mrope_section=[2, 1, 1])
    model = build(tf.Qwen3OmniMoeThinkerForConditionalGeneration, audio_token_id=98, image_token_id=97,
                  video_token_id=96, audio_start_token_id=95, vision_start_token_id=94,
                  audio_config=dict(num_mel_bins=16, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64,
                                    d_model=32, output_dim=32, downsample_hidden_size=8),
                  vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=8,
                                     out_hidden_size=32, num_position_embeddings=64, deepstack_visual_indexes=[0]),
                  text_config=dict(vocab_size=99, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2, moe_intermediate_size=16,
                                   num_experts=4, num_experts_per_tok=2, rope_parameters=rope,
                                   max_position_embeddings=256))
    first, *_ = sample_inputs(model)
    assert first["pixel_values"].shape[1] == 3 * 2 * 8 * 8 and int((first["input_ids"] == 97).sum()) == 4
    mels, frames = first["input_features"].shape[1:]
    assert mels == 16 and first["feature_attention_mask"].shape == (1, frames)
    assert int((first["input_ids"] == 98).sum()) >= 1
    names = used(model, [first])
    assert any(n.startswith("model.visual.blocks") or n.startswith("visual.blocks") for n in names)
    assert any(".audio_tower.layers" in "." + n for n in names)


@pytest.mark.skipif(not hasattr(tf, "OmniASRCTCModel"), reason="OmniASR is new in transformers 5.24")
def test_a_waveform_with_the_channel_axis_the_front_end_reads():
    """OmniASR's front end reads (batch, 1, samples): a trial forward finds it, with the weights or, streaming,
    on a meta skeleton."""
    omni = build(tf.OmniASRCTCModel, vocab_size=99, audio_config=dict(
        TINY, conv_dim=[8, 8], conv_kernel=[10, 3], conv_stride=[5, 2], num_conv_pos_embeddings=8,
        num_conv_pos_embedding_groups=2))
    x = sample_inputs(omni)[0]
    assert x["input_values"].dim() == 3 and x["input_values"].shape[1] == 1
    assert any(".layers.0." in n for n in used(omni, [x]))
    with torch.device("meta"):
        skeleton = tf.OmniASRCTCModel(omni.config)
    assert sample_inputs(skeleton)[0]["input_values"].shape == x["input_values"].shape


def test_a_spectrogram_in_the_order_and_windows_the_encoder_reads():
    """Qwen3-ASR's encoder reads (batch, mels, frames) through a 2-D convolution, in whole windows of
    2 x n_window frames: a trial forward finds the order."""
    asr = build(tf.Qwen3ASREncoder, num_mel_bins=16, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64,
                d_model=32, output_dim=32, downsample_hidden_size=8, max_position_embeddings=64)   # n_window 50
    x = sample_inputs(asr)[0]
    assert x["input_features"].shape[1] == 16 and x["input_features"].shape[2] % 100 == 0
    assert x["input_features_mask"].shape == (2, x["input_features"].shape[2])
    assert any(n.startswith("layers.0.") for n in used(asr, [x]))


def test_tiles_with_their_mask_and_a_second_high_resolution_tower():
    """Granite-Docling reads an images axis with the real tiles marked (`pixel_attention_mask`); DeepSeek-VL
    hybrid reads each image again at its SAM tower's size (`high_res_pixel_values`): both towers run."""
    text = dict(TINY, vocab_size=120, num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0)
    docling = build(tf.GraniteDoclingForConditionalGeneration, image_token_id=110, text_config=text, pad_token_id=0,
                    vision_config=dict(TINY, image_size=32, patch_size=8, out_hidden_size=32, scale_factor=2,
                                       deepstack_visual_indexes=[0]))
    first, *_ = sample_inputs(docling)
    assert first["pixel_values"].shape == (1, 1, 3, 32, 32) and first["pixel_attention_mask"].tolist() == [[True]]
    assert any(".vision_model.encoder" in "." + n for n in used(docling, [first]))
    hybrid = build(tf.DeepseekVLHybridForConditionalGeneration, image_token_id=110,
                   text_config=dict(model_type="llama", **text), vision_config=dict(TINY, image_size=32, patch_size=8),
                   high_res_vision_config=dict(TINY, image_size=64, patch_size=8, output_channels=32, window_size=2,
                                               global_attn_indexes=[1], mlp_dim=64))
    first, *_ = sample_inputs(hybrid)
    assert first["high_res_pixel_values"].shape == (1, 3, 64, 64) and int((first["input_ids"] == 110).sum()) >= 1
    assert any("high_res_vision_model" in n for n in used(hybrid, [first]))


def test_an_audio_models_split_error_is_not_read_as_image_tiles():
    """Qwen3-ASR with windows its frames do not fill reports a split-size error like LLaVA-NeXT's tile count:
    the audio trial does not take it for tiles of an image it has not got (that raised a KeyError); the audio
    is left out, the text kept."""
    audio = dict(num_mel_bins=16, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64, d_model=32,
                 output_dim=32, downsample_hidden_size=8, max_position_embeddings=64, n_window=4)
    model = build(tf.Qwen3ASRForConditionalGeneration, audio_token_id=98, pad_token_id=0, eos_token_id=1,
                  audio_config=audio, text_config=dict(TINY, vocab_size=99, num_key_value_heads=2, head_dim=16,
                                                       max_position_embeddings=128))
    batches = sample_inputs(model)
    assert all("input_features" not in x and "input_ids" in x for x in batches)


def test_whispers_features_are_built_without_a_trial_forward():
    """Whisper's features are 30 s long: a forward to try another layout would cost seconds on a real model
    (3 of them made `sample_inputs` 17 s on a Whisper-small-sized one). Its Conv1d reading the mel bins as
    channels settles the layout, so no forward runs."""
    model = build(tf.WhisperForConditionalGeneration, d_model=32, encoder_layers=1, decoder_layers=1,
                  encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                  num_mel_bins=16, max_source_positions=32, vocab_size=99, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2, decoder_start_token_id=1)
    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append(1))
    batches = sample_inputs(model)
    assert batches[0]["input_features"].shape[1:] == (16, 64) and calls == []
