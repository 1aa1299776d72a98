"""Rotation of models that are RMSNorm already (other libraries' RMSNorms, found by what they compute): outputs kept
on other inputs, gains set to ones where they are stored, a tied head untied, per-head norms left, refusals named."""
from __future__ import annotations

import copy

import pytest
import torch
import transformers as tf
from torch import nn

from normswap.surgery.rotate import NotRotatable, rotate

TINY = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=True,
            pad_token_id=0, bos_token_id=1, eos_token_id=2)
# family -> (config class, model class, the value a folded gain is set to: Gemma's norms compute (1 + w))
FAMILIES = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM, 1.0),
            "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, 1.0),
            "mistral": (tf.MistralConfig, tf.MistralForCausalLM, 1.0),
            "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, 1.0),
            "gemma": (tf.GemmaConfig, tf.GemmaForCausalLM, 0.0),
            "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM, 1.0)}


def is_norm(name: str) -> bool:
    return name.endswith("norm")   # the tests' own knowledge of these models' names, never the library's


def tiny(family: str, seed: int = 0) -> nn.Module:
    """A tiny model of `family` with its norms' gains far from init (so that a gain left unfolded shows)."""
    config_cls, cls, _ = FAMILIES[family]
    torch.manual_seed(seed)
    model = cls(config_cls(**TINY)).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if is_norm(name.rsplit(".", 1)[0]):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
    return model


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_an_rmsnorm_model_rotates_exactly_with_its_head_untied(family):
    model = tiny(family)
    before = copy.deepcopy(model)
    report = rotate(model, method="hadamard", seed=2)
    ids = torch.randint(0, 61, (3, 17), generator=torch.Generator().manual_seed(9))   # not the trace's inputs
    with torch.no_grad():
        assert rel(model(input_ids=ids).logits, before(input_ids=ids).logits) <= 1e-5
    [stream] = report.streams
    assert stream["q"] == "randomised Hadamard" and len(stream["norms"]) == 2 * TINY["num_hidden_layers"] + 1
    one = FAMILIES[family][2]
    for name in stream["norms"]:   # every stream norm's gain folded into its readers: its parameter says "ones"
        assert torch.equal(model.get_submodule(name).weight, torch.full((32,), one)), name
    inner = [n for n, _ in model.named_modules() if n.endswith(("q_norm", "k_norm"))]
    assert report.inner == inner and len(inner) == (4 if family == "qwen3" else 0)
    for name in inner:   # no rotation reaches them: as they were
        assert torch.equal(model.get_submodule(name).weight, before.get_submodule(name).weight)
    assert report.untied == ["lm_head.weight"] and model.config.tie_word_embeddings is False
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    emb, old = model.model.embed_tokens.weight, before.model.embed_tokens.weight
    assert (emb - old).norm() > 0.5 * old.norm()   # the stream really is rotated
    assert not hasattr(model.config, "normswap")   # nothing to ship: still its own architecture


def test_random_rotation_and_a_model_without_a_tied_head():
    model = tiny("llama", seed=1)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
    before = copy.deepcopy(model)
    report = rotate(model, method="random", seed=5)
    assert report.untied == [] and report.streams[0]["q"] == "random orthogonal"
    ids = torch.randint(0, 61, (2, 11))
    with torch.no_grad():
        assert rel(model(input_ids=ids).logits, before(input_ids=ids).logits) <= 1e-5


class LooksLikeRMSNorm(nn.Module):
    """A module whose class says RMSNorm but that subtracts the mean: not an RMSNorm."""

    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(d) + 0.5)

    def forward(self, x):
        return nn.functional.layer_norm(x, x.shape[-1:]) * self.weight


class RMSNormOfSquares(nn.Module):
    """An RMSNorm whose gain is the square of its parameter: no parameter can be set to make it ones."""

    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(d) + 0.5)

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight ** 2


@pytest.mark.parametrize("norm_cls,reason", [
    (LooksLikeRMSNorm, r"not an RMSNorm over the last dimension \(off by"),
    (RMSNormOfSquares, r"its gain is none of its parameters")])
def test_a_module_whose_class_says_rmsnorm_but_computes_otherwise_is_refused_by_name(norm_cls, reason):
    model = tiny("llama")
    model.model.layers[1].post_attention_layernorm = norm_cls(32)
    name = rf"model.layers.1.post_attention_layernorm \({norm_cls.__name__}\)"
    with pytest.raises(NotRotatable, match=rf"{name} is not an RMSNorm rotation can fold, "
                                           rf"x \* rsqrt\(mean\(x²\) \+ eps\) \* g: {reason}"):
        rotate(model)


class ScaledLayerNorm(nn.Module):
    """An RMSNorm that only its class name calls a LayerNorm (T5's kin: MT5LayerNorm, UMT5LayerNorm)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone())

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


def test_a_class_named_layernorm_that_computes_an_rmsnorm_rotates():
    model = tiny("llama")
    for name, m in list(model.named_modules()):
        if is_norm(name) and not name.endswith(("q_norm", "k_norm")):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, ScaledLayerNorm(m.weight))
    before = copy.deepcopy(model)
    report = rotate(model)
    ids = torch.randint(0, 61, (2, 13), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert rel(model(input_ids=ids).logits, before(input_ids=ids).logits) <= 1e-5
    assert len(report.streams[0]["norms"]) == 2 * TINY["num_hidden_layers"] + 1
    mt5 = tf.MT5ForConditionalGeneration(tf.MT5Config(vocab_size=50, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                                      num_heads=4, decoder_start_token_id=0)).eval()
    with pytest.raises(NotRotatable, match=r"^encoder.final_layer_norm's output is read by the model output"):
        rotate(mt5)   # T5's own reason, not "is a LayerNorm"
    model.model.norm = nn.LayerNorm(32)   # a real LayerNorm still is one
    with pytest.raises(NotRotatable, match=r"model.norm \(LayerNorm\) is a LayerNorm"):
        rotate(model)

def test_post_norm_and_sandwich_norm_models_are_refused_by_name():
    """OLMo-2's norms are after each block (a layer reads the raw stream); Gemma-2's post-norms write the stream,
    which would need a matrix after them, a fix its own architecture cannot store."""
    olmo2 = tf.Olmo2ForCausalLM(tf.Olmo2Config(**TINY)).eval()
    with pytest.raises(NotRotatable, match=r"model.layers.0.mlp.gate_proj \(Linear\) reads the unnormalised stream"):
        rotate(olmo2)
    gemma2 = tf.Gemma2ForCausalLM(tf.Gemma2Config(**TINY)).eval()
    with pytest.raises(NotRotatable, match=r"model.layers.0.post_attention_layernorm writes the stream: its rotation "
                                           r"needs a 32 x 32 matrix after it"):
        rotate(gemma2)
    base = tf.LlamaModel(tf.LlamaConfig(**TINY)).eval()   # its final norm's output is the model's output
    with pytest.raises(NotRotatable, match=r"model.norm's output|^norm's output"):
        rotate(base)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma"])
def test_per_head_rotations_of_values_and_output_are_exact(family):
    """QuaRot's R2: each head's values rotated (v_proj's rows, and bias: Qwen2), undone by o_proj's columns;
    grouped-query heads share the matrix; cached values are stored rotated and read back so: generation unchanged."""
    model = tiny(family)
    before = copy.deepcopy(model)
    plain = copy.deepcopy(model)
    rotate(plain, seed=2)   # the stream alone: v_proj's rows differ from it once the heads are rotated too
    report = rotate(model, seed=2, heads=True)
    layers = range(TINY["num_hidden_layers"])
    assert report.heads["width"] == 8 and report.heads["q"] == "randomised Hadamard"
    assert report.heads["pairs"] == [[f"model.layers.{i}.self_attn.v_proj", f"model.layers.{i}.self_attn.o_proj"]
                                     for i in layers]
    for i in layers:
        for proj in ("v_proj", "o_proj"):
            new, old = (m.model.layers[i].self_attn.get_submodule(proj).weight for m in (model, plain))
            assert (new - old).norm() > 0.3 * old.norm(), (i, proj)
    assert "per head (width 8, randomised Hadamard)" in report.to_table()
    ids = torch.randint(3, 61, (2, 15), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert rel(model(input_ids=ids).logits, before(input_ids=ids).logits) <= 1e-5
        settings = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert torch.equal(model.generate(ids, **settings), before.generate(ids, **settings))


def test_per_head_rotation_is_refused_by_name_where_no_attention_pairs():
    """Phi-3's fused qkv_proj: no layer's whole output is values, so none pairs with o_proj."""
    with pytest.raises(NotRotatable, match=r"no attention found to rotate per head \(heads of width 8\)"):
        rotate(tiny("phi3"), heads=True)


def test_a_wrong_per_head_rotation_is_caught_by_verification(monkeypatch):
    """The check can fail: values rotated per head without the output layer undoing it is refused after the edits."""
    from normswap.errors import NormswapError
    from normswap.surgery import heads, rotate as rotate_mod

    def values_only(model, pairs, r):   # the values rotated, nothing undone
        for v, _ in pairs:
            layer = model.get_submodule(v)
            with torch.no_grad():
                layer.weight.copy_(heads.per_head(layer.weight.double(), r.double(), 0).to(layer.weight.dtype))
    monkeypatch.setattr(rotate_mod, "rotate_heads", values_only)
    with pytest.raises(NormswapError, match=r"rotation failed verification.*discard it"):
        rotate(tiny("llama"), heads=True)
