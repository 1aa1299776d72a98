"""export_onnx(model, example_inputs=...) for modules without a transformers config, whatever they return
(a tensor, a tuple, a nested dict): fused norm nodes, outputs named as parity names them, ORT vs PyTorch on
other batch sizes and lengths."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

import onnx  # noqa: E402
from helpers.restore_models import DictOut, PairOut, built  # noqa: E402
from helpers.user_models import gpt  # noqa: E402

import normswap  # noqa: E402
from normswap.errors import NormswapError  # noqa: E402
from normswap.export import fuse, validate  # noqa: E402


def gpt_batch(n: int, t: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"idx": torch.randint(0, 61, (n, t), generator=g), "prefix": torch.randn(n, 8, generator=g)}


def feature_batch(n: int, t: int, seed: int = 0) -> dict:
    return {"x": torch.randn(n, t, 12, generator=torch.Generator().manual_seed(seed))}


# case -> (model, batch(n, t, seed), norms, graph outputs)
CASES = {"tensor": (lambda: gpt(), gpt_batch, 5, ["output"]),
         "tuple": (lambda: built(PairOut), feature_batch, 3, ["0", "1"]),
         "dict": (lambda: built(DictOut), feature_batch, 3, ["features", "heads.logits", "heads.probs"])}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """case -> (converted model, report, path): each converted exactly and exported once."""
    out = {}
    for case, (make, batch, _, _) in CASES.items():
        model = make()
        assert normswap.convert(model, method="exact", example_inputs=[batch(2, 8), batch(1, 5, 1)]).method == "exact"
        path = tmp_path_factory.mktemp("onnx") / f"{case}.onnx"
        out[case] = (model, normswap.export_onnx(model, path, example_inputs=batch(2, 8)), path)
    return out


def flat(out) -> list[torch.Tensor]:
    if isinstance(out, dict):
        return [t for v in out.values() for t in flat(v)]
    return [t for v in out for t in flat(v)] if isinstance(out, tuple) else [out]


@pytest.mark.parametrize("case", CASES)
def test_onnx_matches_pytorch_on_other_shapes(exported, case):
    model, report, path = exported[case]
    _, batch, norms, names = CASES[case]
    sess = validate.session(path)
    assert [o.name for o in sess.get_outputs()] == names
    assert [i.name for i in sess.get_inputs()] == list(batch(1, 2))
    for n, t, seed in ((3, 11, 4), (1, 4, 5), (5, 16, 6)):
        inputs = batch(n, t, seed)
        got = sess.run(names, {k: v.numpy() for k, v in inputs.items()})
        with torch.no_grad():
            want = flat(model(**inputs))
        assert len(got) == len(want)
        for g, w in zip(got, want):
            w = w.double().numpy()
            assert g.shape == w.shape
            assert np.abs(g - w).max() <= 1e-4 * np.abs(w).max()
    assert report.validated and report.output == ", ".join(names)
    assert any("batch size doubled" in r["inputs"] for r in report.parity)


@pytest.mark.parametrize("case", CASES)
def test_every_norm_is_one_fused_node(exported, case):
    _, report, path = exported[case]
    norms = CASES[case][2]
    assert report.norms["rmsnorm"] == norms and report.norms["layernorm"] == 0
    graph = fuse.norm_nodes(onnx.load(str(path)))
    assert sum(graph[k] for k in fuse.RMS_OPS) == norms and fuse.decomposed_rms(onnx.load(str(path))) == 0
    assert sum(report.fused.get(k, 0) for k in fuse.RMS_OPS) == norms


@pytest.mark.parametrize("case", CASES)
def test_the_fingerprint_is_the_conversions_probe_by_the_graphs_names(exported, case):
    """The first example batch the module was converted on, by the graph's input names; its outputs' digest by the
    graph's output names (nested ones flattened, as the graph returns them)."""
    model, report, path = exported[case]
    props = {p.key: p.value for p in onnx.load(str(path)).metadata_props}
    found = json.loads(props["normswap.fingerprint"])
    probe = model.normswap_section["fingerprint"]["probe"]["kwargs"]["dict"]
    assert found["probe_from"] == "model" and found["probe"]["dict"] == {k: probe[k] for k in found["probe"]["dict"]}
    assert list(found["probe"]["dict"]) == list(CASES[case][1](1, 2))
    assert list(found["outputs"]) == CASES[case][3]
    assert report.fingerprint["checked"] and validate.check_fingerprint(path) is True


def test_report_names_each_output(exported):
    table = str(exported["dict"][1])
    assert "max |Δheads.probs| ORT vs PyTorch on example batch 0 (x 2x8x12)" in table


def one_line_error(call) -> str:
    with pytest.raises(NormswapError) as e:
        call()
    assert "\n" not in str(e.value)
    return str(e.value)


def test_bad_calls_are_one_line_errors(tmp_path):
    model = built(PairOut)
    assert "example_inputs" in one_line_error(lambda: normswap.export_onnx(model, tmp_path / "a.onnx"))
    assert "does not fit PairOut.forward" in one_line_error(
        lambda: normswap.export_onnx(model, tmp_path / "a.onnx", example_inputs={"y": torch.randn(1, 2, 12)}))
    assert "with_past" in one_line_error(lambda: normswap.export_onnx(
        model, tmp_path / "a.onnx", with_past=True, example_inputs=torch.randn(1, 2, 12)))
    assert not list(tmp_path.iterdir())
