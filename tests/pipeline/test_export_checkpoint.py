"""`export_checkpoint`: a SRC exported to ONNX (a folder or one file) and validated, from Python."""
from __future__ import annotations

import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from normswap.errors import NormswapError  # noqa: E402
from normswap.pipeline import ExportOptions, export_checkpoint  # noqa: E402


def test_exports_one_validated_onnx_file(gpt2_dir, tmp_path):
    report = export_checkpoint(str(gpt2_dir), options=ExportOptions(onnx=str(tmp_path / "m.onnx"), device="cpu"))
    assert (tmp_path / "m.onnx").exists() and report.path == str(tmp_path / "m.onnx") and report.validated
    assert (report.target, report.fp16, report.with_past, report.opset) == ("ort", False, False, 18)
    assert report.max_abs <= report.tolerance


@pytest.mark.parametrize("out, onnx", [(None, None), ("folder", "m.onnx")])
def test_exactly_one_output_is_required(tmp_path, out, onnx):
    with pytest.raises(NormswapError, match="give exactly one of out"):
        export_checkpoint("normswap-demo", out and str(tmp_path / out),
                          ExportOptions(onnx=onnx and str(tmp_path / onnx)))
    assert list(tmp_path.iterdir()) == []
