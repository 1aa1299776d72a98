"""Healing: a short distillation fine-tune of a converted model towards its original (loop, set up by
prepare), on one or several processes, sharded with FSDP2 when asked (fsdp), with LoRA adapters (lora),
held-out evaluation and experiment trackers (tracking), curves drawn from its log (plot). A lazy facade."""
from normswap.facade import lazy

PUBLIC = {"heal": "normswap.healing.loop", "HealReport": "normswap.healing.report",
          "HealOptions": "normswap.healing.options", "LoraOptions": "normswap.healing.options",
          "norm_parameters": "normswap.healing.params", "plot_log": "normswap.healing.plot"}
__all__ = list(PUBLIC)
__getattr__, __dir__ = lazy(__name__, PUBLIC)
