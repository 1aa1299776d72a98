"""Norms found by behaviour (probe/, walk.py): custom LayerNorm classes, effective gain, eps, skips."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers as tf
from torch import nn
from transformers.models.cohere.modeling_cohere import CohereLayerNorm
from transformers.models.convnext.modeling_convnext import ConvNextLayerNorm
from transformers.models.nemotron.modeling_nemotron import NemotronLayerNorm1P
from transformers.models.olmo.modeling_olmo import OlmoLayerNorm

import normswap
from normswap import parity
from normswap.models.inputs import sample_inputs
from normswap.errors import NormswapError
from normswap.norms import RMSNorm
from normswap.surgery import find_norms
from normswap.surgery.probe import NotLayerNorm
from normswap.surgery.probe.confirm import confirm
from normswap.surgery.probe.estimate import estimate
from normswap.surgery.probe.snap import snap

D = 16


class HardEpsLayerNorm(nn.Module):
    """A custom LayerNorm with its eps written into forward (no attribute to read it from)."""

    def __init__(self, d):
        super().__init__()
        self.w, self.b = nn.Parameter(torch.randn(d)), nn.Parameter(torch.randn(d))

    def forward(self, x):
        return F.layer_norm(x, x.shape[-1:], self.w, self.b, eps=1e-3)


class FakeLayerNorm(nn.Module):
    """Says LayerNorm, computes an RMSNorm."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(d) + 0.5)

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class Scale(nn.Module):
    """A leaf with a 1-D weight that is not a norm (LayerScale-like)."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(d))

    def forward(self, x):
        return x * self.weight


def _perturbed(module: nn.Module, seed: int = 0) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5 + 0.3)
    return module


def reference_ln(x: torch.Tensor, gain, bias, eps: float) -> torch.Tensor:
    x = x.double()
    xc = x - x.mean(-1, keepdim=True)
    y = gain * xc / (xc.pow(2).mean(-1, keepdim=True) + eps).sqrt()
    return y if bias is None else y + bias


# module, true effective gain, true bias, true eps
def _cases():
    c = _perturbed(CohereLayerNorm(D, eps=1e-5), 1)
    n = _perturbed(NemotronLayerNorm1P(D, eps=1e-5), 2)
    nb = _perturbed(nn.LayerNorm(D, eps=1e-6, bias=False), 3)
    h = _perturbed(HardEpsLayerNorm(D), 4)
    return {
        "cohere": (c, c.weight.double(), None, 1e-5),
        "olmo": (OlmoLayerNorm(D), torch.ones(D, dtype=torch.float64), None, 1e-5),
        "nemotron-1p": (n, n.weight.double() + 1, n.bias.double(), 1e-5),
        "biasless": (nb, nb.weight.double(), None, 1e-6),
        "hard-eps": (h, h.w.double(), h.b.double(), 1e-3),
        "no-affine-tiny-eps": (nn.LayerNorm(D, eps=1e-12, elementwise_affine=False),
                               torch.ones(D, dtype=torch.float64), None, 1e-12),
        "zero-eps": (nn.LayerNorm(D, eps=0.0, elementwise_affine=False), torch.ones(D, dtype=torch.float64), None, 0.0),
    }


@pytest.mark.parametrize("case", list(_cases()))
def test_probe_finds_effective_gain_bias_eps(case):
    module, gain, bias, eps = _cases()[case]
    model = nn.Sequential(module)
    sites, skipped, _ = find_norms(model)
    assert len(sites) == 1 and not skipped, skipped
    s = sites[0]
    assert s.eps == pytest.approx(eps, rel=1e-9, abs=0)
    torch.testing.assert_close(s.gain, gain, rtol=0, atol=1e-12)
    assert (s.bias is None) == (bias is None)
    if bias is not None:
        torch.testing.assert_close(s.bias, bias, rtol=0, atol=1e-12)


@pytest.mark.parametrize("case", list(_cases()))
def test_naive_uses_effective_gain(case):
    """After the naive swap, the norm on zero-mean input is the fp64 LayerNorm minus its bias."""
    module, gain, _, eps = _cases()[case]
    model = nn.Sequential(module)
    if eps == 0:   # probed fine, but RMSNorm needs eps > 0: refused by name, nothing converted
        with pytest.raises(NormswapError, match="0: eps must be positive"):
            normswap.convert(model, method="naive")
        assert model[0] is module
        return
    report = normswap.convert(model, method="naive")
    assert report.num_converted == 1
    new = model[0]
    assert isinstance(new, RMSNorm) and new.eps == pytest.approx(eps)
    x = torch.randn(5, D, dtype=torch.float64)
    x = x - x.mean(-1, keepdim=True)
    ref = reference_ln(x, gain, None, eps)
    torch.testing.assert_close(new(x.float()).double(), ref, rtol=1e-5, atol=1e-5)


class NoLayerNormBlock(nn.Module):
    """A block whose name mentions LayerNorm (like Wav2Vec2NoLayerNormConvLayer): not a candidate."""

    def __init__(self, d):
        super().__init__()
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        return self.proj(x)


def test_skips_what_is_not_a_layernorm():
    model = nn.ModuleDict({
        "gn": nn.GroupNorm(1, D), "gn4": nn.GroupNorm(4, D), "bn": nn.BatchNorm1d(D),
        "channels_first": ConvNextLayerNorm(D, data_format="channels_first"),
        "rms_in_disguise": FakeLayerNorm(D), "scale": Scale(D), "ln2d": nn.LayerNorm((4, D)),
        "ok": _perturbed(nn.LayerNorm(D)), "block": NoLayerNormBlock(D),
    })
    model.train()
    bn_before = model["bn"].running_mean.clone(), int(model["bn"].num_batches_tracked)
    sites, skipped, _ = find_norms(model)
    assert [s.name for s in sites] == ["ok"]
    why = {s.name: s.reason for s in skipped}
    assert set(why) == {"gn", "gn4", "bn", "channels_first", "rms_in_disguise", "scale", "ln2d"}
    assert "RMSNorm" in why["rms_in_disguise"]
    assert "not a LayerNorm" in why["scale"]
    assert "not just the last dimension" in why["ln2d"]
    # probing touched no state
    assert torch.equal(model["bn"].running_mean, bn_before[0])
    assert int(model["bn"].num_batches_tracked) == bn_before[1]


def test_probe_keeps_dtype_and_device():
    ln = _perturbed(nn.LayerNorm(D)).to(torch.bfloat16)
    w = ln.weight.detach().clone()
    sites, _, _ = find_norms(nn.Sequential(ln))
    assert ln.weight.dtype == torch.bfloat16 and torch.equal(ln.weight, w)
    torch.testing.assert_close(sites[0].gain, w.double(), rtol=0, atol=0)
    model = nn.Sequential(ln)
    normswap.convert(model, method="naive")
    assert model[0].weight.dtype == torch.bfloat16 and torch.equal(model[0].weight, w)


def test_the_three_steps_estimate_snap_confirm():
    """estimate: close to the module's values, not its bits; snap: its bits; confirm: passes them, refuses a
    gain that is off and an RMSNorm."""
    ln = _perturbed(nn.LayerNorm(D, eps=1e-5))
    g = torch.Generator().manual_seed(0)
    est = estimate(ln, D, g)
    w, b = ln.weight.double(), ln.bias.double()
    assert est.dtype == torch.float64 and 0 < est.tol < 1e-3
    assert (est.gain - w).abs().max() <= est.tol and (est.bias - b).abs().max() <= est.tol
    assert est.eps == pytest.approx(1e-5, rel=1e-2)
    gain, bias, eps = snap(ln, est)
    assert torch.equal(gain, w) and torch.equal(bias, b) and eps == 1e-5
    confirm(est, gain, bias, eps, g)
    with pytest.raises(NotLayerNorm):
        confirm(est, gain * 1.01, bias, eps, g)
    rms = FakeLayerNorm(D)
    est = estimate(rms, D, g)
    with pytest.raises(NotLayerNorm, match="RMSNorm"):
        confirm(est, *snap(rms, est), g)


TINY = dict(vocab_size=61, hidden_size=D, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2, max_position_embeddings=32)


@pytest.mark.parametrize("family,cfg,cls,count", [
    ("cohere", tf.CohereConfig, tf.CohereForCausalLM, 3),
    ("olmo", tf.OlmoConfig, tf.OlmoForCausalLM, 5),
    ("nemotron", tf.NemotronConfig, tf.NemotronForCausalLM, 5),
])
def test_custom_layernorm_models_convert(family, cfg, cls, count):
    torch.manual_seed(0)
    model = _perturbed_norms(cls(cfg(**TINY)).eval())
    sites, skipped, _ = find_norms(model)
    assert len(sites) == count, [s.name for s in sites]
    expected = {s.name: s.gain.clone() for s in sites}
    if family == "nemotron":  # LayerNorm1P: the effective gain is weight + 1
        assert all(torch.equal(s.gain, s.module.weight.double() + 1) for s in sites)
    report = normswap.convert(model, method="naive")
    assert report.num_converted == count
    for name, gain in expected.items():
        new = model.get_submodule(name)
        assert isinstance(new, RMSNorm)
        if new.weight is not None:
            torch.testing.assert_close(new.weight, gain.to(new.weight.dtype), rtol=0, atol=0)
        else:
            assert bool((gain == 1).all())
    assert not find_norms(model)[0]   # nothing left


@pytest.mark.parametrize("family,cfg,cls", [
    ("cohere", tf.CohereConfig, tf.CohereForCausalLM),        # a bias-less LayerNorm class, parallel blocks
    ("olmo", tf.OlmoConfig, tf.OlmoForCausalLM),              # non-parametric LayerNorm
    ("nemotron", tf.NemotronConfig, tf.NemotronForCausalLM),  # LayerNorm1P: gain weight + 1
])
def test_custom_layernorm_models_convert_exactly(family, cfg, cls):
    """The traced exact conversion on the custom classes: logits kept to 1e-5 (fp64 comparison)."""
    torch.manual_seed(0)
    model = _perturbed_norms(cls(cfg(**TINY)).eval())
    inputs = sample_inputs(model)
    reference = parity.reference_outputs(model, inputs)
    report = normswap.convert(model, method="exact")
    assert report.method == "exact" and not find_norms(model)[0]
    assert parity.compare_to(reference, model).max_rel <= 1e-5


def _perturbed_norms(model: nn.Module) -> nn.Module:
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in model.modules():
            if "LayerNorm" in type(m).__name__:
                for p in m.parameters(recurse=False):
                    p.add_(torch.randn(p.shape, generator=g) * 0.3 + 0.2)
    return model


def test_cli_convert_custom_norms(tmp_path):
    """`convert` no longer says "nothing to convert" for a model whose LayerNorms are custom classes."""
    from click.testing import CliRunner

    from normswap.cli import main
    torch.manual_seed(0)
    model = _perturbed_norms(tf.NemotronForCausalLM(tf.NemotronConfig(**TINY)).eval())
    model.save_pretrained(tmp_path / "src")
    res = CliRunner().invoke(main, ["convert", str(tmp_path / "src"), "--to", "rmsnorm", "--method", "naive",
                                    "-o", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    assert "converted 5 LayerNorm" in res.output and "nothing to convert" not in res.output
    again = normswap.from_pretrained(tmp_path / "out")
    ids = torch.randint(0, 61, (1, 9))
    converted = normswap.convert(model, method="naive")
    assert converted.num_converted == 5
    assert torch.equal(again(input_ids=ids).logits, model(input_ids=ids).logits)


class Gain(nn.Module):
    """One gain vector times a function of x: an RMSNorm in some forms, not in others."""

    def __init__(self, f, d: int = D):
        super().__init__()
        self.f, self.g = f, nn.Parameter(1 + 0.3 * torch.randn(d))

    def forward(self, x):
        return self.f(x, self.g)


@pytest.mark.parametrize("f, rms", [
    (lambda x, g: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * g, True),
    (lambda x, g: F.normalize(x, dim=-1) * D ** 0.5 * g, True),              # lucidrains' form
    (lambda x, g: x / x.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt() * (1 + g), True),   # Gemma's 1 + w
    (lambda x, g: F.layer_norm(x, (D,)) * g, False),                         # centred first: a LayerNorm
    (lambda x, g: x * g, False),                                             # LayerScale
    (lambda x, g: x / x.abs().amax(-1, keepdim=True) * g, False),            # another scale than the RMS
])
def test_computes_rms_norm_by_behaviour(f, rms):
    from normswap.surgery.probe import computes_rms_norm
    torch.manual_seed(0)
    assert computes_rms_norm(Gain(f), D) is rms
    assert computes_rms_norm(nn.RMSNorm(D), D) and not computes_rms_norm(nn.LayerNorm(D), D)


def test_probe_rms_finds_other_libraries_rmsnorms_and_where_their_gain_lives():
    """probe_rms: LlamaRMSNorm's gain is its weight, Gemma's is 1 + weight (exact bits, the module's eps); a
    LayerNorm (it subtracts the mean) and a per-channel scale are not RMSNorms."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from normswap.surgery.probe import probe_rms
    g = torch.Generator().manual_seed(0)
    for cls, offset in ((LlamaRMSNorm, 0.0), (GemmaRMSNorm, 1.0)):
        norm = cls(D, eps=1e-5)
        with torch.no_grad():
            norm.weight.copy_(torch.rand(D, generator=g) + 0.5)
        found = probe_rms(norm, D)
        assert (found.param, found.offset, found.eps) == ("weight", offset, 1e-5), cls
        assert torch.equal(found.gain, norm.weight.detach().double() + offset)
    with pytest.raises(NotLayerNorm, match="adds a bias after normalising"):
        probe_rms(_perturbed(nn.LayerNorm(D)), D)
    with pytest.raises(NotLayerNorm, match="not an RMSNorm over the last dimension"):
        probe_rms(nn.LayerNorm(D, bias=False), D)

    class Scale(nn.Module):   # LayerScale: a 1-D parameter, no normalisation
        def __init__(self):
            super().__init__()
            self.gamma = nn.Parameter(torch.rand(D) + 0.5)

        def forward(self, x):
            return x * self.gamma
    with pytest.raises(NotLayerNorm, match="scales with the input"):
        probe_rms(Scale(), D)
