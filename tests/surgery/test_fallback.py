"""Issue 47 #2: `auto` falls back to naive only on a typed refusal (`NotExact`, with its `Cause`: "this model has
no exact form here, because ..."). Any other exception from tracing or deriving the plan is a bug of normswap's:
raised as it is from the Python API, one "internal error" line from the CLI (its traceback with -v), and never a
quietly changed model. A model whose own forward fails on its inputs is the model's problem: a refusal."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import normswap
from normswap.errors import FellBackToNaive
from normswap.surgery import plan as plan_mod
from normswap.surgery.labels import Cause, NotExact
from normswap.surgery.record import Recorder
from helpers.cli import run
from helpers.exact_models import build


def boom(*args, **kwargs):
    raise KeyError("planted")


def _state(model: nn.Module) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _same(before: dict, model: nn.Module) -> bool:
    return all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("where", ["derivation", "tracer"])
def test_a_bug_under_auto_is_raised_not_fallen_back(monkeypatch, where):
    """A KeyError planted in the plan's derivation, or in the tracer (inside the model's forward), was a refusal
    ("the exact plan could not be derived (KeyError ...)", "tracing failed: KeyError ...") and a naive model."""
    if where == "derivation":
        monkeypatch.setattr(plan_mod, "_bias_fate", boom)
    else:
        monkeypatch.setattr(Recorder, "post", boom)
    model = build("gpt2")
    before = _state(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FellBackToNaive)
        with pytest.raises(KeyError, match="planted"):
            normswap.convert(model, method="auto")
    assert _same(before, model) and isinstance(model.transformer.ln_f, nn.LayerNorm)


def test_a_tracer_bug_the_models_code_swallows_is_still_raised(monkeypatch):
    """The model's own try/except caught the tracer's failure and went on: the trace is still not to be trusted."""
    class Forgiving(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.ln, self.head = nn.Embedding(10, 8), nn.LayerNorm(8), nn.Linear(8, 10)

        def forward(self, input_ids):
            try:
                return self.head(self.ln(self.emb(input_ids)))
            except KeyError:
                return self.head(self.emb(input_ids))
    monkeypatch.setattr(Recorder, "post", boom)
    with pytest.raises(KeyError, match="planted"):
        normswap.convert(Forgiving(), method="auto", example_inputs={"input_ids": torch.arange(6)[None]})


class Fails(nn.Module):
    """A model whose own forward fails on its inputs once they are traced (the model's problem, not normswap's)."""

    def __init__(self):
        super().__init__()
        self.emb, self.ln, self.head = nn.Embedding(10, 8), nn.LayerNorm(8), nn.Linear(8, 10)

    def forward(self, input_ids):
        if torch.overrides.has_torch_function_variadic(self.emb.weight):   # only where a mode is set: the trace
            raise ValueError("this model refuses to be traced")
        return self.head(self.ln(self.emb(input_ids)))


def test_a_model_whose_forward_fails_is_refused_and_auto_falls_back():
    batch = {"input_ids": torch.arange(6)[None]}
    with pytest.raises(NotExact) as e:
        normswap.convert(Fails(), method="exact", example_inputs=batch)
    assert e.value.cause is Cause.FORWARD
    with pytest.warns(FellBackToNaive):
        report = normswap.convert(Fails(), method="auto", example_inputs=batch)
    assert report.method == "naive"


def test_the_cli_says_internal_error_in_one_line_and_shows_the_traceback_with_v(monkeypatch, tmp_path):
    monkeypatch.setattr(plan_mod, "_bias_fate", boom)
    r = run("convert", "normswap-demo", "--to", "rmsnorm", "-o", tmp_path / "out")
    assert r.exit_code == 1 and r.output.strip().splitlines() == \
        ["internal error: KeyError: 'planted' (run with -v for the traceback)"], r.output
    assert not (tmp_path / "out").exists()
    r = run("-v", "convert", "normswap-demo", "--to", "rmsnorm", "-o", tmp_path / "out")
    lines = r.output.strip().splitlines()
    assert r.exit_code == 1 and "Traceback (most recent call last):" in lines and "_bias_fate" in r.output
    assert lines[-1] == "internal error: KeyError: 'planted'" and not (tmp_path / "out").exists()
