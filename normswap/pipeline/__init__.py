"""The workflows behind every command, one library function per verb (optimum's `main_export` behind its
CLI): the CLI parses, calls one of these, and prints. A lazy facade (PEP 562)."""
from normswap.facade import lazy

PUBLIC = {
    "convert_checkpoint": "normswap.pipeline.convert", "ConvertResult": "normswap.pipeline.convert",
    "ConvertOptions": "normswap.pipeline.options", "resolve_device": "normswap.pipeline.device",
    "convert_folder": "normswap.pipeline.lazy_convert", "lazily_convertible": "normswap.pipeline.lazy_convert",
    "heal_checkpoint": "normswap.pipeline.heal", "HealResult": "normswap.pipeline.heal",
    "evaluate_checkpoint": "normswap.pipeline.evaluate", "export_checkpoint": "normswap.pipeline.export",
    "inspect_checkpoint": "normswap.pipeline.inspect", "InspectResult": "normswap.pipeline.inspect",
    "HealCheckpointOptions": "normswap.pipeline.options", "EvaluateOptions": "normswap.pipeline.options",
    "ExportOptions": "normswap.pipeline.options", "InspectOptions": "normswap.pipeline.options",
    "rotate_checkpoint": "normswap.pipeline.rotate", "RotateOptions": "normswap.pipeline.options",
    "RotateResult": "normswap.pipeline.rotate",
    "generate_checkpoint": "normswap.pipeline.generate", "GenerateOptions": "normswap.pipeline.options",
}
__all__ = list(PUBLIC)
__getattr__, __dir__ = lazy(__name__, PUBLIC)
