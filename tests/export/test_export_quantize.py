"""`normswap export --quantize int8`: the validated fp32 graph is written as its dynamic int8 quantization (integer
MatMuls, fused norm nodes kept), its error against PyTorch measured and reported; a broken one is refused and
nothing is written; bad combinations are one line."""
from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

import onnx  # noqa: E402
import onnxruntime.quantization as ortq  # noqa: E402
from helpers.cli import one_error_line, run  # noqa: E402
from helpers.export_models import converted, talkative  # noqa: E402

import normswap  # noqa: E402
from normswap.errors import NormswapError  # noqa: E402
from normswap.export import validate  # noqa: E402
from normswap.export.report import ExportReport  # noqa: E402


pytestmark = pytest.mark.slow   # ONNX exports, then int8 quantization measured


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(the model, its folder, the JSON report of `normswap export -o DIR --quantize int8`: with the past)."""
    root = tmp_path_factory.mktemp("int8")
    model = talkative("gpt2")
    normswap.save_pretrained(model, root / "src")
    result = run("export", root / "src", "-o", root / "out", "--quantize", "int8", "--device", "cpu", "--json")
    assert result.exit_code == 0, result.output
    return model, root / "out", json.loads(result.output.strip().splitlines()[-1])


def test_the_int8_graph_has_integer_matmuls_and_keeps_the_fused_norms(exported):
    _, out, report = exported
    graph = onnx.load(str(out / "model.onnx"))
    ops = Counter(n.op_type for n in graph.graph.node)
    # 2 layers x (qkv, attention out, mlp in, mlp out) + the LM head; attention's own MatMuls stay float
    assert ops["MatMulInteger"] == 9 and ops["DynamicQuantizeLinear"] == 9 and ops["MatMul"] == 4
    assert ops["SkipSimplifiedLayerNormalization"] == 5 and report["fused"] == {"SkipSimplifiedLayerNormalization": 5}
    weights = [t for t in graph.graph.initializer if t.data_type == onnx.TensorProto.INT8 and len(t.dims) == 2]
    assert len(weights) == 9   # (and as many int8 zero points, one per output channel)
    q = report["quantized"]
    assert q["ops"] == {"MatMulInteger": 9, "DynamicQuantizeLinear": 9, "MatMul": 4}
    assert q["bytes"]["int8"] < q["bytes"]["fp32"] and report["with_past"] and report["validated"]
    assert (out / "genai_config.json").exists()


def test_the_int8_file_carries_no_fingerprint_and_says_why(exported):
    """The fp32 graph reproduced its fingerprint before quantization; int8 does not, by design (error measured)."""
    _, out, report = exported
    props = {p.key: p.value for p in onnx.load(str(out / "model.onnx"), load_external_data=False).metadata_props}
    why = json.loads(props["normswap.fingerprint"])["none"]
    assert why.startswith("an int8 quantization is not exact") and report["fingerprint"] == {"none": why}
    with pytest.warns(UserWarning, match="no fingerprint to check"):
        assert validate.check_fingerprint(out / "model.onnx") is False


@torch.no_grad()
def test_the_reported_error_is_measured_against_pytorch(exported):
    model, out, report = exported
    sess = validate.session(out / "model.onnx")
    kls, agree, rels, n = [], 0, [], 0
    for batch, seq in validate.SIZES:   # the validation inputs, recomputed here
        feed = validate.with_positions(sess, validate.random_inputs(model, batch, seq))
        feed.update(validate.empty_past(model, batch, np.float32))
        keep = torch.from_numpy(feed["attention_mask"]).bool()
        got = torch.from_numpy(sess.run(["logits"], feed)[0]).double()[keep]
        ref = model(input_ids=torch.from_numpy(feed["input_ids"]),
                    attention_mask=torch.from_numpy(feed["attention_mask"])).logits.double()[keep]
        p, q = ref.log_softmax(-1), got.log_softmax(-1)
        kls.append((p.exp() * (p - q)).sum(-1))
        agree += int((got.argmax(-1) == ref.argmax(-1)).sum())
        n += len(ref)
        rels.append(float((got - ref).abs().max() / ref.abs().max()))
    q = report["quantized"]
    assert q["positions"] == n and q["top1"] == pytest.approx(agree / n)
    assert q["kl"] == pytest.approx(float(torch.cat(kls).mean()), rel=1e-6)
    assert q["max_rel"] == pytest.approx(max(rels), rel=1e-6)
    # plausible for int8: not exact, not broken
    assert 1e-4 < q["max_rel"] < 0.1 and 1e-7 < q["kl"] < 1e-2 and q["top1"] >= 0.9 and q["finite"]
    text = ExportReport(**{k: v for k, v in report.items() if k != "max_abs"}).to_table()
    assert f"top-1 agreement {q['top1']:.1%} over {n} positions" in text and "9 MatMulInteger" in text


def _corrupted(how: str):
    """quantize_dynamic, then its output broken: NaN weight scales, or every int8 weight matrix shuffled."""
    real = ortq.quantize_dynamic

    def quantize_dynamic(src, dst, **kw):
        real(src, dst, **kw)
        m = onnx.load(str(dst))
        g = np.random.default_rng(0)
        for t in m.graph.initializer:
            a = onnx.numpy_helper.to_array(t)
            if how == "nan" and t.name.endswith("_scale"):
                t.CopyFrom(onnx.numpy_helper.from_array(np.full_like(a, np.nan), t.name))
            elif how == "shuffled" and a.dtype == np.int8 and a.ndim == 2:
                t.CopyFrom(onnx.numpy_helper.from_array(g.permutation(a.ravel()).reshape(a.shape), t.name))
        onnx.save(m, str(dst))
    return quantize_dynamic


@pytest.mark.parametrize("how, why", [("nan", "gives NaN/inf"), ("shuffled", r"agrees with the fp32 model's at "
                                                                             r"\d+% of positions \(< 50%")])
def test_a_broken_int8_model_is_refused_and_nothing_is_written(monkeypatch, tmp_path, how, why):
    monkeypatch.setattr(ortq, "quantize_dynamic", _corrupted(how))
    with pytest.raises(NormswapError, match=f"the int8 model is broken: .*{why}"):
        normswap.export_onnx(converted("gpt2"), tmp_path / "m.onnx", quantize="int8")
    assert list(tmp_path.iterdir()) == []


def test_bad_combinations_are_one_line(tmp_path):
    out = tmp_path / "x"
    line = one_error_line(run("export", "normswap-demo", "-o", out, "--quantize", "int8", "--dtype", "fp16"))
    assert "--quantize int8 quantizes the fp32 graph" in line and "leave out --dtype fp16" in line
    assert "'int4' is not 'int8'" in one_error_line(run("export", "normswap-demo", "-o", out, "--quantize",
                                                               "int4"), code=2)
    with pytest.raises(NormswapError, match="unknown quantization 'int4': choose int8"):
        normswap.export_onnx(converted("gpt2"), tmp_path / "m.onnx", quantize="int4")
    with pytest.raises(NormswapError, match="leave out dtype='fp16'"):
        normswap.export_onnx(converted("gpt2"), tmp_path / "m.onnx", quantize="int8", dtype="fp16")
    assert list(tmp_path.iterdir()) == []
