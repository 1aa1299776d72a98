"""Planner correctness (norms called twice, readers shared by norms, convolutions that cannot be centred),
coverage (writers the sample inputs never ran), returned outputs, and `auto` always ending in a model or a
clean refusal."""
from __future__ import annotations

import copy
import re
from dataclasses import dataclass

import pytest
import torch
import transformers as tf
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_outputs import BaseModelOutputWithPooling, CausalLMOutput
from transformers.utils import ModelOutput

import normswap
from normswap.errors import NormswapError
from normswap.parity import compare
from normswap.models.inputs import examples
from normswap.surgery import exact, find_norms
from normswap.surgery.labels import BiasPlan, Cause, NotExact
from normswap.surgery.steps import Fold
from normswap.surgery.walk import Skip
from helpers.exact_models import perturb

V, D = 50, 16
G = torch.Generator().manual_seed(11)


def ids(b: int = 2, n: int = 8) -> torch.Tensor:
    return torch.randint(0, V, (b, n), generator=G)


def _fresh(make):
    torch.manual_seed(0)
    return perturb(make()).eval()


def _outputs(model, inputs) -> dict:
    with torch.no_grad():
        out = model(**inputs)
    return {k: v for k, v in out.items() if isinstance(v, torch.Tensor) and v.is_floating_point()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / a.abs().max()).item()


class TwoStreams(nn.Module):
    """PegasusX-like: a token stream and a global stream; q is shared by both streams' norms; the final norm
    runs once per stream, its reader too."""

    def __init__(self):
        super().__init__()
        self.config = PretrainedConfig()
        self.emb, self.glob = nn.Embedding(V, D), nn.Parameter(torch.randn(2, D, generator=G))
        self.ln_tok, self.ln_glob, self.q, self.o = nn.LayerNorm(D), nn.LayerNorm(D), nn.Linear(D, D), nn.Linear(D, D)
        self.ln_f, self.head = nn.LayerNorm(D), nn.Linear(D, V)

    def forward(self, input_ids):
        x = self.emb(input_ids)
        g = self.glob.expand(x.shape[0], -1, -1)
        x = x + self.o(self.q(self.ln_tok(x)).tanh())
        g = g + self.o(self.q(self.ln_glob(g)).tanh())
        return CausalLMOutput(logits=self.head(self.ln_f(x)) + self.head(self.ln_f(g)).mean(1, keepdim=True))


def test_norm_called_twice_and_reader_shared_by_two_norms(feed):
    model = _fresh(TwoStreams)
    p = exact.plan(model, find_norms(model)[0], {"input_ids": ids()})
    final = p.norms["ln_f"]
    assert final.readers == ["head"] and final.bias is BiasPlan.FOLD        # listed once, folded once
    assert "param:glob" in final.sources and "layer:emb" in final.sources   # both calls' inputs
    assert [s for s in p.steps if isinstance(s, Fold) and s.reader == "head"] == [Fold("head", "ln_f")]
    assert p.norms["ln_tok"].bias is p.norms["ln_glob"].bias is BiasPlan.AFTER   # q reads both: no single fold
    reference = copy.deepcopy(model)
    feed({"input_ids": ids()})
    assert normswap.convert(model, method="exact").method == "exact"
    assert compare(reference, model, [{"input_ids": ids(3, 5)}]).max_rel <= 1e-5


def test_pegasus_x_converts_exactly():
    """q/k/v shared by the token and global norms, final_layer_norm called twice per layer."""
    cfg = tf.PegasusXConfig(vocab_size=V, d_model=D, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                            decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, num_global_tokens=2,
                            block_size=4, max_position_embeddings=64)
    model = _fresh(lambda: tf.PegasusXForConditionalGeneration(cfg))
    reference = copy.deepcopy(model)
    report = normswap.convert(model, method="exact")
    assert report.method == "exact"
    x = {"input_ids": ids(3, 8), "decoder_input_ids": ids(3, 5)}
    for name, ref in _outputs(reference, x).items():   # logits and encoder_last_hidden_state alike
        assert _rel(ref, _outputs(model, x)[name]) <= 1e-5, name


class ConvStream(nn.Module):
    def __init__(self, groups: int):
        super().__init__()
        self.config = PretrainedConfig()
        self.emb, self.ln, self.conv = nn.Embedding(V, D), nn.LayerNorm(D), nn.Conv1d(D, D, 3, padding=1, groups=groups)
        self.ln_f, self.head = nn.LayerNorm(D), nn.Linear(D, V)

    def forward(self, input_ids):
        x = self.emb(input_ids)
        x = x + self.conv(self.ln(x).transpose(1, 2)).transpose(1, 2)
        return CausalLMOutput(logits=self.head(self.ln_f(x)))


@pytest.mark.parametrize("groups, kind", [(1, None), (D, "depthwise"), (4, "grouped")])
def test_convolutions_centred_only_when_not_grouped(groups, kind, feed):
    model = _fresh(lambda: ConvStream(groups))
    feed({"input_ids": ids()})
    if kind is None:
        reference = copy.deepcopy(model)
        normswap.convert(model, method="exact")
        assert compare(reference, model, [{"input_ids": ids(3, 5)}]).max_rel <= 1e-5
        return
    # the other norm is exact; ln_f stays a LayerNorm (mean-blind), named with the cause
    reference = copy.deepcopy(model)
    report = normswap.convert(model, method="exact")
    assert [s.name for s in report.skipped] == ["ln_f"] and isinstance(model.ln_f, nn.LayerNorm)
    assert report.skipped[0].cause is Skip.KEPT and report.skipped[0].refusal.cause is Cause.UNCENTRABLE
    assert re.search(f"conv .Conv1d. writes the input of ln_f and cannot be centred: a {kind}",
                     report.skipped[0].reason)
    assert compare(reference, model, [{"input_ids": ids(3, 5)}]).max_rel <= 1e-5


class RmsStream(nn.Module):
    """A stream read by a LayerNorm and by an RMSNorm of the model's own (LFM's vision tower): centring the
    stream would change the RMSNorm's output."""

    def __init__(self):
        super().__init__()
        self.config = PretrainedConfig()
        self.emb, self.ln, self.lin = nn.Embedding(V, D), nn.LayerNorm(D), nn.Linear(D, D)
        self.rms, self.lin2 = nn.RMSNorm(D), nn.Linear(D, D)
        self.ln_f, self.head = nn.LayerNorm(D), nn.Linear(D, V)

    def forward(self, input_ids):
        x = self.emb(input_ids)
        x = x + self.lin(self.ln(x))
        x = x + self.lin2(self.rms(x))
        return CausalLMOutput(logits=self.head(self.ln_f(x)))


def test_a_stream_an_rmsnorm_reads_is_not_centred(feed):
    """Refused naming the RMSNorm as the cause (the trace used to miss it and only the rehearsal refused, with
    no cause); an RMSNorm reading centred rows is a norm the stream feeds (converted by an earlier pass: see
    test_exact_in_two_filtered_passes)."""
    model = _fresh(RmsStream)
    feed({"input_ids": ids()})
    with pytest.raises(NotExact) as e:
        normswap.convert(model, method="exact")
    assert e.value.cause is Cause.READ and e.value.refusal.modules == ("emb", "ln")
    assert "also read by rms (RMSNorm), an RMSNorm" in str(e.value)   # the reader named


def test_convnext_block_norms_refused_up_front_naming_the_depthwise_conv():
    cfg = tf.ConvNextConfig(num_channels=3, num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], image_size=32)
    model = _fresh(lambda: tf.ConvNextModel(cfg))
    with pytest.raises(NotExact) as e:
        normswap.convert(model, method="exact", filter_fn=lambda m, n: ".layers." in n)
    assert e.value.cause is Cause.UNCENTRABLE and e.value.refusal.modules[0].endswith(".dwconv")
    assert "a depthwise convolution" in str(e.value)


class Optional(nn.Module):
    """A writer only some inputs run: image features (Fuyu's vision_embed_tokens), a mask token (DINOv2)."""

    def __init__(self):
        super().__init__()
        self.config = PretrainedConfig()
        self.emb, self.image_proj = nn.Embedding(V, D), nn.Linear(6, D)
        self.mask_token = nn.Parameter(torch.randn(D, generator=G))
        self.ln_f, self.head = nn.LayerNorm(D), nn.Linear(D, V)

    def forward(self, input_ids, image=None, bool_masked_pos=None):
        x = self.emb(input_ids)
        if image is not None:
            x = torch.cat([self.image_proj(image), x], dim=1)
        if bool_masked_pos is not None:
            x = torch.where(bool_masked_pos[..., None], self.mask_token, x)
        return CausalLMOutput(logits=self.head(self.ln_f(x)))


def _optional_inputs(b: int = 2) -> list[dict]:
    n = 8
    return [{"input_ids": ids(b, n)},
            {"input_ids": ids(b, n), "image": torch.randn(b, 3, 6, generator=G),
             "bool_masked_pos": torch.rand(b, n + 3, generator=G) > 0.5}]


def test_an_untraced_writer_is_refused_by_exact_and_named_by_auto(feed):
    model = _fresh(Optional)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    feed(_optional_inputs()[:1])
    with pytest.raises(NotExact) as e:
        normswap.convert(model, method="exact")
    assert e.value.cause is Cause.UNRUN and e.value.refusal.modules == ("mask_token", "image_proj")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    report = normswap.convert(model, method="auto")
    assert report.method == "naive" and "image_proj (Linear)" in report.warnings[0]


def test_inputs_that_run_every_path_make_it_exact(feed):
    model = _fresh(Optional)
    reference = copy.deepcopy(model)
    feed(_optional_inputs())
    assert normswap.convert(model, method="exact").method == "exact"
    assert compare(reference, model, _optional_inputs(3)).max_rel <= 1e-5   # image and mask paths, other rows


@dataclass
class TowerOutput(ModelOutput):
    logits: torch.Tensor | None = None
    tower: BaseModelOutputWithPooling | None = None


class Tower(nn.Module):
    """A sub-model whose last_hidden_state is its stream (CLIP's vision tower) inside a model whose own
    outputs come through norms; `own=True` returns that stream as a top-level output instead."""

    def __init__(self, own: bool):
        super().__init__()
        self.config = PretrainedConfig()
        self.emb, self.ln, self.fc = nn.Embedding(V, D), nn.LayerNorm(D), nn.Linear(D, D)
        self.post, self.proj, self.own = nn.LayerNorm(D), nn.Linear(D, 4), own

    def forward(self, input_ids):
        x = self.emb(input_ids)
        x = x + self.fc(self.ln(x))
        pooled = self.post(x[:, 0])
        if self.own:
            return BaseModelOutputWithPooling(last_hidden_state=self.proj(pooled), pooler_output=x)
        return TowerOutput(logits=self.proj(pooled), tower=BaseModelOutputWithPooling(last_hidden_state=x,
                                                                                     pooler_output=pooled))


def test_a_sub_models_stream_is_listed_as_not_preserved(feed):
    model = _fresh(lambda: Tower(False))
    reference = copy.deepcopy(model)
    feed({"input_ids": ids()})
    report = normswap.convert(model, method="exact")
    assert report.not_preserved["tower.last_hidden_state"].startswith("the residual stream")
    assert "hidden_states" in report.not_preserved
    assert "not preserved: tower.last_hidden_state" in report.to_table()
    x = {"input_ids": ids(3, 5)}
    with torch.no_grad():
        ref, out = reference(**x), model(**x)
    assert _rel(ref["logits"], out["logits"]) <= 1e-5
    assert _rel(ref["tower"].pooler_output, out["tower"].pooler_output) <= 1e-5   # a norm's output: bias kept


class Reread(Tower):
    """Tower whose pooled post-norm output, returned inside the sub-model's output, is read by another norm
    (PaddleOCR-VL's projector norm over the vision tower's post-norm)."""

    def __init__(self):
        super().__init__(False)
        self.pre = nn.LayerNorm(D)

    def forward(self, input_ids):
        x = self.emb(input_ids)
        x = x + self.fc(self.ln(x))
        pooled = self.post(x[:, 0])
        return TowerOutput(logits=self.proj(self.pre(pooled)),
                           tower=BaseModelOutputWithPooling(last_hidden_state=x, pooler_output=pooled))


def test_a_returned_norm_output_that_another_norm_reads_is_listed_as_not_preserved(feed):
    model = _fresh(Reread)
    reference = copy.deepcopy(model)
    feed({"input_ids": ids()})
    report = normswap.convert(model, method="exact")
    assert report.not_preserved["tower.pooler_output"].startswith("a norm's output that another norm reads, "
                                                                  "returned centred")
    x = {"input_ids": ids(3, 5)}
    with torch.no_grad():
        ref, out = reference(**x), model(**x)
    assert _rel(ref["logits"], out["logits"]) <= 1e-5
    pooled = ref["tower"].pooler_output
    assert _rel(pooled - pooled.mean(-1, keepdim=True), out["tower"].pooler_output) <= 1e-5   # as said: centred


def test_the_models_own_stream_output_is_refused(feed):
    feed({"input_ids": ids()})
    with pytest.raises(NotExact) as e:
        normswap.convert(_fresh(lambda: Tower(True)), method="exact")
    assert e.value.cause is Cause.STREAM and "the model output 'pooler_output'" in str(e.value)


def test_encoder_outputs_are_preserved():
    """The encoder's final norm is read by cross-attention and returned as encoder_last_hidden_state: its
    bias stays after it instead of being folded away (Blenderbot, M2M100, BigBird-Pegasus...)."""
    cfg = tf.BlenderbotConfig(vocab_size=V, d_model=D, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                              decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
                              max_position_embeddings=64)
    model = _fresh(lambda: tf.BlenderbotForConditionalGeneration(cfg))
    reference = copy.deepcopy(model)
    report = normswap.convert(model, method="exact")
    assert report.method == "exact"
    x = {"input_ids": ids(3, 7), "decoder_input_ids": ids(3, 4)}
    ref, out = _outputs(reference, x), _outputs(model, x)
    assert set(ref) >= {"logits", "encoder_last_hidden_state"}
    assert all(_rel(ref[k], out[k]) <= 1e-5 for k in ref)


def test_auto_falls_back_when_the_rehearsal_fails_and_leaves_the_model_as_naive_would(forgetful):
    """A plan that misses a source fails its rehearsal before any edit: auto converts naively, and the result
    is bit-identical to a naive conversion of the untouched model."""
    from helpers.exact_models import build
    model, twin = build("gpt2"), build("gpt2")
    report = normswap.convert(model, method="auto")
    assert report.method == "naive" and "failed verification before any edit" in report.warnings[0]
    normswap.convert(twin, method="naive")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), twin.state_dict().values()))
    with pytest.raises(NotExact) as e:
        normswap.convert(build("gpt2"), method="exact")
    assert e.value.cause is Cause.UNVERIFIED


def test_auto_falls_back_when_no_sample_input_can_be_built(monkeypatch):
    from helpers.exact_models import build

    def none(model, *a, **k):
        raise NormswapError("cannot build sample inputs for a model whose main input is 'states'")
    monkeypatch.setattr(examples, "sample_inputs", none)
    report = normswap.convert(build("gpt2"), method="auto")
    assert report.method == "naive" and "no sample input to trace it" in report.warnings[0]


def test_rwkv_converts_the_norms_its_gated_mix_does_not_reach():
    """RWKV's gated channel mix (a per-channel gate) makes the stream opaque: the norms reading it stay, named with
    that cause; the next block's norms read a stream that enters it centred and convert."""
    model = _fresh(lambda: tf.RwkvForCausalLM(tf.RwkvConfig(vocab_size=V, hidden_size=D, num_hidden_layers=2,
                                                            attention_hidden_size=D, context_length=32)))
    reference = copy.deepcopy(model)
    report = normswap.convert(model, method="exact")
    assert {r.name for r in report.converted} == {"rwkv.blocks.1.ln1", "rwkv.blocks.1.ln2"}
    assert {s.refusal.cause for s in report.skipped} == {Cause.MIXED, Cause.OPAQUE}
    x = [{"input_ids": torch.randint(0, V, (3, 9), generator=torch.Generator().manual_seed(5))}]
    assert compare(reference, model, x).max_rel <= 1e-5


@pytest.mark.parametrize("make, cause", [
    # the projector reads both towers' raw streams: one such norm per tower is no post-LN chain
    (lambda: tf.VideoLlavaForConditionalGeneration(tf.VideoLlavaConfig(
        vision_config=dict(model_type="clip_vision_model", hidden_size=D, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=2, image_size=16, patch_size=8),
        text_config=dict(model_type="llama", vocab_size=V, hidden_size=D, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256),
        image_token_index=V - 1, video_token_index=V - 2)), Cause.READ),
])
def test_refusals_name_the_true_cause(make, cause):
    with pytest.raises(NotExact) as e:
        normswap.convert(_fresh(make), method="exact")
    assert e.value.cause is cause


def test_a_norm_applied_twice_stays_a_layernorm_and_the_rest_is_exact():
    """BLIP-2's vision post_layernorm also normalises its own output: it stays, named; the encoder is exact."""
    model = _fresh(lambda: tf.Blip2VisionModel(tf.Blip2VisionConfig(
        hidden_size=D, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=8)))
    reference = copy.deepcopy(model)
    report = normswap.convert(model, method="exact")
    assert [s.name for s in report.skipped] == ["post_layernorm"]
    assert report.skipped[0].refusal.cause is Cause.REAPPLIED
    x = [{"pixel_values": torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(7))}]
    assert compare(reference, model, x).max_rel <= 1e-5


class Spare(nn.Module):
    """Weights built but never called by any code (kept for checkpoints, as Wav2Vec2-Conformer's positional
    convolution): not an untraced writer."""

    def __init__(self):
        super().__init__()
        self.config = PretrainedConfig()
        self.emb, self.ln_f, self.head = nn.Embedding(V, D), nn.LayerNorm(D), nn.Linear(D, V)
        self.leftover = nn.Linear(D, D)

    def forward(self, input_ids):
        return CausalLMOutput(logits=self.head(self.ln_f(self.emb(input_ids))))


def test_weights_no_code_reads_do_not_block_exact(feed):
    feed({"input_ids": ids()})
    assert normswap.convert(_fresh(Spare), method="exact").method == "exact"


@pytest.mark.parametrize("in_memory", [[], ["--allow-missing-weights"]])   # streamed, or loaded whole
def test_cli_auto_converts_naively_after_a_failed_verification(forgetful, monkeypatch, tmp_path, in_memory):
    """The edits were made (the rehearsal skipped here) and verification fails: the CLI under auto converts
    the source again, naively, says why, and exits 0; under exact it exits 1 and writes nothing."""
    import json
    from click.testing import CliRunner
    from normswap.cli import main
    from helpers.exact_models import build
    monkeypatch.setattr(exact, "rehearse", lambda *a, **k: None)
    build("gpt2").save_pretrained(tmp_path / "src")
    run = CliRunner().invoke(main, ["convert", str(tmp_path / "src"), "--to", "rmsnorm", "-o", str(tmp_path / "a"),
                                    "--json", *in_memory])
    assert run.exit_code == 0, run.output
    out = json.loads(run.stdout)
    assert out["report"]["method"] == "naive" and "failed verification" in out["report"]["warnings"][0]
    assert out["parity"]["max_rel"] > 1e-3   # the naive model, measured
    run = CliRunner().invoke(main, ["convert", str(tmp_path / "src"), "--to", "rmsnorm", "--method", "exact",
                                    "-o", str(tmp_path / "e"), *in_memory])
    assert run.exit_code == 1 and "failed verification" in run.output and not (tmp_path / "e").exists()


class TrainingOnly(nn.Module):
    """A token only training writes into the stream (wav2vec2's SpecAugment embedding); `noisy`: training
    then multiplies the stream by noise, so what the token does there cannot be told."""

    def __init__(self, noisy: bool):
        super().__init__()
        self.config = PretrainedConfig()
        self.emb, self.ln_f, self.head = nn.Embedding(V, D), nn.LayerNorm(D), nn.Linear(D, V)
        self.spec = nn.Parameter(torch.randn(D, generator=G))
        self.noisy = noisy

    def forward(self, input_ids):
        x = self.emb(input_ids)
        if self.training:
            x = torch.where(torch.rand(x.shape[:2])[..., None] > 0.5, self.spec, x)
            if self.noisy:
                x = x * (1 + 0.1 * torch.rand_like(x))
        return CausalLMOutput(logits=self.head(self.ln_f(x)))


@pytest.mark.parametrize("noisy", [False, True])
def test_a_writer_only_training_runs_is_traced_in_training_mode(noisy, feed):
    model = _fresh(lambda: TrainingOnly(noisy))
    reference = copy.deepcopy(model)
    feed({"input_ids": ids()})
    if noisy:
        with pytest.raises(NotExact) as e:
            normswap.convert(model, method="exact")
        assert e.value.cause is Cause.UNRUN and e.value.refusal.modules == ("spec",)
        return
    x = {"input_ids": ids()}
    rng = torch.get_rng_state()
    p = exact.plan(model, find_norms(model)[0], x)
    assert torch.equal(rng, torch.get_rng_state()) and not model.training   # left as it was
    assert "param:spec" in p.norms["ln_f"].sources
    assert normswap.convert(model, method="exact").method == "exact"
    assert compare(reference, model, [{"input_ids": ids(3, 5)}]).max_rel <= 1e-5
    model.train(), reference.train()
    x = {"input_ids": ids(3, 5)}
    torch.manual_seed(3)
    with torch.no_grad():
        a = reference(**x).logits
    torch.manual_seed(3)
    with torch.no_grad():
        b = model(**x).logits
    assert _rel(a, b) <= 1e-5   # the token is centred: training-mode outputs are the original's too


def test_streaming_refuses_an_untraced_writer_too(monkeypatch, tmp_path):
    """The streamed conversion plans on a lazy model whose loader touches every parameter of a module it
    enters: only a read of its values counts as running (DINOv2's mask token, without bool_masked_pos)."""
    from normswap.pipeline import lazy_convert
    cfg = tf.Dinov2Config(hidden_size=D, num_hidden_layers=2, num_attention_heads=2, mlp_ratio=2, image_size=32,
                          patch_size=8)
    _fresh(lambda: tf.Dinov2Model(cfg)).save_pretrained(tmp_path / "src")
    pixels = [{"pixel_values": torch.randn(2, 3, 32, 32, generator=G)}]
    monkeypatch.setattr(lazy_convert, "model_inputs", lambda *a, **k: pixels)
    with pytest.raises(NotExact) as e:
        lazy_convert.convert_folder(tmp_path / "src", tmp_path / "out", method="exact")
    assert e.value.cause is Cause.UNRUN and e.value.refusal.modules == ("embeddings.mask_token",)
    assert not (tmp_path / "out").exists()
