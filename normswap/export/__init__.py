"""ONNX export with fused RMSNorm nodes, validated in onnxruntime: `export_onnx` (one file) and
`export_folder` (a deployment folder). A lazy facade: the code lives in the modules beside it."""
from normswap.facade import lazy

PUBLIC = {"export_onnx": "normswap.export.onnx", "TARGETS": "normswap.export.onnx",
          "export_folder": "normswap.export.folder", "ExportReport": "normswap.export.report"}
__all__ = list(PUBLIC)
__getattr__, __dir__ = lazy(__name__, PUBLIC)
