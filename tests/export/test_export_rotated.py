"""Export of rotated models: a parallel block's two norms read the same stream and, once the rotation set both
gains to 1, compute the same thing; the exporter keeps one node for both, and validation counts it so. And the
fixes of exact conversions, exported."""
from __future__ import annotations

import copy

import pytest
import torch

import normswap

pytest.importorskip("onnxruntime")
from helpers.exact_models import build  # noqa: E402
from normswap.export.norm_nodes import norm_calls  # noqa: E402


def _rotated(name: str):
    model = build(name)
    normswap.convert(model, method="exact")
    before = copy.deepcopy(model)
    normswap.rotate(model, seed=1)
    return before, model


def test_norms_computing_the_same_thing_are_counted_once():
    before, rotated = _rotated("gpt_neox-parallel")
    batch = {"input_ids": torch.randint(0, 50, (1, 6))}
    # before: each block's two norms read one stream with different gains; after: equal gains (1)
    assert norm_calls(before, batch) == ({"lowered": 5, "rmsnorm": 5, "layernorm": 0},
                                         {"lowered": 0, "rmsnorm": 0, "layernorm": 0})
    assert norm_calls(rotated, batch) == ({"lowered": 5, "rmsnorm": 5, "layernorm": 0},
                                          {"lowered": 2, "rmsnorm": 2, "layernorm": 0})


def test_a_rotated_parallel_block_model_exports_and_validates(tmp_path):
    """Refused before: '5 RMSNorm vs 3 fused RMS nodes' (the exporter merged each block's identical norms)."""
    _, rotated = _rotated("gpt_neox-parallel")
    report = normswap.export_onnx(rotated, tmp_path / "m.onnx")
    assert report.validated and sum(report.fused.values()) == 3, report.fused   # one per block, and ln_f
    assert all(r["max_abs"] <= report.tolerance for r in report.parity)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["bloom", "gpt2-wide-vocab"])
def test_an_exact_conversions_fixes_export_and_validate(tmp_path, family):
    """A norm's own fixes (BLOOM's embedding norm: its output centred, its bias after it) stay around its fused
    node; a tied embedding's centring and the head's folded bias export as the ops they are."""
    model = build(family)
    normswap.convert(model, method="exact")
    report = normswap.export_onnx(model, tmp_path / "m.onnx")
    assert report.validated and all(r["max_abs"] <= report.tolerance for r in report.parity)
