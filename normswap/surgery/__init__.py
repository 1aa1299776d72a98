"""Model surgery: find LayerNorms by behaviour (walk, probe), plan the exact conversion from one traced
forward (trace, plan, exact), edit the weights (algebra, centring), swap in RMSNorm (convert). A lazy facade."""
from normswap.facade import lazy

PUBLIC = {"convert": "normswap.surgery.convert", "convert_with": "normswap.surgery.convert",
          "METHODS": "normswap.surgery.convert", "ConversionReport": "normswap.surgery.report",
          "NormRecord": "normswap.surgery.report", "NormSite": "normswap.surgery.walk",
          "find_norms": "normswap.surgery.walk", "MethodResult": "normswap.surgery.methods",
          "ExactSteps": "normswap.surgery.methods"}
__all__ = list(PUBLIC)
__getattr__, __dir__ = lazy(__name__, PUBLIC)
