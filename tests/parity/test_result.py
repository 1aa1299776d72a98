"""NaN-safe JSON, one rule for every report (`parity.json_safe`): non-finite floats become null, at any depth."""
from __future__ import annotations

import json
import math

from normswap.evaluation import EvalReport
from normswap.parity import Parity, json_safe


def test_non_finite_floats_become_none_at_any_depth():
    v = {"a": math.nan, "b": [1.0, math.inf, {"c": -math.inf}], "d": (2, "x"), "e": None, "f": 0.5}
    assert json_safe(v) == {"a": None, "b": [1.0, None, {"c": None}], "d": [2, "x"], "e": None, "f": 0.5}


def test_an_eval_report_with_nan_is_valid_json_with_its_error():
    r = EvalReport("parity", max_rel=math.nan, max_abs=1.0, output="logits", compared=["logits"],
                   excluded={"hidden_states": "why"})
    d = json.loads(json.dumps(r.to_dict(), allow_nan=False))
    assert d["max_rel"] is None and d["max_abs"] == 1.0 and d["compared"] == ["logits"]
    assert d["excluded"] == {"hidden_states": "why"} and d["error"].startswith("non-finite max_rel")
    assert "error" not in EvalReport("causal-lm", perplexity=2.0).to_dict()


def test_a_parity_with_nan_is_valid_json():
    p = Parity(math.nan, math.inf, None, "logits", nonfinite=3, outputs={"logits": {"max_abs": math.nan}})
    d = json.loads(json.dumps(p.to_dict(), allow_nan=False))
    assert d["max_abs"] is None and d["max_rel"] is None and d["outputs"] == {"logits": {"max_abs": None}}
