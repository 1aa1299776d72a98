"""normswap: turn a trained model's LayerNorms into (fast) RMSNorm, verify it, ship it."""
from normswap import io
from normswap.errors import NormswapError
from normswap.export import ExportReport, export_onnx
from normswap.io import from_pretrained, load_model, save_pretrained
from normswap.norms import PartialRMSNorm, RMSNorm
from normswap.surgery import ConversionReport, convert
from normswap.evaluate import EvalReport, evaluate
from normswap.heal import HealReport, heal

__version__ = "0.1.0"
__all__ = ["RMSNorm", "PartialRMSNorm", "convert", "ConversionReport", "save_pretrained", "from_pretrained",
           "load_model", "NormswapError", "io", "export_onnx", "ExportReport"]
__all__ += ["heal", "HealReport", "evaluate", "EvalReport"]
