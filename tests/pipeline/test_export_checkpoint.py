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


def test_bf16_is_refused_with_its_reason_before_loading(tmp_path):
    """Issue 33 #10: the README promised --dtype bf16 on every command; export takes it only to say why not
    (onnxruntime's CPU provider, which validates every export, has no bf16 kernels)."""
    from helpers.cli import one_error_line, run
    line = one_error_line(run("export", "normswap-demo", "--onnx", tmp_path / "m.onnx", "--dtype", "bf16"))
    assert line == ("error: cannot export --dtype bf16: every export is validated in onnxruntime on the CPU, which "
                    "has no bfloat16 kernels (MatMul, Add); export fp32 or fp16")
    assert list(tmp_path.iterdir()) == []
