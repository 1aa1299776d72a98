"""Healing: a short distillation fine-tune of a converted model towards its original (loop), on one or
several processes, sharded with FSDP2 when asked (fsdp). A lazy facade."""
from normswap.facade import lazy

PUBLIC = {"heal": "normswap.healing.loop", "HealReport": "normswap.healing.loop",
          "norm_parameters": "normswap.healing.loop"}
__all__ = list(PUBLIC)
__getattr__, __dir__ = lazy(__name__, PUBLIC)
