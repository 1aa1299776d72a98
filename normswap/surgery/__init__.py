"""Model surgery: find LayerNorms by behaviour (walk, probe), plan the exact conversion from one traced
forward (trace, plan: typed steps, exact), carry it out (interpret: algebra, centring), swap in RMSNorm (convert).
A lazy facade."""
from normswap.facade import lazy

PUBLIC = {"convert": "normswap.surgery.convert", "convert_with": "normswap.surgery.convert",
          "METHODS": "normswap.surgery.convert", "ConversionReport": "normswap.surgery.report",
          "NormRecord": "normswap.surgery.report", "NormSite": "normswap.surgery.walk",
          "find_norms": "normswap.surgery.walk", "MethodResult": "normswap.surgery.methods",
          "ExactSteps": "normswap.surgery.methods", "Method": "normswap.surgery.methods",
          "Skipped": "normswap.surgery.walk", "Skip": "normswap.surgery.walk", "Cause": "normswap.surgery.labels",
          "NotExact": "normswap.surgery.labels"}
__all__ = list(PUBLIC)
__getattr__, __dir__ = lazy(__name__, PUBLIC)
