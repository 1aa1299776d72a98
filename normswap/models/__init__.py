"""Hugging Face models in and out: load any SRC (load, source), save and rebuild converted folders (save,
rebuild, restore; their format is `normswap.folder`), and read a model's sizes, norms and sample inputs
(introspect, inputs). A lazy facade."""
from normswap.facade import lazy

PUBLIC = {"load_model": "normswap.models.load", "load_tokenizer": "normswap.models.load",
          "LoadOptions": "normswap.models.load", "save_pretrained": "normswap.models.save",
          "from_pretrained": "normswap.models.rebuild", "read_config": "normswap.models.source",
          "sample_inputs": "normswap.models.inputs"}
__all__ = list(PUBLIC)
__getattr__, __dir__ = lazy(__name__, PUBLIC)
