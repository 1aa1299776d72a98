"""normswap: turn a trained model's LayerNorms into (fast) RMSNorm, verify it, ship it."""
from normswap import io
from normswap.errors import NormswapError
from normswap.io import from_pretrained, load_model, save_pretrained
from normswap.norms import PartialRMSNorm, RMSNorm
from normswap.surgery import ConversionReport, convert

__version__ = "0.1.0"
__all__ = ["RMSNorm", "PartialRMSNorm", "convert", "ConversionReport", "save_pretrained", "from_pretrained",
           "load_model", "NormswapError", "io"]
