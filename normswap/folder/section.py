"""Where a converted model keeps the record of what changed (its `normswap` section: norms, added biases,
output fixes, conversions): `config.normswap` for a model with a transformers config, saved in config.json;
the attribute `normswap_section` of the module itself for any other nn.Module (`save_pretrained` writes it
beside the weights, `restore` reads it back)."""
from __future__ import annotations

from torch import nn

from normswap.folder.portable import FORMAT
from normswap.folder.shipped import original_class

ATTRIBUTE = "normswap_section"
MODULE_TYPE = "torch.nn.Module"   # the section's base.model_type for a module without a transformers config


def qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def new_section(model: nn.Module, fingerprint: dict) -> dict:
    """A converted model's section as `convert` starts it, in its final format: the class it was built as (for a
    transformers model, the one its folder rebuilds), no norm yet, the fingerprint's probe (`folder.fingerprint`; the
    digest is taken when it is saved)."""
    cls = original_class(model).__name__
    base = {"architecture": cls, "model_type": model.config.model_type} if has_config(model) \
        else {"architecture": qualified_name(type(model)), "model_type": MODULE_TYPE}
    return {"format": FORMAT, "base": base, "norms": {}, "added_biases": [], "conversions": [],
            "fingerprint": fingerprint}


def has_config(model: nn.Module) -> bool:
    """Whether `model` carries a transformers-style config (saved with it, where the section then goes)."""
    return hasattr(getattr(model, "config", None), "to_dict")


def section(model: nn.Module) -> dict | None:
    """`model`'s normswap section, or None where it was never converted."""
    owner = model.config if has_config(model) else model
    return getattr(owner, "normswap" if owner is not model else ATTRIBUTE, None) or None


def set_section(model: nn.Module, value: dict) -> None:
    if has_config(model):
        model.config.normswap = value
    else:
        model.__dict__[ATTRIBUTE] = value   # a plain attribute: not a parameter, buffer or submodule
