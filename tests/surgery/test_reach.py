"""Parameters no input can run: a path gated on an optional argument that the parent never passes is
unreachable; every other use (the argument passed, by name, by position or by splat; a read outside the
gate) keeps the parameter reachable, so exact conversion still refuses to guess what it writes."""
from __future__ import annotations

import copy

import pytest
import torch
import transformers as tf
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_outputs import CausalLMOutput

import normswap
from normswap.models.inputs import sample_inputs
from normswap.parity import compare
from normswap.surgery.labels import Cause, NotExact
from normswap.surgery.reach import unreachable
from helpers.exact_models import perturb

V, D = 40, 16


class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.tokens = nn.Embedding(V, D)
        self.mask_token = nn.Parameter(torch.randn(D))

    def forward(self, input_ids, masked=None):
        x = self.tokens(input_ids)
        if masked is not None:
            x = torch.where(masked[..., None], self.mask_token, x)
        return x


class Leaky(Embed):
    def forward(self, input_ids, masked=None):
        return super().forward(input_ids, masked) + 0 * self.mask_token.sum()   # read outside the gate


class Model(nn.Module):
    """Embedding (with a gated mask token) -> a pre-LN block -> final norm -> head; how the parent calls the
    embedding is up to each subclass (the check reads each class's code)."""

    def __init__(self, embed: type = Embed):
        super().__init__()
        self.config = PretrainedConfig()
        self.embed, self.ln, self.fc = embed(), nn.LayerNorm(D), nn.Linear(D, D)
        self.ln_f, self.head = nn.LayerNorm(D), nn.Linear(D, V)

    def forward(self, input_ids, masked=None):
        x = self.embedded(input_ids, masked)
        x = x + self.fc(self.ln(x))
        return CausalLMOutput(logits=self.head(self.ln_f(x)))


class Never(Model):
    def embedded(self, input_ids, masked):
        return self.embed(input_ids)


class Keyword(Model):
    def embedded(self, input_ids, masked):
        return self.embed(input_ids, masked=masked)


class Position(Model):
    def embedded(self, input_ids, masked):
        return self.embed(input_ids, masked)


class Splat(Model):
    def embedded(self, input_ids, masked):
        return self.embed(input_ids, **{"masked": masked})


class Handed(Model):   # the embedding handed out: anyone may call it with the mask
    def embedded(self, input_ids, masked):
        return next(iter([self.embed]))(input_ids)


def test_a_gate_the_parent_never_opens_is_unreachable():
    assert unreachable(Never(), "embed.mask_token")
    assert not unreachable(Never(), "embed.tokens.weight")   # read unconditionally


@pytest.mark.parametrize("model", [Keyword(), Position(), Splat(), Handed(), Never(Leaky)],
                         ids=["keyword", "position", "splat", "handed-out", "read-outside-the-gate"])
def test_a_gate_the_parent_may_open_is_reachable(model):
    assert not unreachable(model, "embed.mask_token")


class Direct(Model):
    def forward(self, input_ids, masked=None):
        x = self.embed(input_ids, masked=masked)
        x = x + self.fc(self.ln(x))
        return CausalLMOutput(logits=self.head(self.ln_f(x)))


class Wrapped(nn.Module):
    """A head over `Direct`, whose forward passes its own `masked` on: reachable only if the head passes it."""

    def __init__(self):
        super().__init__()
        self.config, self.inner = PretrainedConfig(), Direct()

    def forward(self, input_ids, masked=None):
        return self.inner(input_ids)


class PassedOn(Wrapped):
    def forward(self, input_ids, masked=None):
        return self.inner(input_ids, masked=masked)


def test_a_gate_passed_on_is_followed_up_to_the_model():
    assert unreachable(Wrapped(), "inner.embed.mask_token")
    assert not unreachable(PassedOn(), "inner.embed.mask_token")   # the user may pass it
    assert not unreachable(Direct(), "embed.mask_token")


def test_exact_conversion_ignores_only_unreachable_parameters(feed):
    x = {"input_ids": torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(0))}
    feed([x])
    torch.manual_seed(0)
    model = perturb(Never()).eval()
    reference = copy.deepcopy(model)
    assert normswap.convert(model, method="exact").method == "exact"
    assert compare(reference, model, [x]).max_rel <= 1e-5
    with pytest.raises(NotExact, match="embed.mask_token did not run") as e:   # named
        normswap.convert(perturb(Keyword()).eval(), method="exact")
    assert e.value.cause is Cause.UNRUN


DINO = dict(model_type="dinov2", image_size=28, patch_size=14, out_indices=[1, 2], out_features=["stage1", "stage2"],
            reshape_hidden_states=False, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=64)


def test_depth_anything_converts_exactly_around_the_backbones_mask_token():
    torch.manual_seed(0)
    model = perturb(tf.DepthAnythingForDepthEstimation(tf.DepthAnythingConfig(
        backbone_config=DINO, neck_hidden_sizes=[16, 32], fusion_hidden_size=16, reassemble_hidden_size=32,
        reassemble_factors=[2, 1], patch_size=14))).eval()
    assert unreachable(model, "backbone.embeddings.mask_token")
    x = sample_inputs(model)
    before = [model(**b).predicted_depth for b in x]
    report = normswap.convert(model, method="exact")
    assert report.method == "exact" and report.num_converted == 5
    assert all(torch.allclose(model(**b).predicted_depth, y, rtol=1e-4, atol=1e-5) for b, y in zip(x, before))
    # Dinov2 on its own passes bool_masked_pos to its embeddings: reachable there, and run by its inputs
    dino = tf.Dinov2Model(tf.Dinov2Config(**{k: v for k, v in DINO.items() if k != "model_type"}))
    assert not unreachable(dino, "embeddings.mask_token")


class Switched(nn.Module):
    """A module built but read only under a constructor switch (MONAI's `with_cross_attention`)."""

    def __init__(self, on: bool = False):
        super().__init__()
        self.with_extra, self.main, self.extra = on, nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        x = self.main(x)
        if self.with_extra and x.dim() > 1:
            x = x + self.extra(x)
        return x


class Toggled(Switched):
    def enable(self):   # set after __init__: another call could turn it on
        self.with_extra = True


def test_a_switch_that_is_off_makes_what_it_guards_unreachable():
    assert unreachable(Switched(), "extra.weight")
    assert not unreachable(Switched(), "main.weight")   # read unconditionally
    assert not unreachable(Switched(on=True), "extra.weight")   # on: it runs
    assert not unreachable(Toggled(), "extra.weight")   # the code can turn it on
