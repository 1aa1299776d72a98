"""Coverage that lengths and buffers cannot fool: a buffer added to the residual stream is centred like a
parameter (or refused, named, where it cannot be), one that no sample input ran is refused by name, and
the text samples reach the model's position limit (issue 30's 36-token case)."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import PretrainedConfig

import normswap
from normswap.surgery.labels import Cause, NotExact
from normswap.models.inputs import sample_inputs

V, D, POSITIONS = 40, 16, 64


class Config(PretrainedConfig):
    model_type = "normswap-buffered-test"

    def __init__(self, vocab_size: int = V, hidden_size: int = D, max_position_embeddings: int = POSITIONS, **kw):
        super().__init__(**kw)
        self.vocab_size, self.hidden_size, self.max_position_embeddings = vocab_size, hidden_size, \
            max_position_embeddings


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(self.ln(x))))


class LongRows(nn.Module):
    """Pre-LN, untied head; `extra` (a persistent buffer, a non-persistent one, or a Parameter) is added to
    the stream only for inputs of `at` tokens or more. Also holds the buffers every model has and that must
    not matter: integer position ids, a bool causal mask, a float additive mask, a rotary-like table."""

    main_input_name = "input_ids"

    def __init__(self, kind: str = "buffer", at: int = 36):
        super().__init__()
        torch.manual_seed(0)
        self.config, self.at = Config(), at
        self.embed, self.pos = nn.Embedding(V, D), nn.Embedding(POSITIONS, D)
        extra = torch.randn(D) + 3.0   # far from zero mean: a wrong plan shows
        if kind == "parameter":
            self.extra = nn.Parameter(extra)
        else:
            self.register_buffer("extra", extra, persistent=kind == "buffer")
        self.register_buffer("position_ids", torch.arange(POSITIONS)[None])
        self.register_buffer("causal", torch.ones(POSITIONS, POSITIONS, dtype=torch.bool).tril())
        self.register_buffer("additive", torch.zeros(POSITIONS, POSITIONS))   # never used
        self.register_buffer("inv_freq", 1.0 / 1e4 ** (torch.arange(0, 6, 2) / 6), persistent=False)
        self.blocks = nn.ModuleList([Block(D), Block(D)])
        self.ln_f, self.head = nn.LayerNorm(D), nn.Linear(D, V)
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, nn.LayerNorm):
                    m.weight.uniform_(0.5, 1.5)
                    m.bias.normal_()

    def forward(self, input_ids, attention_mask=None):
        n = input_ids.shape[1]
        x = self.embed(input_ids) + self.pos(self.position_ids[:, :n])
        if n >= self.at:
            x = x + self.extra
        phase = self.position_ids[0, :n, None].float() * self.inv_freq   # a rotary table's angles
        x = x * (1 + 0 * phase.cos().sum(-1, keepdim=True))               # read, adds nothing
        for b in self.blocks:
            x = b(x).masked_fill(~self.causal[:n, :n].any(-1)[:, None], 0.0)
        return self.head(self.ln_f(x))


def _ids(n: int) -> torch.Tensor:
    return torch.randint(0, V, (2, n), generator=torch.Generator().manual_seed(1))


def _before(model: nn.Module, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = _ids(n)
    with torch.no_grad():
        return x, model(x)


def _converts_exactly_at(model: nn.Module, n: int) -> None:
    """Converted exactly, and right on n-token rows (against the outputs recorded before converting)."""
    x, ref = _before(model, n)
    report = normswap.convert(model, method="exact")
    assert report.method == "exact" and report.num_converted == 3
    with torch.no_grad():
        out = model(x)
    assert (out - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()


def test_text_samples_reach_the_position_limit():
    """The issue's config allows 64 positions: the samples run a 64-token row, past the 36-token branch."""
    lengths = [x["input_ids"].shape[1] for x in sample_inputs(LongRows())]
    assert max(lengths) == POSITIONS and min(lengths) < 36


@pytest.mark.parametrize("kind", ["buffer", "parameter"])
def test_a_path_only_36_tokens_take_converts_exactly_at_40(kind):
    """Issue 30: the buffer added from 36 tokens on was left uncentred (off by ~0.66 at 40 tokens); now the
    long sample row runs it and it is centred like a parameter (a buffer it stays, saved with the weights)."""
    model = LongRows(kind).eval()
    _converts_exactly_at(model, 40)
    assert abs(model.extra.mean().item()) < 1e-6
    assert isinstance(model.extra, nn.Parameter) == (kind == "parameter") and "extra" in model.state_dict()


def test_a_buffer_on_every_path_is_centred_like_a_parameter():
    model = LongRows("buffer", at=0).eval()
    _converts_exactly_at(model, 8)
    assert abs(model.extra.mean().item()) < 1e-6


@pytest.mark.parametrize("kind, name", [("buffer", r"extra \(buffer\)"), ("parameter", r"extra")])
def test_a_writer_no_sample_runs_is_refused_by_name(kind, name):
    """Added only from 100 tokens on, past every sample row: refused, naming it, the model untouched."""
    model = LongRows(kind, at=100).eval()
    x, ref = _before(model, 40)
    with pytest.raises(NotExact, match=rf"^cannot convert exactly: {name} did not run") as e:   # the name: the point
        normswap.convert(model, method="exact")
    assert e.value.cause is Cause.UNRUN
    assert isinstance(model.ln_f, nn.LayerNorm)
    with torch.no_grad():
        assert torch.equal(model(x), ref)


def test_a_buffer_the_model_rebuilds_is_never_edited():
    """A non-persistent buffer is rebuilt by the model's code, not loaded: no centring of it would last. Added on
    some sample rows only (20 tokens on), the stream is refused naming it; on every row, the stream it enters
    a block in is centred there instead (an input fix), and the buffer is left as it is."""
    model = LongRows("transient", at=20).eval()
    with pytest.raises(NotExact, match=r"the buffer extra \(not persistent") as e:   # what mixes it in, named
        normswap.convert(model, method="exact")
    assert e.value.cause is Cause.MIXED
    assert isinstance(model.ln_f, nn.LayerNorm)
    model = LongRows("transient", at=0).eval()
    extra = model.extra.clone()
    _converts_exactly_at(model, 40)
    assert torch.equal(model.extra, extra)


def test_position_ids_masks_and_rotary_tables_do_not_refuse():
    """Integer and bool buffers, a float mask no sample uses and a rotary table are not stream writers."""
    model = LongRows("parameter", at=0).eval()
    _converts_exactly_at(model, 20)
