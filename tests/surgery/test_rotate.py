"""Rotation of an exactly converted model's residual streams: outputs kept, every part rotated, refusals named."""
from __future__ import annotations

import copy

import pytest
import torch
import transformers as tf
from torch import nn

import normswap
from normswap.errors import NormswapError
from normswap.parity import compare
from normswap.surgery.rotate import NotRotatable, rotate
from helpers.exact_models import build, padded_batches, perturb
from helpers.reload_models import MAKERS
from helpers.user_models import gpt, perturbed

ROTATABLE = ["bloom", "codegen", "falcon-new", "falcon-parallel", "falcon-sequential-alibi", "gpt2", "gpt2-headless",
             "gpt_neo", "gpt_neox-parallel", "gpt_neox-sequential", "gptj", "mbart", "opt", "opt-project", "phi"]
# the norms given a d x d matrix after them: a returned output kept unrotated, or an input (the embeddings)
UNROTATED = {"gpt2-headless": {"ln_f": "output"}, "bloom": {"transformer.word_embeddings_layernorm": "input"},
             "mbart": {"model.encoder.layer_norm": "output", "model.encoder.layernorm_embedding": "input",
                       "model.decoder.layernorm_embedding": "input"}}


def _converted(model: nn.Module, examples=None) -> tuple[nn.Module, nn.Module]:
    """(the model converted exactly, a copy of it before rotation)."""
    normswap.convert(model, method="exact", example_inputs=examples)
    return model, copy.deepcopy(model)


@pytest.mark.parametrize("name", ROTATABLE)
def test_rotated_family_keeps_its_outputs_in_fp64(name):
    original = build(name).double()
    model, before = _converted(copy.deepcopy(original))
    report = rotate(model, method="hadamard", seed=3)
    assert report.verification["max_rel"] <= 1e-4
    # normswap's RMSNorm computes in fp32 even for fp64 tensors: ~1e-7 is that rounding, not the rotation
    assert compare(before, model, padded_batches()).max_rel < 1e-5
    assert compare(original, model, padded_batches()).max_rel < 1e-5
    # the streams really are rotated: every writer and reader changed, every norm gain folded to 1 (a norm
    # writing the stream: into the matrix after it, which mixes the channels)
    unrotated = UNROTATED.get(name, {})
    for stream in report.streams:
        for part in [*stream["writers"], *stream["readers"]]:
            if part in unrotated:
                continue
            old, new = before.get_submodule(part).weight, model.get_submodule(part).weight
            assert (new - old).norm() > 0.3 * old.norm(), part
    assert all(bool((m.weight == 1).all()) for m in model.modules() if isinstance(m, normswap.RMSNorm))
    assert [s["q"] for s in report.streams] == ["randomised Hadamard"] * (2 if name == "mbart" else 1)
    assert "rotated" in model.config.normswap["not_preserved"]["hidden_states"]   # said on every load
    assert {n: why.split()[1] for n, why in report.unrotated.items()} == unrotated
    for norm in unrotated:
        m = model.get_submodule(norm).normswap_matrix
        assert (m - torch.diag(torch.diagonal(m))).abs().max() > 0.1, norm   # a rotation, not a gain
        assert model.config.normswap["output_fixes"][norm] == {"centre": False, "bias": 32, "matrix": 32}
    head, embedding = before.get_output_embeddings(), before.get_input_embeddings()
    tied = head is not None and head.weight is embedding.weight
    head_reads_stream = "lm_head" in report.streams[-1]["readers"]   # OPT with a projection: reads project_out
    untied = ["lm_head.weight"] if tied and head_reads_stream else []
    if name == "mbart":   # tied to `shared` by the flag that tied the head (off: loading would not tie them)
        untied += ["model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight"]
    assert report.untied == untied
    if head is not None:
        assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == \
            (tied and not head_reads_stream)
    if name == "mbart":   # the cross-attention reads the encoder's final norm, kept unrotated: left as it was
        for proj in ("k_proj", "v_proj"):
            part = f"model.decoder.layers.0.encoder_attn.{proj}"
            assert torch.equal(model.get_submodule(part).weight, before.get_submodule(part).weight)


def test_a_wrong_rotation_is_caught_by_verification(monkeypatch):
    """The check can fail: a stream rotated with a non-orthogonal matrix is refused after the edits."""
    from normswap.surgery import rotate as rotate_mod
    model, _ = _converted(build("gpt2"))
    monkeypatch.setattr(rotate_mod, "rotation", lambda n, method, seed: (2 * torch.eye(n, dtype=torch.float64), "x"))
    with pytest.raises(NormswapError, match=r"rotation failed verification.*discard it"):
        rotate(model)


def test_vit_rotates_with_both_methods():
    for method, q in (("hadamard", "randomised Hadamard"), ("random", "random orthogonal")):
        torch.manual_seed(0)
        config = tf.ViTConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                              image_size=16, patch_size=8, num_labels=5)
        original = build_vit = tf.ViTForImageClassification(config).eval()
        with torch.no_grad():
            for m in original.modules():
                if isinstance(m, nn.LayerNorm):
                    m.weight.uniform_(0.5, 1.5)
                    m.bias.normal_(0.2, 0.5)
        model, before = _converted(copy.deepcopy(build_vit))
        report = rotate(model, method=method, seed=1)
        assert [s["q"] for s in report.streams] == [q]
        x = {"pixel_values": torch.randn(3, 3, 16, 16)}
        assert compare(original, model, [x]).max_rel < 1e-5
        patch = model.vit.embeddings.patch_embeddings.projection.weight   # a Conv2d writer: rotated
        old = before.vit.embeddings.patch_embeddings.projection.weight
        assert (patch - old).norm() > 0.5 * old.norm()


class LinearGPT(nn.Module):
    """A hand-written pre-LN GPT with Linear attention (q, k, v, o), width 36: no Hadamard matrix of that order."""

    def __init__(self, vocab: int = 61, d: int = 36, layers: int = 2):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Parameter(torch.randn(64, d) * 0.1 + 0.2)
        self.ln1 = nn.ModuleList(nn.LayerNorm(d) for _ in range(layers))
        self.qkv = nn.ModuleList(nn.Linear(d, 3 * d) for _ in range(layers))
        self.o = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))
        self.ln2 = nn.ModuleList(nn.LayerNorm(d) for _ in range(layers))
        self.mlp = nn.ModuleList(nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
                                 for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe[:t]
        for ln1, qkv, o, ln2, mlp in zip(self.ln1, self.qkv, self.o, self.ln2, self.mlp):
            q, k, v = qkv(ln1(x)).chunk(3, -1)
            a = torch.softmax(q @ k.transpose(-1, -2) / 6 + torch.triu(torch.full((t, t), -1e9), 1), -1)
            x = x + o(a @ v)
            x = x + mlp(ln2(x))
        return self.head(self.ln_f(x))


def test_user_module_with_example_inputs_rotates_with_a_random_orthogonal_matrix():
    torch.manual_seed(0)
    original = perturbed(LinearGPT())
    examples = [torch.randint(0, 61, (2, 16))]
    model, _ = _converted(copy.deepcopy(original), examples)
    report = rotate(model, method="hadamard", seed=0, example_inputs=examples)
    assert [s["q"] for s in report.streams] == ["random orthogonal (no Hadamard of order 36 known)"]
    assert "param:wpe" in report.streams[0]["writers"] and "head" in report.streams[0]["readers"]
    others = torch.randint(0, 61, (3, 40))
    with torch.no_grad():
        ref, out = original(others), model(others)
    assert ((out - ref).abs().max() / ref.abs().max()).item() < 1e-5
    assert normswap.rotate(model, method="random", seed=5, example_inputs=examples).verification["max_rel"] < 1e-4


# ---- refusals: one per case, each naming the part --------------------------------------------------------

def test_refuses_a_model_with_layernorms_left():
    with pytest.raises(NotRotatable, match=r"transformer\.h\.0\.ln_1 \(LayerNorm\) is a LayerNorm: convert"):
        rotate(build("gpt2"))


def test_refuses_a_layernorm_the_exact_conversion_kept_without_asking_to_convert_again():
    """Wav2Vec2-BERT converts exactly with its depthwise norms kept: asking for a conversion again would change
    nothing, so the refusal says the conversion kept it."""
    model = perturb(MAKERS["wav2vec2-bert"]()).eval()
    report = normswap.convert(model, method="exact")
    kept = [s.name for s in report.skipped]
    assert kept and all("depthwise_layer_norm" in n for n in kept)
    with pytest.raises(NotRotatable, match=rf"{kept[0]} \(LayerNorm\) is a LayerNorm the conversion kept") as e:
        rotate(model)
    assert "convert the model" not in str(e.value)


def test_refuses_prmsnorm():
    model = build("gpt2")
    normswap.convert(model, to="prmsnorm", method="exact")
    with pytest.raises(NotRotatable, match=r"transformer\.h\.0\.ln_1 is a pRMSNorm"):
        rotate(model)


class EmbeddingNorms(nn.Module):
    """An embedding norm writing the stream (as BLOOM's): `shared`, the embedding is also added to the stream
    unnormalised (read by a norm whose input stays unrotated and by the rotated stream); `stacked`, a second
    norm normalises the embedding norm's output and writes the stream."""

    def __init__(self, shared: bool = False, stacked: bool = False, d: int = 16):
        super().__init__()
        self.shared, self.stacked = shared, stacked
        self.emb, self.norm_e, self.norm_s = nn.Embedding(11, d), nn.LayerNorm(d), nn.LayerNorm(d) if stacked else None
        self.norm, self.mlp, self.final, self.head = nn.LayerNorm(d), nn.Linear(d, d), nn.LayerNorm(d), nn.Linear(d, 11)

    def forward(self, idx):
        e = self.emb(idx)
        x = self.norm_e(e)
        x = self.norm_s(x) if self.stacked else x + e if self.shared else x
        x = x + self.mlp(self.norm(x))
        return self.head(self.final(x))


def test_refuses_a_norm_writing_the_stream_from_a_rotated_input_or_normalised_again():
    examples = torch.randint(0, 11, (2, 5))
    for kw, match in (({"shared": True}, r"^emb is read by norm_e, which writes a stream from an unrotated input, "
                                         r"and by norm, whose stream is rotated"),
                      ({"stacked": True}, r"^norm_e's output is normalised again by norm_s, which writes a stream")):
        model, _ = _converted(perturbed(EmbeddingNorms(**kw)), examples)
        with pytest.raises(NotRotatable, match=match):
            rotate(model, example_inputs=examples)
    original = perturbed(EmbeddingNorms())   # the embedding norm alone: rotated, its input kept
    model, _ = _converted(copy.deepcopy(original), examples)
    assert list(rotate(model, example_inputs=examples).unrotated) == ["norm_e"]
    x = torch.randint(0, 11, (3, 9))
    with torch.no_grad():
        assert torch.allclose(model(x), original(x), rtol=1e-5, atol=1e-5)


def test_norms_read_by_multihead_attention_keep_their_outputs_unrotated():
    examples = [torch.randint(0, 61, (2, 16)), {"idx": torch.randint(0, 61, (1, 5)), "prefix": torch.randn(1, 8)}]
    original = gpt()
    model, _ = _converted(copy.deepcopy(original), examples)
    report = rotate(model, example_inputs=examples)
    assert report.unrotated == {f"blocks.{i}.ln_1": f"its output stays unrotated, read by nn.MultiheadAttention in "
                                f"blocks.{i}.attn: a 32 x 32 matmul after it" for i in (0, 1)}
    assert "unrotated: blocks.0.ln_1 (its output stays unrotated" in report.to_table()
    x = torch.randint(0, 61, (3, 20))
    with torch.no_grad():
        ref, out = original(x), model(x)
    assert ((out - ref).abs().max() / ref.abs().max()).item() < 1e-5
    # rotated again: the matrices compose (M <- Q2ᵀ·M)
    assert rotate(model, method="random", seed=4, example_inputs=examples).verification["max_rel"] < 1e-4
    with torch.no_grad():
        assert ((model(x) - ref).abs().max() / ref.abs().max()).item() < 1e-5


def test_dinov2_rotates_with_its_final_norm_kept_unrotated():
    torch.manual_seed(0)
    config = tf.Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                             image_size=16, patch_size=8)
    original = perturb(tf.Dinov2Model(config)).eval()   # LayerScales too: folded by the conversion
    model, before = _converted(copy.deepcopy(original))
    report = rotate(model)
    assert list(report.unrotated) == ["layernorm"] and "the model output" in report.unrotated["layernorm"]
    x = {"pixel_values": torch.randn(3, 3, 16, 16)}
    with torch.no_grad():
        ref, out = original(**x), model(**x)
    for key in ("last_hidden_state", "pooler_output"):
        assert ((out[key] - ref[key]).abs().max() / ref[key].abs().max()).item() < 1e-5, key
    patch = model.embeddings.patch_embeddings.projection.weight
    assert (patch - before.embeddings.patch_embeddings.projection.weight).norm() > 0.5 * patch.norm()


class RawReader(nn.Module):
    """RMSNorm blocks with a head that also reads the unnormalised stream."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.emb, self.norm, self.mlp = nn.Embedding(11, d), nn.RMSNorm(d), nn.Linear(d, d)
        self.final, self.head, self.probe = nn.RMSNorm(d), nn.Linear(d, 11), nn.Linear(d, 1)

    def forward(self, idx):
        x = self.emb(idx)
        x = x + self.mlp(self.norm(x))
        return self.head(self.final(x)) + self.probe(x)


def test_refuses_a_layer_reading_the_raw_stream():
    with pytest.raises(NotRotatable, match=r"probe \(Linear\) reads the unnormalised stream"):
        rotate(RawReader(), example_inputs=torch.randint(0, 11, (2, 5)))


def test_refuses_bad_arguments_in_one_line():
    with pytest.raises(NormswapError, match="unknown rotation method 'givens'"):
        rotate(RawReader(), method="givens")
    with pytest.raises(NormswapError, match="seed must be an int"):
        rotate(RawReader(), seed=1.5)
    with pytest.raises(NormswapError, match="must be a torch.nn.Module"):
        rotate("gpt2")


class AlsoReturnsStates(nn.Module):
    """A final norm read by a bias-free head and also returned nested ("states.0"): the conversion keeps its
    bias after it; the rotation folds that bias into the head instead."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.emb, self.norm, self.mlp = nn.Embedding(11, d), nn.LayerNorm(d), nn.Linear(d, d)
        self.final, self.head = nn.LayerNorm(d), nn.Linear(d, 11, bias=False)

    def forward(self, idx):
        x = self.emb(idx)
        x = x + self.mlp(self.norm(x))
        y = self.final(x)
        return {"logits": self.head(y), "states": (y,)}


def test_a_norm_bias_kept_for_a_returned_output_is_folded_into_its_reader():
    original = perturbed(AlsoReturnsStates())
    examples = torch.randint(0, 11, (2, 5))
    model, _ = _converted(copy.deepcopy(original), examples)
    assert model.final.normswap_bias is not None   # kept after the norm by the conversion
    report = rotate(model, example_inputs=examples)
    assert report.added_biases == ["head"] and not hasattr(model.final, "normswap_bias")
    assert report.not_preserved == {"states.0": "the residual stream, returned rotated (and centred)"}
    assert "final" not in model.normswap_section["output_fixes"] and "head" in model.normswap_section["added_biases"]
    x = torch.randint(0, 11, (3, 9))
    with torch.no_grad():
        ref, out = original(x)["logits"], model(x)["logits"]
    assert ((out - ref).abs().max() / ref.abs().max()).item() < 1e-5


class Scale(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.gamma = nn.Parameter(torch.linspace(0.5, 1.5, d))

    def forward(self, x):
        return self.gamma * x


class Blocks(nn.Module):
    """RMSNorm blocks (no conversion needed): `scaled` puts a per-channel LayerScale on the MLP's output,
    `per_head` an RMSNorm over each head of a projection that writes the stream."""

    def __init__(self, scaled: bool = False, per_head: bool = False, d: int = 16):
        super().__init__()
        self.emb, self.norm, self.mlp = nn.Embedding(11, d), nn.RMSNorm(d), nn.Linear(d, d)
        self.scale = Scale(d) if scaled else nn.Identity()
        self.head_norm = nn.RMSNorm(4) if per_head else None
        self.final, self.head = nn.RMSNorm(d), nn.Linear(d, 11)

    def forward(self, idx):
        x = self.emb(idx)
        h = self.mlp(self.norm(x))
        if self.head_norm is not None:
            h = self.head_norm(h.unflatten(-1, (4, 4))).flatten(-2)
        x = x + self.scale(h)
        return self.head(self.final(x))


def test_rms_norm_blocks_rotate_and_refusals_name_a_per_channel_scale_and_a_per_head_norm():
    examples = torch.randint(0, 11, (2, 5))
    plain = Blocks().eval()
    x = torch.randint(0, 11, (3, 7))
    emb = plain.emb.weight.detach().clone()
    with torch.no_grad():
        ref = plain(x)
        assert rotate(plain, example_inputs=examples).verification["max_rel"] < 1e-4
        assert torch.allclose(plain(x), ref, atol=1e-5) and (plain.emb.weight - emb).norm() > 0.3 * emb.norm()
    with pytest.raises(NotRotatable, match=r"scale scales the stream per channel"):
        rotate(Blocks(scaled=True), example_inputs=examples)
    with pytest.raises(NotRotatable, match=r"head_norm normalises groups of channels \(a per-head norm, width 4\)"):
        rotate(Blocks(per_head=True), example_inputs=examples)


def test_clip_rotates_with_its_vision_pre_norm_writing_the_stream():
    torch.manual_seed(0)
    tower = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    config = tf.CLIPConfig(text_config=dict(tower, vocab_size=60, max_position_embeddings=16),
                           vision_config=dict(tower, image_size=16, patch_size=8), projection_dim=16)
    original = perturb(tf.CLIPModel(config)).eval()
    model, _ = _converted(copy.deepcopy(original))
    report = rotate(model)
    assert list(report.unrotated) == ["vision_model.pre_layrnorm"] and len(report.streams) == 2
    x = {"input_ids": torch.randint(0, 60, (2, 7)), "pixel_values": torch.randn(2, 3, 16, 16)}
    with torch.no_grad():
        ref, out = original(**x), model(**x)
    for key in ("text_embeds", "image_embeds", "logits_per_image"):
        assert ((out[key] - ref[key]).abs().max() / ref[key].abs().max()).item() < 1e-5, key


def test_a_compiled_model_rotates_inside_its_wrapper_and_frozen_stays_frozen():
    """As `convert` (issue 46 #5): a torch.compile'd model failed with "does not support len()"; the d x d
    matrix a returned norm's output fix gets trains only where its norm did."""
    model, before = _converted(build("gpt2-headless"))
    model.requires_grad_(False)
    wrapper = torch.compile(model, backend="eager")
    report = rotate(wrapper)
    assert report.verification["max_rel"] <= 1e-4 and model.ln_f.normswap_matrix.requires_grad is False
    assert [n for n, p in model.named_parameters() if p.requires_grad] == []
    batch = padded_batches()[0]
    with torch.no_grad():
        got, want = wrapper(**batch).last_hidden_state, before(**batch).last_hidden_state
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5


@pytest.mark.parametrize("name,pair", [("gpt2", ("transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj")),
                                       ("opt", ("model.decoder.layers.0.self_attn.v_proj",
                                                "model.decoder.layers.0.self_attn.out_proj"))])
def test_converted_models_rotate_per_head_too(name, pair):
    """R2 on exactly converted models: GPT-2's fused c_attn pairs as a whole (no rotary embedding: queries and
    keys rotated alike keep their products), its cache listed as stored rotated; GPT-NeoX's (rotary) pairs none."""
    original = build(name)
    model, _ = _converted(copy.deepcopy(original))
    report = rotate(model, heads=True)
    assert report.heads["pairs"][0] == list(pair) and "rotated per head" in report.not_preserved["cache"]
    x = torch.randint(0, 50, (2, 12))
    with torch.no_grad():
        want = original(x).logits
        assert ((model(x).logits - want).abs().max() / want.abs().max()).item() < 1e-5
    neox, _ = _converted(build("gpt_neox-sequential"))
    with pytest.raises(NotRotatable, match="no attention found to rotate per head"):
        rotate(neox, heads=True)
