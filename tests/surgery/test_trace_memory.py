"""The trace holds no more of a forward than the model itself does: activations go as the model drops them,
and the channel bookkeeping of rearranged tensors (q/k/v) keeps no per-element codes once used. Before, a
traced GPT-2-medium held every activation of its 512-token sample and 0.7 GB of int64 codes."""
from __future__ import annotations

import gc
import weakref

import torch
import transformers as tf
from torch import nn

from normswap.parity import Reference, reference_outputs
from normswap.surgery import trace as tracing
from normswap.surgery.record import Recorder


class Chain(nn.Module):
    """A pre-LN stack whose forward makes many temporaries, each dropped at once; it watches them."""

    def __init__(self, d: int = 16, n: int = 12):
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(n))
        self.fcs = nn.ModuleList(nn.Linear(d, d) for _ in range(n))
        self.seen: list[weakref.ref] = []
        self.alive_at_end = None

    def forward(self, x):
        for norm, fc in zip(self.norms, self.fcs):
            t = torch.tanh(fc(norm(x)))
            self.seen.append(weakref.ref(t))
            x = x + t
        gc.collect()
        self.alive_at_end = sum(r() is not None for r in self.seen)
        return x


def test_a_forward_s_dropped_temporaries_are_freed_while_it_is_traced():
    model = Chain()
    norms = {f"norms.{i}" for i in range(12)}
    tracing.trace(model, [{"x": torch.randn(2, 5, 16)}], norms)
    assert len(model.seen) == 12
    assert model.alive_at_end <= 1   # the last one, still named by the local `t`


def test_rearranged_uses_keep_channels_not_codes(monkeypatch):
    config = tf.GPT2Config(vocab_size=50, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    model = tf.GPT2LMHeadModel(config).eval()
    norms = {n for n, m in model.named_modules() if isinstance(m, nn.LayerNorm)}
    held = []
    finish = Recorder.finish

    def spy(self):
        held.append([x for entry in self.deferred for x in entry
                     if isinstance(x, torch.Tensor) or getattr(x, "codes", None) is not None])
        held.append(len(self.deferred))
        finish(self)
    monkeypatch.setattr(Recorder, "finish", spy)
    t = tracing.trace(model, [{"input_ids": torch.randint(0, 50, (2, 9))}], norms)
    assert held[0] == [] and held[1] > 0   # q/k/v uses were deferred, as channel sets only
    # and what they record is still who read it, and which channels: c_attn feeds no norm, so each of its users
    # (the attention) counts as reading all of it (None), not the slices (q, k, v) it took
    c_attn = next(lb for lb in t.uses if lb.name == "transformer.h.0.attn.c_attn")
    assert t.uses[c_attn] and all(ch is None for ch in t.uses[c_attn].values()), t.uses[c_attn]


class Owner(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))
        self.last = None

    def forward(self, x):
        self.last = x * 2
        return {"fresh": self.last, "param": self.w, "view": self.last[:, :2]}


def test_reference_outputs_copy_only_views_and_the_model_s_own_tensors():
    model = Owner()
    ref: Reference = reference_outputs(model, [{"x": torch.ones(3, 4)}])
    out = ref.outputs[0]
    assert out["fresh"].data_ptr() == model.last.data_ptr()   # not copied: a second copy of big logits
    assert out["view"].untyped_storage().data_ptr() != model.last.untyped_storage().data_ptr()
    with torch.no_grad():
        model.w.mul_(3)   # an in-place edit (as exact does) must not reach the reference
    assert torch.equal(out["param"], torch.ones(4))
