"""benchmarks/third_party.py (the unseen third-party sweep) keeps working where its libraries are not installed
(CI): its judging machinery on small local models, each row classified as the sweep classifies a library's."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("third_party", ROOT / "benchmarks" / "third_party.py")
third_party = sys.modules["third_party"] = importlib.util.module_from_spec(spec)   # dataclasses look it up
spec.loader.exec_module(third_party)
D = 16


class PreLN(nn.Module):
    def __init__(self, post: bool = False):
        super().__init__()
        self.post = post
        self.emb, self.ln, self.fc = nn.Embedding(40, D), nn.LayerNorm(D), nn.Linear(D, D)
        self.ln_f, self.head = nn.LayerNorm(D), nn.Linear(D, 5)
        if post:
            self.ln_p, self.fc2 = nn.LayerNorm(D), nn.Linear(D, D)

    def forward(self, ids):
        x = self.emb(ids)
        x = x + self.fc(self.ln(x))
        if self.post:   # post-LN blocks after it: their norms' outputs are the stream (kept); ln converts
            x = self.ln_p(self.ln_f(x) + self.fc2(self.ln_f(x)))
            return self.head(x + self.fc2(x))
        return self.head(self.ln_f(x))


def case(post: bool = False) -> third_party.Case:
    return third_party.Case("local", "post-LN" if post else "pre-LN", lambda: PreLN(post),
                            [torch.randint(0, 40, (2, 6))], [torch.randint(0, 40, (3, 9))])


def test_a_pre_ln_model_is_exact():
    row = third_party.judge(case(), exports=False)
    assert (row.result, row.onnx, row.restore) == ("EXACT", "-", "-"), row
    assert "2 converted of 2 LayerNorm(s), 0 kept" in row.detail


@pytest.mark.slow
def test_a_pre_ln_model_is_exact_exports_and_restores():
    row = third_party.judge(case())
    assert (row.result, row.onnx[:2], row.restore) == ("EXACT", "OK", "OK (bit-identical)"), row
    assert "2 converted of 2 LayerNorm(s), 0 kept" in row.detail


def test_a_post_ln_norm_is_kept_and_named():
    row = third_party.judge(case(post=True), exports=False)
    assert row.result == "PARTIAL" and "2 kept" in row.detail and "(kept: ln_f, ln_p)" in row.detail, row


def test_library_code_that_fails_is_unbuilt_and_a_missing_library_is_a_row(tmp_path):
    broken = third_party.Case("local", "broken", lambda: PreLN(), [torch.zeros(2, 6, dtype=torch.long)],
                              [torch.full((1, 3), 99)])   # id 99 > vocabulary: the model itself fails
    assert third_party.judge(broken).result == "unbuilt"
    rows = third_party.rows_of("nolib", "no_such_module_for_the_sweep", lambda: [case()], None, False)
    assert [(r.library, r.result) for r in rows] == [("nolib", "not installed")]


@pytest.mark.parametrize("result", ["WRONG", "CRASH"])
def test_a_wrong_or_crashed_row_fails_the_run(tmp_path, monkeypatch, result):
    monkeypatch.setattr(third_party, "ISSUE48", {"local": ("torch", lambda: [case()])})
    monkeypatch.setattr(third_party, "judge", lambda c, exports: third_party.Row(c.library, c.name, result, "x"))
    assert third_party.main(["--out", str(tmp_path)]) == 1
    rows = json.loads((tmp_path / "third_party.json").read_text())["rows"]
    assert rows[0]["result"] == result and f"| local | pre-LN | {result} |" in (tmp_path / "third_party.md").read_text()
