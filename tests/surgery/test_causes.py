"""One minimal model per refusal cause that no other test shows on a model of its own (issue 48: "every
refusal's reason is the real one"): each is refused, or keeps its norm, naming that cause and the modules it is
about. The other causes: UNRUN, UNREACHABLE, MIXED, READ (test_third_party_patterns.py), OPAQUE, REAPPLIED,
STREAM, UNCENTRABLE (test_plan.py), POST_LN (test_kept_norms.py), FORWARD (test_fallback.py), UNVERIFIED
(test_exact.py)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers.user_models import perturbed

import normswap
from normswap.surgery.labels import Cause, NotExact
from normswap.surgery.walk import Skip

D, V = 16, 23


def ids(b: int = 2, t: int = 5) -> torch.Tensor:
    return torch.randint(0, V, (b, t), generator=torch.Generator().manual_seed(b * 100 + t))


def refusal(model: nn.Module, example=None):
    with pytest.raises(NotExact) as e:
        normswap.convert(perturbed(model), method="exact", example_inputs=ids() if example is None else example)
    return e.value


class ScaledSum(nn.Module):
    """A per-channel scale of a sum of two layers' outputs before a norm: no one layer to fold it into."""

    def __init__(self):
        super().__init__()
        self.emb, self.a, self.b = nn.Embedding(V, D), nn.Linear(D, D), nn.Linear(D, D)
        self.gamma = nn.Parameter(torch.linspace(0.5, 1.5, D))
        self.ln, self.head = nn.LayerNorm(D), nn.Linear(D, V)

    def forward(self, idx):
        x = self.emb(idx)
        return self.head(self.ln(self.gamma * (self.a(x) + self.b(x))))


def test_scale_of_more_than_one_layer():
    e = refusal(ScaledSum())
    assert e.cause is Cause.SCALE and e.refusal.modules == ("gamma", "ln"), str(e)


class TwoGroupings(nn.Module):
    """One layer's output normalised by two norms over overlapping channel groups."""

    def __init__(self):
        super().__init__()
        self.emb, self.fc = nn.Embedding(V, 2 * D), nn.Linear(2 * D, 2 * D)
        self.lo, self.mid = nn.LayerNorm(D), nn.LayerNorm(D)
        self.head = nn.Linear(2 * D, V)

    def forward(self, idx):
        x = self.fc(self.emb(idx))
        a = self.lo(x[..., :D])                  # channels 0..D
        b = self.mid(x[..., D // 2: D + D // 2])   # channels D/2..3D/2: overlaps the first group
        return self.head(torch.cat([a, b], -1))


def test_groups_that_no_centring_satisfies():
    e = refusal(TwoGroupings())
    assert e.cause is Cause.GROUPS and e.refusal.modules == ("fc", "lo", "mid"), str(e)


class KeptThenFinal(nn.Module):
    """A pre-LN block and its final norm, then a head transform whose norm reads a GELU's output (no sum of layer
    outputs: it stays a LayerNorm), and a norm reading that kept norm's output."""

    def __init__(self):
        super().__init__()
        self.emb, self.ln1, self.fc1 = nn.Embedding(V, D), nn.LayerNorm(D), nn.Linear(D, D)
        self.ln2, self.dense, self.post = nn.LayerNorm(D), nn.Linear(D, D), nn.LayerNorm(D)
        self.ln_f, self.head = nn.LayerNorm(D), nn.Linear(D, V)

    def forward(self, idx):
        x = self.emb(idx)
        x = x + self.fc1(self.ln1(x))
        return self.head(self.ln_f(self.post(F.gelu(self.dense(self.ln2(x))))))


def test_a_norm_reading_a_kept_norms_output_is_pinned():
    model = perturbed(KeptThenFinal())
    others = [ids(3, 7), ids(1, 2)]
    with torch.no_grad():
        refs = [model(x).double() for x in others]
    report = normswap.convert(model, method="exact", example_inputs=ids())
    kept = {s.name: s.refusal for s in report.skipped if s.cause is Skip.KEPT}
    assert {r.name for r in report.converted} == {"ln1", "ln2"} and set(kept) == {"post", "ln_f"}
    assert kept["post"].cause is Cause.OPAQUE, kept["post"]
    # converting ln_f would need its input centred at run time: a LayerNorm in two operations, nothing gained
    assert kept["ln_f"].cause is Cause.PINNED and kept["ln_f"].modules == ("ln_f", "post"), kept["ln_f"]
    with torch.no_grad():
        assert max(((model(x).double() - r).abs().max() / r.abs().max()).item() for x, r in zip(others, refs)) < 1e-5


class NoInputs(nn.Module):
    """A user's module normswap cannot build inputs for, given no example inputs."""

    def __init__(self):
        super().__init__()
        self.fc, self.ln = nn.Linear(D, D), nn.LayerNorm(D)

    def forward(self, features, mask):
        return self.ln(self.fc(features)) * mask


def test_no_sample_input_is_named():
    with pytest.raises(NotExact) as e:
        normswap.convert(NoInputs(), method="exact")
    assert e.value.cause is Cause.INPUTS and "no sample input" in str(e.value), str(e.value)
