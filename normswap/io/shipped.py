"""The transformers side of every converted folder's modeling_normswap.py, shipped right after `portable.py`
from the line `hub.SHIPPED_FROM` on (the imports above it are portable.py's names, which the file defines).
normswap never runs it: it rebuilds folders with `portable` alone.

- `NormswapMixin`: first in the bases of the generated classes; runs `portable.rebuild` when the model is built,
  checks the weights' checksum in from_pretrained and records the new one in save_pretrained.
- `read_renamed`, `peft_defaults`: what transformers 5 and peft look up by class name or model_type, which the
  generated classes do not share with the originals.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from torch import nn

from normswap.io.portable import INDEX, WEIGHTS, checksum, rebuild, verify_checksum

# ---- shipped from here: the transformers side -----------------------------------------------------------------
import importlib.util  # noqa: E402  (follows portable.py's body in the shipped file)
import re  # noqa: E402


def read_renamed(model: nn.Module, section: dict) -> None:
    """transformers 5 reads a checkpoint's old names (normswap writes them, as transformers does) for its own
    classes only: the same renaming, registered for this class, where `model` has the new names (in 4.x, which
    has no renaming, it has the old ones)."""
    known = dict(model.named_modules())
    pairs = {new: old for new, old in section.get("renamed", {}).items() if new in known and old not in known}
    try:
        from transformers.conversion_mapping import register_checkpoint_conversion_mapping
        from transformers.core_model_loading import WeightRenaming
    except ImportError:
        return
    if pairs:   # the longest first: renamings apply in turn, and a module's own outranks its parent's
        register_checkpoint_conversion_mapping(type(model).__name__, [WeightRenaming(
            source_patterns=rf"^{re.escape(old)}\.", target_patterns=f"{new}.")
            for new, old in sorted(pairs.items(), key=lambda pair: -len(pair[1]))], overwrite=True)


def peft_defaults(model_type: str, base: str) -> None:
    """peft picks an adapter's default target modules by model_type: `base`'s for `model_type` too (the modules
    are the same), in every table peft has for `base`. Only where peft is installed; it is not imported otherwise."""
    if importlib.util.find_spec("peft") is None:
        return
    try:
        constants = importlib.import_module("peft.utils.constants")
    except Exception:   # a peft that does not import here: LoRA is not used with this model
        return
    for name, table in vars(constants).items():
        if name.startswith("TRANSFORMERS_MODELS_TO_") and isinstance(table, dict) and base in table:
            table.setdefault(model_type, table[base])


def _folder(path, kwargs: dict) -> Path:
    """The local folder from_pretrained read (a folder, or the Hub cache's snapshot it downloaded)."""
    if os.path.isdir(path):
        return Path(path) / kwargs.get("subfolder", "")
    from transformers.utils import cached_file
    hub = {k: kwargs[k] for k in ("cache_dir", "revision", "subfolder", "token", "local_files_only") if k in kwargs}
    return Path(cached_file(path, "config.json", **hub)).parent


class NormswapMixin:
    """Put first in the bases of a transformers model class: builds it, then applies config.normswap."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        rebuild(self, getattr(config, "normswap", None), getattr(config, "name_or_path", "") or "config.json")
        read_renamed(self, config.normswap)
        peft_defaults(config.model_type, config.normswap["base"]["model_type"])

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        loaded = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        model = loaded[0] if isinstance(loaded, tuple) else loaded
        verify_checksum(model.config.normswap, _folder(pretrained_model_name_or_path, kwargs),
                        str(pretrained_model_name_or_path), getattr(model.config, "transformers_weights", None))
        return loaded

    def save_pretrained(self, save_directory, *args, **kwargs):
        """transformers' save, then the section's checksum of the weights files just written."""
        out = super().save_pretrained(save_directory, *args, **kwargs)
        path = Path(save_directory) / "config.json"
        if path.is_file() and ((path.parent / WEIGHTS).is_file() or (path.parent / INDEX).is_file()):
            section = self.config.normswap
            section["checksum"] = checksum(section, path.parent)
            config = json.loads(path.read_text())
            config["normswap"] = section
            path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        return out
