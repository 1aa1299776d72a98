"""normswap: turn a trained model's LayerNorms into (fast) RMSNorm, verify it, ship it."""
import sys

if sys.argv[:1] == ["-m"] or sys.argv[0].endswith("normswap"):  # the CLI is starting (python -m / script)
    from normswap.errors import one_line_interrupts  # before torch loads: Ctrl-C then is one line too
    one_line_interrupts()
from normswap import io
from normswap.errors import NormswapError
from normswap.evaluate import EvalReport, evaluate
from normswap.export import ExportReport, export_folder, export_onnx
from normswap.heal import HealReport, heal
from normswap.io import from_pretrained, load_model, save_pretrained
from normswap.norms import PartialRMSNorm, RMSNorm
from normswap.surgery import ConversionReport, convert
from normswap.surgery.fuse import fuse_residual_norms, unfuse_residual_norms

__version__ = "0.1.0"
__all__ = ["RMSNorm", "PartialRMSNorm", "convert", "ConversionReport", "load_model", "save_pretrained",
           "from_pretrained", "heal", "HealReport", "evaluate", "EvalReport", "export_onnx", "export_folder",
           "ExportReport",
           "fuse_residual_norms", "unfuse_residual_norms", "NormswapError", "io"]
