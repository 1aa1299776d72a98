"""normswap: turn a trained model's LayerNorms into (fast) RMSNorm, verify it, ship it.

The verbs take a model in memory or a path (a folder, a Hub id or "normswap-demo") and either their options
object or its fields as keywords (`normswap.pipeline.verbs`); `load`, `save` and `restore` move models in and
out. A lazy facade (PEP 562): each name is imported from its module on first use, so `import normswap.norms` or
`normswap.ops` does not import transformers, ONNX or the rest of the package.
"""
from normswap.facade import lazy

__version__ = "0.1.0"
VERBS = "normswap.pipeline.verbs"
OPTIONS = "normswap.pipeline.options"
PUBLIC = {
    "convert": VERBS, "heal": VERBS, "rotate": VERBS, "export_onnx": VERBS, "evaluate": VERBS, "inspect": VERBS,
    "load": "normswap.models.load:load_model", "save": "normswap.models.save:save_pretrained",
    "restore": "normswap.models.restore",
    "ConvertOptions": OPTIONS, "RotateOptions": OPTIONS, "ExportOptions": OPTIONS, "EvaluateOptions": OPTIONS,
    "HealCheckpointOptions": OPTIONS, "HealOptions": "normswap.healing.options", "LoadOptions": "normswap.models.load",
    "RMSNorm": "normswap.norms", "PartialRMSNorm": "normswap.norms",
    "NormswapError": "normswap.errors", "FellBackToNaive": "normswap.errors",
}
# Old names, for one release: each use warns, naming what to use instead.
DEPRECATED = {
    "convert_checkpoint": ("normswap.pipeline.convert", "normswap.convert(src, out, options)"),
    "heal_checkpoint": ("normswap.pipeline.heal", "normswap.heal(src, out, options)"),
    "evaluate_checkpoint": ("normswap.pipeline.evaluate", "normswap.evaluate(src, options)"),
    "export_checkpoint": ("normswap.pipeline.export", "normswap.export_onnx(src, onnx, options, out=...)"),
    "inspect_checkpoint": ("normswap.pipeline.inspect", "normswap.inspect(src, options)"),
    "rotate_checkpoint": ("normswap.pipeline.rotate", "normswap.rotate(src, out, options)"),
    "generate_checkpoint": ("normswap.pipeline.generate", "normswap.pipeline.generate.generate_checkpoint"),
    "load_model": ("normswap.models.load", "normswap.load(src, options)"),
    "save_pretrained": ("normswap.models.save", "normswap.save"),
    "from_pretrained": ("normswap.models.rebuild", "normswap.load(folder) (the model and its tokenizer)"),
    "export_folder": ("normswap.export.folder", "normswap.export_onnx(model, out=folder)"),
    **{name: (where, f"{where}.{name}") for name, where in {
        "ConvertResult": "normswap.pipeline.convert",
        "InspectOptions": OPTIONS, "GenerateOptions": OPTIONS, "LoraOptions": "normswap.healing.options",
        "ConversionReport": "normswap.surgery.report", "HealReport": "normswap.healing.report",
        "EvalReport": "normswap.evaluation", "ExportReport": "normswap.export.report",
        "RotationReport": "normswap.surgery.rotate", "fuse_residual_norms": "normswap.surgery.add_norm",
        "unfuse_residual_norms": "normswap.surgery.add_norm"}.items()},
}
__all__ = list(PUBLIC)
__getattr__, __dir__ = lazy(__name__, PUBLIC, DEPRECATED)
