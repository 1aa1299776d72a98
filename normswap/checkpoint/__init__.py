"""Checkpoints as lazy models: a folder's model built on the meta device (`meta`), whose modules read their
weights from the files only while they run (`lazy`). A lazy facade."""
from normswap.facade import lazy

PUBLIC = {"InMemoryOnly": "normswap.checkpoint.lazy", "Lazy": "normswap.checkpoint.lazy",
          "open_folder": "normswap.checkpoint.meta"}
__all__ = list(PUBLIC)
__getattr__, __dir__ = lazy(__name__, PUBLIC)
