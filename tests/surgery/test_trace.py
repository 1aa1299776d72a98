"""The traced plan on architectures no adapter ever described: exact to 1e-5, or refused with the norm named."""
from __future__ import annotations

import copy

import pytest
import torch
import transformers as tf
from torch import nn

import normswap
from normswap.parity import compare
from normswap.surgery import exact, find_norms
from normswap.surgery.labels import BiasPlan, Cause, NotExact
from normswap.surgery.steps import Centre, Fix, Fold, Module, Param, Scale
from helpers.exact_models import perturb, wav2vec2_config

V, D = 101, 32
LAYERS = dict(num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
VISION = dict(hidden_size=D, image_size=32, patch_size=8, **LAYERS)


def _ids(n: int = 9, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (2, n), generator=torch.Generator().manual_seed(seed))


PIXELS = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))

MODELS = {
    "gpt_bigcode": (lambda: tf.GPTBigCodeForCausalLM(tf.GPTBigCodeConfig(vocab_size=V, n_embd=D, n_layer=2,
                                                                         n_head=4, n_positions=64)),
                    {"input_ids": _ids()}),
    "stablelm": (lambda: tf.StableLmForCausalLM(tf.StableLmConfig(
        vocab_size=V, hidden_size=D, num_key_value_heads=2, partial_rotary_factor=0.25, use_qkv_bias=True,
        **LAYERS)), {"input_ids": _ids()}),
    "stablelm-parallel-qk_layernorm": (lambda: tf.StableLmForCausalLM(tf.StableLmConfig(
        vocab_size=V, hidden_size=D, num_key_value_heads=4, partial_rotary_factor=0.25, use_parallel_residual=True,
        qk_layernorm=True,
        **LAYERS)), {"input_ids": _ids()}),
    "phi-qk_layernorm": (lambda: tf.PhiForCausalLM(tf.PhiConfig(vocab_size=V, hidden_size=D, qk_layernorm=True,
                                                                **LAYERS)), {"input_ids": _ids()}),
    "vit": (lambda: tf.ViTModel(tf.ViTConfig(**VISION)), {"pixel_values": PIXELS}),
    # the mask token runs only with bool_masked_pos: a second input covers it
    "dinov2": (lambda: tf.Dinov2Model(tf.Dinov2Config(mlp_ratio=2, **{**VISION, "intermediate_size": None})),
               [{"pixel_values": PIXELS}, {"pixel_values": PIXELS, "bool_masked_pos": torch.rand(2, 16) > 0.5}]),
    "clip-text": (lambda: tf.CLIPTextModel(tf.CLIPTextConfig(vocab_size=V, hidden_size=D, max_position_embeddings=64,
                                                             **LAYERS)), {"input_ids": _ids()}),
    "clip": (lambda: tf.CLIPModel(tf.CLIPConfig(
        text_config=dict(vocab_size=V, hidden_size=D, max_position_embeddings=64, **LAYERS),
        vision_config=VISION, projection_dim=16)), {"input_ids": _ids(), "pixel_values": PIXELS}),
    # BART-style: embed_positions(inputs_embeds[..., -1]) reads the embedding only for its shape
    "mbart": (lambda: tf.MBartForConditionalGeneration(tf.MBartConfig(
        vocab_size=V, d_model=D, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64)),
        {"input_ids": _ids(), "decoder_input_ids": _ids(5)}),
    "speech2text": (lambda: tf.Speech2TextForConditionalGeneration(tf.Speech2TextConfig(
        vocab_size=V, d_model=D, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=64,
        max_target_positions=32, input_feat_per_channel=8, num_conv_layers=2, conv_channels=16,
        conv_kernel_sizes=[5, 5], input_channels=1)),
        {"input_features": torch.randn(2, 40, 8, generator=torch.Generator().manual_seed(3)),
         "decoder_input_ids": _ids(5)}),
    "wav2vec2-stable": (lambda: tf.Wav2Vec2ForCTC(
        wav2vec2_config(do_stable_layer_norm=True, feat_extract_norm="layer")),
                        {"input_values": torch.randn(2, 400, generator=torch.Generator().manual_seed(3))}),
    "whisper": (lambda: tf.WhisperForConditionalGeneration(tf.WhisperConfig(
        vocab_size=V, d_model=D, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8, max_source_positions=16,
        max_target_positions=32, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
        suppress_tokens=None, begin_suppress_tokens=None)),
        {"input_features": torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(3)),
         "decoder_input_ids": _ids(5)}),
}


def _listed(inputs) -> list[dict]:
    return inputs if isinstance(inputs, list) else [inputs]


def _build(name: str):
    make, inputs = MODELS[name]
    torch.manual_seed(0)
    return perturb(make()).eval(), inputs


@pytest.mark.parametrize("name", sorted(MODELS))
def test_traced_exact(name, feed, tmp_path):
    model, inputs = _build(name)
    feed(inputs)
    reference, naive = copy.deepcopy(model), copy.deepcopy(model)
    normswap.convert(naive, method="naive")
    assert compare(reference, naive, _listed(inputs)).max_rel > 0.05   # the perturbation matters
    report = normswap.convert(model, method="exact")
    assert not [m for m in model.modules() if isinstance(m, nn.LayerNorm)]
    # outputs the report names as not preserved (a sub-model's returned stream) are the only ones left out
    assert report.verification["enforced"]
    assert compare(reference, model, _listed(inputs), report.unverified).max_rel <= 1e-5
    normswap.save_pretrained(model, tmp_path / "m")
    loaded = normswap.from_pretrained(tmp_path / "m")
    assert compare(model, loaded, _listed(inputs)).max_abs == 0.0


def test_plan_names_sources_readers_and_bias_fate():
    model, inputs = _build("vit")
    p = exact.plan(model, find_norms(model)[0], inputs)
    ln = p.norms["layers.0.layernorm_before"]
    assert ln.sources == ["layer:embeddings.patch_embeddings.projection", "param:embeddings.cls_token",
                          "param:embeddings.position_embeddings"]
    assert sorted(ln.readers) == [f"layers.0.attention.{x}_proj" for x in "kqv"]
    final = p.norms["layernorm"]   # read by the pooler and the output: its bias stays after it
    assert final.bias is BiasPlan.AFTER and final.readers == ["pooler.dense"]
    assert {"layer:layers.1.mlp.fc2", "layer:layers.1.attention.o_proj"} < set(final.sources)
    assert {type(s) for s in p.steps} == {Centre, Fold, Fix}
    assert all(isinstance(s.target, (Module, Param)) for s in p.steps if isinstance(s, Centre))
    assert Centre(Param("embeddings.cls_token"), D) in p.steps   # a parameter named as one, not by a prefix


def test_qk_norms_centred_per_head():
    model, inputs = _build("phi-qk_layernorm")
    p = exact.plan(model, find_norms(model)[0], inputs)
    q = p.norms["model.layers.0.self_attn.q_layernorm"]
    assert q.sources == ["layer:model.layers.0.self_attn.q_proj"] and q.bias is BiasPlan.AFTER and q.width == D // 4
    assert Centre(Module("model.layers.0.self_attn.q_proj"), D // 4) in p.steps


def test_layerscale_folded_then_centred():
    model, inputs = _build("dinov2")
    p = exact.plan(model, find_norms(model)[0], inputs)
    assert "layer:encoder.layer.0.layer_scale1" in p.norms["encoder.layer.0.norm2"].sources
    i = p.steps.index(Scale(Module("encoder.layer.0.layer_scale1"), into="encoder.layer.0.attention.o_proj"))
    assert p.steps[i + 1] == Centre(Module("encoder.layer.0.attention.o_proj"), group=D)


def test_encoder_decoder_plan():
    """Whisper: the encoder stream enters its first layer after a GELU (centred at that layer's input);
    the encoder's final norm is read by every decoder layer's cross-attention keys and values."""
    model, inputs = _build("whisper")
    p = exact.plan(model, find_norms(model)[0], inputs)
    assert p.reason is None
    assert p.norms["model.encoder.layers.0.self_attn_layer_norm"].sources == ["entry:model.encoder.layers.0"]
    final = p.norms["model.encoder.layer_norm"]
    assert sorted(final.readers) == [f"model.decoder.layers.{i}.encoder_attn.{x}_proj" for i in (0, 1) for x in "kv"]
    assert final.bias is BiasPlan.AFTER   # also returned as encoder_last_hidden_state: kept as it was


def _bert():
    cfg = tf.BertConfig(vocab_size=V, hidden_size=D, max_position_embeddings=64, **LAYERS)
    return perturb(tf.BertModel(cfg)).eval()


@pytest.mark.parametrize("make, cause, named", [
    (_bert, Cause.POST_LN, "embeddings.LayerNorm"),
    (lambda: tf.OPTForCausalLM(tf.OPTConfig(vocab_size=V, hidden_size=D, ffn_dim=64, num_hidden_layers=2,
                                            num_attention_heads=4, do_layer_norm_before=False)), Cause.POST_LN, ""),
    # BLOOM's post-LN variant keeps its post-LN norms, its embedding norm exact: test_exact
    (lambda: tf.CLIPVisionModel(tf.CLIPVisionConfig(**VISION)), Cause.STREAM, ""),   # the model output reads it
])
def test_refused_from_the_graph_with_the_norm_named(make, cause, named):
    model = perturb(make()).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(NotExact) as e:
        normswap.convert(model, method="exact")
    assert e.value.cause is cause and e.value.refusal.modules[0].endswith(named)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())   # untouched


def test_post_ln_wav2vec2_keeps_its_encoder_and_converts_its_feature_projection():
    model = perturb(tf.Wav2Vec2ForCTC(wav2vec2_config(do_stable_layer_norm=False))).eval()
    reference = copy.deepcopy(model)
    report = normswap.convert(model, method="exact")
    assert [r.name for r in report.converted] == ["wav2vec2.feature_projection.layer_norm"]
    kept = {s.name: s.refusal.cause for s in report.skipped if s.refusal}
    assert kept["wav2vec2.encoder.layers.0.layer_norm"] is Cause.POST_LN and len(kept) == 5
    x = [{"input_values": torch.randn(2, 3000, generator=torch.Generator().manual_seed(3))}]
    assert compare(reference, model, x).max_rel <= 1e-5


class _Positions(nn.Embedding):
    """Reads its input for the shape only, as BART's learned positions do."""

    def forward(self, x):
        return super().forward(torch.arange(x.shape[-1]))


class _SliceToy(nn.Module):
    def __init__(self, read_values: bool):
        super().__init__()
        self.emb, self.pos = nn.Embedding(V, D), _Positions(64, D)
        self.norm, self.head, self.read_values = nn.LayerNorm(D), nn.Linear(D, V), read_values

    def forward(self, input_ids):
        x = self.emb(input_ids)
        last = x[..., -1]                       # drops the hidden dim
        x = x + self.pos(last)
        y = self.head(self.norm(x))
        return y * last.unsqueeze(-1) if self.read_values else y   # its values: a use of emb's output


@pytest.mark.parametrize("read_values", [False, True])
def test_a_hidden_dim_slice_is_a_use_only_when_its_values_are_read(read_values):
    torch.manual_seed(0)
    model = perturb(_SliceToy(read_values)).eval()
    p = exact.plan(model, find_norms(model)[0], {"input_ids": _ids()})
    if read_values:
        assert "emb writes the input of norm but its output is also read unnormalised by operation 'mul'" \
            in p.reason
    else:
        assert p.reason is None and sorted(p.norms["norm"].sources) == ["layer:emb", "layer:pos"]


class _ClampToy(nn.Module):
    def __init__(self, bound: float):
        super().__init__()
        self.emb, self.norm, self.head, self.bound = nn.Embedding(V, D), nn.LayerNorm(D), nn.Linear(D, V), bound

    def forward(self, input_ids):
        return self.head(self.norm(torch.clamp(self.emb(input_ids), -self.bound, self.bound)))


@pytest.mark.parametrize("bound, exact_ok", [(torch.finfo(torch.float16).max - 1000, True), (1.0, False)])
def test_an_overflow_clamp_keeps_the_stream_but_a_real_clamp_does_not(bound, exact_ok):
    """BART-family encoders clamp fp16 hidden states to +-(max - 1000): no value changes; clamping to +-1 does."""
    torch.manual_seed(0)
    model = perturb(_ClampToy(bound)).half().eval()
    p = exact.plan(model, find_norms(model)[0], {"input_ids": _ids()})
    assert (p.reason is None) == exact_ok
    if not exact_ok:
        assert "clamp" in p.reason


def test_inspect_shows_the_traced_plan(tmp_path):
    import json
    from click.testing import CliRunner
    from normswap.cli import main
    from helpers.exact_models import build
    build("gpt2").save_pretrained(tmp_path / "gpt2")
    shown = CliRunner().invoke(main, ["inspect", str(tmp_path / "gpt2")]).output
    assert "transformer.h.0.ln_1  LayerNorm" in shown and "(exact: bias folded)" in shown
    assert ("    sources: layer:transformer.wpe, layer:transformer.wte\n"
            "    readers: transformer.h.0.attn.c_attn") in shown
    rows = json.loads(CliRunner().invoke(main, ["inspect", str(tmp_path / "gpt2"), "--json"]).output)["norms"]
    final = next(r for r in rows if r["name"] == "transformer.ln_f")
    assert final["plan"]["readers"] == ["lm_head"] and final["plan"]["bias"] == "fold"
    assert len(final["plan"]["sources"]) == 6 and final["plan"]["reason"] is None   # wte, wpe, 2 x (attn, mlp)
    _bert().save_pretrained(tmp_path / "bert")
    shown = CliRunner().invoke(main, ["inspect", str(tmp_path / "bert")]).output
    assert "    not exact: embeddings.LayerNorm is post-LN" in shown


@pytest.mark.parametrize("name", ["whisper", "clip", "mbart", "speech2text", "wav2vec2-stable"])
def test_default_sample_inputs_drive_encoder_decoders_and_two_towers(name):
    """No fed inputs: parity.sample_inputs builds input_features + decoder ids (Whisper, Speech2Text), token
    ids + pixels (CLIPModel), token + decoder ids (mBART) and a waveform (wav2vec2) from the signature and
    config, and the traced conversion is exact with them."""
    model = _build(name)[0]
    report = normswap.convert(model, method="exact")
    assert report.method == "exact" and report.verification["max_rel"] <= 1e-5
    assert not any(isinstance(m, torch.nn.LayerNorm) for m in model.modules())


def test_outputs_not_preserved_are_named_at_every_load(feed, tmp_path):
    """CLIPModel returns the vision tower's unnormalised stream: left out of verification, named in the report,
    recorded in the folder, and named again whenever the folder loads (the same code runs in plain transformers)."""
    model, inputs = _build("clip")
    feed(inputs)
    reference = copy.deepcopy(model)
    report = normswap.convert(model, method="exact")
    assert list(report.unverified) == ["vision_model_output.last_hidden_state"]
    assert "vision_model_output.last_hidden_state" in report.verification["excluded"]
    assert "vision_model_output.last_hidden_state" not in report.verification["compared"]
    # it does change (so naming it is not idle), and nothing else does
    assert compare(reference, model, _listed(inputs)).worst == "vision_model_output.last_hidden_state"
    normswap.save_pretrained(model, tmp_path / "m")
    with pytest.warns(UserWarning, match=r"except .*vision_model_output\.last_hidden_state \(the residual stream"):
        normswap.from_pretrained(tmp_path / "m")
