"""Checkpoints on disk: safetensors files (one or sharded) read and written a tensor at a time, lazy models
whose weights are read only while they run, and the streaming conversion built on both. A lazy facade."""
from normswap.facade import lazy

PUBLIC = {"convert_folder": "normswap.checkpoint.stream", "streamable": "normswap.checkpoint.stream",
          "NotStreamable": "normswap.checkpoint.lazy", "Reader": "normswap.checkpoint.safetensors"}
__all__ = list(PUBLIC)
__getattr__, __dir__ = lazy(__name__, PUBLIC)
