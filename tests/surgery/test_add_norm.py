"""Fused residual add + RMSNorm in converted GPT-2 blocks: same outputs and gradients as unfused."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

transformers = pytest.importorskip("transformers")

import normswap  # noqa: E402
from normswap.errors import NormswapError  # noqa: E402
from normswap.surgery.add_norm import fuse_residual_norms, unfuse_residual_norms  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def tiny_gpt2(cross_attention=False):
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                                     add_cross_attention=cross_attention, bos_token_id=0, eos_token_id=0,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config).to(DEVICE)
    with torch.no_grad():  # non-trivial gains so the norms matter
        for name, p in model.named_parameters():
            if ".ln_" in name and name.endswith("weight"):
                p.uniform_(0.5, 1.5)
    normswap.convert(model, method="naive", to="rmsnorm")
    return model


def step(model, ids, **kw):
    """Logits and parameter gradients of a language-modelling loss."""
    model.zero_grad()
    out = model(ids, labels=ids, **kw)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(a, b, tol):
    torch.testing.assert_close(a[0], b[0], rtol=tol, atol=tol)
    assert a[1].keys() == b[1].keys()
    for name in a[1]:
        torch.testing.assert_close(a[1][name], b[1][name], rtol=tol, atol=tol, msg=name)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fused_gpt2_matches_unfused(monkeypatch, backend):
    if backend == "triton":
        pytest.importorskip("triton")
    model = tiny_gpt2()
    ids = torch.randint(0, 64, (2, 8), device=DEVICE)
    monkeypatch.setenv("NORMSWAP_BACKEND", "torch")
    unfused = step(model, ids)
    assert fuse_residual_norms(model) == ["transformer.h.0", "transformer.h.1"]
    assert type(model.transformer.h[0]).__name__ == "FusedGPT2Block"
    monkeypatch.setenv("NORMSWAP_BACKEND", backend)
    calls = []
    real = normswap.ops.rms_norm
    monkeypatch.setattr(normswap.ops, "rms_norm",
                        lambda *a, **k: calls.append(k.get("residual") is not None) or real(*a, **k))
    fused = step(model, ids)
    assert calls.count(True) == 2  # one fused add+norm per block (ln_2)
    # The torch path computes the same ops in the same order; the kernels differ in rounding only.
    assert_same(fused, unfused, 0.0 if backend == "torch" else 1e-5)


def test_fused_gpt2_cross_attention(monkeypatch):
    monkeypatch.setenv("NORMSWAP_BACKEND", "torch")
    model = tiny_gpt2(cross_attention=True)
    ids = torch.randint(0, 64, (2, 8), device=DEVICE)
    enc = torch.randn(2, 5, 32, device=DEVICE)
    unfused = step(model, ids, encoder_hidden_states=enc)
    fuse_residual_norms(model)
    assert_same(step(model, ids, encoder_hidden_states=enc), unfused, 0.0)


def test_fuse_is_idempotent_reversible_and_leaves_state_alone():
    model = tiny_gpt2()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert len(fuse_residual_norms(model)) == 2
    assert len(fuse_residual_norms(model)) == 2
    assert model.state_dict().keys() == state.keys()
    assert unfuse_residual_norms(model) == 2
    assert type(model.transformer.h[0]) is transformers.models.gpt2.modeling_gpt2.GPT2Block


def test_unconverted_blocks_are_left_alone():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8)
    model = transformers.GPT2LMHeadModel(config)
    assert fuse_residual_norms(model) == []


def test_unknown_block_signature_is_refused(monkeypatch):
    model = tiny_gpt2()

    class OddBlock(type(model.transformer.h[0])):
        def forward(self, hidden_states, layer_past=None, **kwargs):
            return hidden_states

    model.transformer.h[0].__class__ = OddBlock
    with pytest.raises(NormswapError, match="not supported"):
        fuse_residual_norms(model)
