"""ONNX export with fused RMSNorm nodes, validated in onnxruntime: `export_onnx` (one file) and
`export_folder` (a deployment folder); `check_fingerprint` checks a file against the fingerprint in its metadata.
A lazy facade: the code lives in the modules beside it."""
from normswap.facade import lazy

PUBLIC = {"export_onnx": "normswap.export.onnx", "TARGETS": "normswap.export.onnx",
          "export_folder": "normswap.export.folder", "ExportReport": "normswap.export.report",
          "check_fingerprint": "normswap.export.validate"}
__all__ = list(PUBLIC)
__getattr__, __dir__ = lazy(__name__, PUBLIC)
