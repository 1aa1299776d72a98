from __future__ import annotations

import pytest

from normswap.parity import reference
from normswap.surgery import exact, verification
from normswap.surgery.steps import Centre, Module


@pytest.fixture
def feed(monkeypatch):
    """Make the trace and the verification use the given inputs (a dict, or a list of dicts) instead of
    `model_inputs` (the model's samples and the user's examples)."""
    def use(inputs):
        listed = inputs if isinstance(inputs, list) else [inputs]
        for mod in (reference, exact, verification):
            monkeypatch.setattr(mod, "model_inputs", lambda model, *a, **k: listed)
        return listed
    return use


@pytest.fixture
def forgetful(monkeypatch):
    """Make the exact plan forget one source of a GPT-2 (transformers.h.0.mlp.c_proj is never centred)."""
    real = exact.plan

    def plan(model, sites, inputs=None, examples=None, **kw):
        p = real(model, sites, inputs, examples, **kw)
        forgotten = Module("transformer.h.0.mlp.c_proj")
        p.steps = [s for s in p.steps if not (isinstance(s, Centre) and s.target == forgotten)]
        return p
    monkeypatch.setattr(exact, "plan", plan)
