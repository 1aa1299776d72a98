"""Model surgery: find LayerNorms, handle their biases with a method, swap in RMSNorm."""
from normswap.surgery.convert import convert
from normswap.surgery import exact as _exact  # noqa: F401  (registers exact, auto)
from normswap.surgery.methods import MethodResult, available_methods, register_method
from normswap.surgery.report import ConversionReport, NormRecord
from normswap.surgery.walk import NormSite, find_norms

__all__ = ["convert", "ConversionReport", "NormRecord", "NormSite", "find_norms", "MethodResult",
           "register_method", "available_methods"]
