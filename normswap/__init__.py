"""normswap: turn a trained model's LayerNorms into (fast) RMSNorm, verify it, ship it.

A lazy facade (PEP 562): each public name is imported from its module on first use, so `import
normswap.norms` or `normswap.ops` does not import transformers, ONNX or the rest of the package.
"""
from normswap.facade import lazy

__version__ = "0.1.0"
PUBLIC = {
    "RMSNorm": "normswap.norms", "PartialRMSNorm": "normswap.norms",
    "convert": "normswap.surgery.convert", "ConversionReport": "normswap.surgery.report",
    "convert_checkpoint": "normswap.pipeline.convert", "ConvertOptions": "normswap.pipeline.options",
    "ConvertResult": "normswap.pipeline.convert",
    "heal_checkpoint": "normswap.pipeline.heal", "HealCheckpointOptions": "normswap.pipeline.options",
    "evaluate_checkpoint": "normswap.pipeline.evaluate", "EvaluateOptions": "normswap.pipeline.options",
    "export_checkpoint": "normswap.pipeline.export", "ExportOptions": "normswap.pipeline.options",
    "inspect_checkpoint": "normswap.pipeline.inspect", "InspectOptions": "normswap.pipeline.options",
    "rotate_checkpoint": "normswap.pipeline.rotate", "RotateOptions": "normswap.pipeline.options",
    "generate_checkpoint": "normswap.pipeline.generate", "GenerateOptions": "normswap.pipeline.options",
    "LoadOptions": "normswap.models.load", "load_model": "normswap.models.load",
    "save_pretrained": "normswap.models.save",
    "from_pretrained": "normswap.models.rebuild", "restore": "normswap.models.restore",
    "heal": "normswap.healing.loop", "HealReport": "normswap.healing.report",
    "HealOptions": "normswap.healing.options", "LoraOptions": "normswap.healing.options",
    "evaluate": "normswap.evaluation", "EvalReport": "normswap.evaluation",
    "export_onnx": "normswap.export.onnx", "export_folder": "normswap.export.folder",
    "ExportReport": "normswap.export.report",
    "rotate": "normswap.surgery.rotate", "RotationReport": "normswap.surgery.rotate",
    "fuse_residual_norms": "normswap.surgery.add_norm", "unfuse_residual_norms": "normswap.surgery.add_norm",
    "NormswapError": "normswap.errors", "FellBackToNaive": "normswap.errors",
}
__all__ = list(PUBLIC)
__getattr__, __dir__ = lazy(__name__, PUBLIC)
