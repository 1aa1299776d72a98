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
from normswap.export.quantize import online_factors  # noqa: E402


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


def _online_llama():
    from surgery.test_rotate_rmsnorm import tiny
    model = tiny("llama")
    assert len(normswap.rotate(model, heads=True, online=True).online) == 2
    return model


def test_an_online_rotated_model_exports_its_fast_transform_and_validates(tmp_path):
    """`rotate(..., online=True)`: the transform is traced as reshapes, adds and subtractions (the butterflies) and
    one small matmul (the 12 x 12 factor of width 48 = 4 x 12), never a dense 48 x 48 matrix; onnxruntime gives the
    model's logits."""
    onnx = pytest.importorskip("onnx")
    exported = normswap.export_onnx(_online_llama(), tmp_path / "m.onnx")
    assert exported.validated and all(r["max_abs"] <= exported.tolerance for r in exported.parity)
    graph = onnx.load(str(tmp_path / "m.onnx")).graph
    assert len(online_factors(graph)) == 2
    shapes = {i.name: list(i.dims) for i in graph.initializer}
    assert sum(name.endswith("normswap_online_signs") and dims == [48] for name, dims in shapes.items()) == 2
    assert [12, 12] in shapes.values() and [48, 48] not in shapes.values()
    assert sum(n.op_type == "Sub" for n in graph.node) >= 2 * 2   # two butterfly stages (p = 4) per layer


@pytest.mark.slow   # an export and its int8 quantization, both validated
def test_int8_keeps_the_online_factor_matmul_in_fp32(tmp_path):
    onnx = pytest.importorskip("onnx")
    exported = normswap.export_onnx(_online_llama(), tmp_path / "m.onnx", quantize="int8")
    assert exported.quantized["ops"]["MatMulInteger"] == 2 * 7 + 1 and exported.quantized["top1"] > 0.9
    graph = onnx.load(str(tmp_path / "m.onnx")).graph
    assert len(online_factors(graph)) == 2   # still MatMul by the factor, not MatMulInteger
