"""torch.nn's own transformer modules after conversion: nn.TransformerEncoderLayer's fused eval path (which
computes LayerNorm from norm1/norm2's weight and bias) is never taken once its norms are RMSNorms, naive and
exact alike, on and off that path; and a LayerScale after nn.MultiheadAttention folds into its out_proj."""
from __future__ import annotations

import copy
import itertools
import warnings

import pytest
import torch
from torch import nn

import normswap
from normswap.folder.fixes import Fixed
from normswap.surgery.labels import Cause, NotExact
from helpers.exact_models import perturb

V, D = 50, 16
G = torch.Generator().manual_seed(3)


class HandRMS(nn.Module):
    """The reference RMSNorm, written out in fp64: x / sqrt(mean(x^2) + eps) * gain (the LayerNorm's bias dropped)."""

    def __init__(self, ln: nn.LayerNorm):
        super().__init__()
        self.gain, self.eps = ln.weight.detach().double().clone(), ln.eps

    def forward(self, x):
        y = x.double()
        return (y / torch.sqrt(y.pow(2).mean(-1, keepdim=True) + self.eps) * self.gain).to(x.dtype)


def hand_rms(model: nn.Module) -> nn.Module:
    """A copy of `model` with every nn.LayerNorm replaced by `HandRMS`, in fp64."""
    ref = copy.deepcopy(model).double()
    for m in list(ref.modules()):
        for child, sub in list(m.named_children()):
            if isinstance(sub, nn.LayerNorm):
                setattr(m, child, HandRMS(sub))
    return ref


def slow(model: nn.Module, *args, **kw) -> torch.Tensor:
    """`model`'s output on `args` in fp64, with torch's fused paths off (the reference's norms have no
    LayerNorm bias to give them)."""
    was = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        return model(*[a.double() if a is not None and a.is_floating_point() else a for a in args], **kw)
    finally:
        torch.backends.mha.set_fastpath_enabled(was)


@pytest.fixture
def fused(monkeypatch):
    """Counts calls of torch's fused encoder layer and of its nested-tensor packing."""
    calls = {"layer": 0, "nested": 0}
    layer_fwd, nested = torch._transformer_encoder_layer_fwd, torch._nested_tensor_from_mask

    def count(key, fn):
        def wrapped(*a, **k):
            calls[key] += 1
            return fn(*a, **k)
        return wrapped
    monkeypatch.setattr(torch, "_transformer_encoder_layer_fwd", count("layer", layer_fwd))
    monkeypatch.setattr(torch, "_nested_tensor_from_mask", count("nested", nested))
    return calls


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def padding(b: int, n: int) -> torch.Tensor:
    """A right-padded key mask (True: padding), every row keeping at least one key."""
    lengths = torch.randint(1, n + 1, (b,), generator=G)
    lengths[0] = n
    return torch.arange(n) >= lengths[:, None]


def stream(b: int, n: int, batch_first: bool) -> torch.Tensor:
    x = torch.randn(b, n, D, generator=G)
    return x if batch_first else x.transpose(0, 1)


def encoder(norm_first: bool, batch_first: bool, nested: bool) -> nn.TransformerEncoder:
    layer = nn.TransformerEncoderLayer(D, 2, 32, dropout=0.0, batch_first=batch_first, norm_first=norm_first)
    with warnings.catch_warnings():   # torch: "enable_nested_tensor is True, but ... norm_first was True"
        warnings.simplefilter("ignore")
        return perturb(nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(D), enable_nested_tensor=nested))


@pytest.mark.parametrize("norm_first, batch_first, nested", list(itertools.product([False, True], repeat=3)))
@torch.no_grad()
def test_naive_encoder_equals_a_hand_written_rmsnorm(norm_first, batch_first, nested, fused):
    enc = encoder(norm_first, batch_first, nested).eval()
    x, pad = stream(3, 6, batch_first), padding(3, 6)
    enc(x, src_key_padding_mask=pad)
    took = dict(fused)   # the original on torch's fused path where it is eligible
    assert took == {"layer": 2 if batch_first else 0, "nested": int(batch_first and nested and not norm_first)}
    ref = hand_rms(enc)
    normswap.convert(enc, method="naive")
    for mode in ("eval", "train"):
        enc.train(mode == "train")
        ref.train(mode == "train")
        for args in [(x,), (x, None, pad)]:
            want = slow(ref, *args)
            assert rel(enc(*args), want) <= 1e-5, (mode, len(args))
    assert fused == took   # never after the swap: it would compute LayerNorm


@pytest.mark.parametrize("norm_first", [False, True])
@torch.no_grad()
def test_naive_decoder_and_full_transformer(norm_first):
    layer = nn.TransformerDecoderLayer(D, 2, 32, dropout=0.0, batch_first=True, norm_first=norm_first)
    dec = perturb(nn.TransformerDecoder(layer, 2, norm=nn.LayerNorm(D))).eval()
    full = perturb(nn.Transformer(D, 2, 1, 1, 32, dropout=0.0, batch_first=True, norm_first=norm_first)).eval()
    tgt, memory, src = stream(2, 5, True), stream(2, 7, True), stream(2, 7, True)
    causal = nn.Transformer.generate_square_subsequent_mask(5)
    for model, args in [(dec, (tgt, memory, causal)), (full, (src, tgt, None, causal))]:
        ref = hand_rms(model)
        normswap.convert(model, method="naive")
        kw = dict(src_key_padding_mask=padding(2, 7)) if model is full else dict(memory_key_padding_mask=padding(2, 7))
        want = slow(ref, *args, **kw)
        assert rel(model(*args, **kw), want) <= 1e-5


class Embedded(nn.Module):
    """Token embeddings -> nn.TransformerEncoder (with its final norm): the stream comes from weights."""

    def __init__(self, norm_first: bool, batch_first: bool, nested: bool):
        super().__init__()
        self.batch_first = batch_first
        self.embed = nn.Embedding(V, D)
        self.encoder = encoder(norm_first, batch_first, nested)

    def forward(self, ids, pad=None):
        return self.encoder(self.embed(ids if self.batch_first else ids.T), src_key_padding_mask=pad)


def ids(b: int, n: int) -> torch.Tensor:
    return torch.randint(0, V, (b, n), generator=G)


@pytest.mark.parametrize("batch_first, nested, training, zero", [
    (True, True, False, False), (True, False, False, True), (False, False, False, False), (True, False, True, True)])
@torch.no_grad()
def test_exact_encoder_keeps_the_outputs(batch_first, nested, training, zero, fused):
    model = perturb(Embedded(True, batch_first, nested)).train(training)
    for layer in model.encoder.layers if zero else []:   # no bias kept after norm1: no fix on the layer
        layer.norm1.bias.zero_()
    original = copy.deepcopy(model)
    report = normswap.convert(model, method="exact", example_inputs=[(ids(2, 5),), (ids(3, 4), padding(3, 4))])
    assert report.method == "exact" and report.num_converted == 5
    # a fix (in its module's own forward, never a hook) that torch's fused path would skip: the layer keeps off it
    assert zero == (not any(isinstance(m, Fixed) for m in model.encoder.layers.modules()))
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert model.training == training   # the mode is the user's; eval (the fused path) compared too
    for mode in {training, False}:
        model.train(mode)
        original.train(mode)
        for args in [(ids(1, 9),), (ids(4, 7), padding(4, 7))]:   # other batch sizes and lengths
            before = dict(fused)
            want = original(*args)
            assert fused["layer"] - before["layer"] == (2 if batch_first and not mode else 0)
            assert rel(model(*args), want) <= 1e-5
            assert fused["layer"] - before["layer"] == (2 if batch_first and not mode else 0)


@pytest.mark.parametrize("nested", [False, True])
def test_exact_post_ln_encoder_is_refused_as_post_ln(nested):
    model = perturb(Embedded(False, True, nested)).eval()
    original = copy.deepcopy(model)
    with pytest.raises(NotExact) as e:
        normswap.convert(model, method="exact", example_inputs=[(ids(2, 5),), (ids(3, 4), padding(3, 4))])
    assert e.value.cause is Cause.POST_LN and "\n" not in str(e.value)
    assert all(torch.equal(a, b) for a, b in zip(original.state_dict().values(), model.state_dict().values()))


class LayerScale(nn.Module):
    """timm's / open_clip's LayerScale: x * gamma (in place if asked)."""

    def __init__(self, inplace: bool = False):
        super().__init__()
        self.gamma = nn.Parameter(torch.full((D,), 0.1))
        self.inplace = inplace

    def forward(self, x):
        return x.mul_(self.gamma) if self.inplace else x * self.gamma


class Block(nn.Module):
    """open_clip's pre-LN ResidualAttentionBlock: ls_1 after nn.MultiheadAttention (a module, in place, or
    a bare parameter as CaiT's gamma_1), ls_2 after the MLP's last Linear."""

    def __init__(self, batch_first: bool, scale: str):
        super().__init__()
        self.scale = scale
        self.ln_1, self.ln_2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = nn.MultiheadAttention(D, 2, batch_first=batch_first)
        if scale == "parameter":
            self.gamma_1 = nn.Parameter(torch.full((D,), 0.1))
        else:
            self.ls_1 = LayerScale(inplace=scale == "inplace")
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))
        self.ls_2 = LayerScale()

    def forward(self, x, pad=None):
        h = self.ln_1(x)
        a = self.attn(h, h, h, need_weights=False, key_padding_mask=pad)[0]
        x = x + (self.gamma_1 * a if self.scale == "parameter" else self.ls_1(a))
        return x + self.ls_2(self.mlp(self.ln_2(x)))


class Tower(nn.Module):
    def __init__(self, batch_first: bool, scale: str):
        super().__init__()
        self.batch_first = batch_first
        self.embed = nn.Embedding(V, D)
        self.blocks = nn.ModuleList([Block(batch_first, scale) for _ in range(2)])
        self.ln_f = nn.LayerNorm(D)

    def forward(self, ids, pad=None):
        x = self.embed(ids if self.batch_first else ids.T)
        for block in self.blocks:
            x = block(x, pad)
        return self.ln_f(x)


@pytest.mark.parametrize("batch_first, scale", [(True, "module"), (False, "inplace"), (True, "parameter")])
@torch.no_grad()
def test_layer_scale_after_multihead_attention_folds_into_out_proj(batch_first, scale):
    model = perturb(Tower(batch_first, scale)).eval()
    with torch.no_grad():
        for block in model.blocks:
            (block.gamma_1 if scale == "parameter" else block.ls_1.gamma).copy_(0.5 + torch.rand(D, generator=G))
    original = copy.deepcopy(model)
    report = normswap.convert(model, method="exact", example_inputs=[ids(2, 5)])
    assert report.method == "exact" and report.num_converted == 5
    for block, was in zip(model.blocks, original.blocks):
        gamma = block.gamma_1 if scale == "parameter" else block.ls_1.gamma
        old = was.gamma_1 if scale == "parameter" else was.ls_1.gamma
        assert torch.equal(gamma, torch.ones(D))   # folded: the scale is now in out_proj's rows and bias
        w = was.attn.out_proj.weight.double() * old.double()[:, None]
        assert torch.allclose(block.attn.out_proj.weight.double(), w - w.mean(0), atol=1e-6)
    for args in [(ids(1, 9),), (ids(3, 7), padding(3, 7))]:   # other batch sizes and lengths than traced
        assert rel(model(*args), original(*args)) <= 1e-5


@torch.no_grad()
def test_a_restored_encoder_stays_off_the_fused_path(tmp_path, fused):
    def build() -> nn.TransformerEncoder:
        torch.manual_seed(0)
        return nn.TransformerEncoder(nn.TransformerEncoderLayer(D, 2, 32, dropout=0.0, batch_first=True), 2,
                                     norm=nn.LayerNorm(D), enable_nested_tensor=True).eval()
    model = perturb(build())
    normswap.convert(model, method="naive")
    x, pad = stream(2, 5, True), padding(2, 5)
    want = model(x, src_key_padding_mask=pad)
    normswap.save_pretrained(model, tmp_path / "out")
    fresh = normswap.restore(build(), tmp_path / "out")
    assert torch.equal(fresh(x, src_key_padding_mask=pad), want)
    assert fused == {"layer": 0, "nested": 0}
