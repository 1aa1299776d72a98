"""Where a converted model keeps its `normswap` section in memory (norms, added biases, output fixes,
conversions): `config.normswap` for a model with a transformers config, saved in config.json; the attribute
`normswap_section` of the module itself for any other nn.Module (`save_pretrained` writes it beside the weights,
`restore` reads it back)."""
from __future__ import annotations

from torch import nn

ATTRIBUTE = "normswap_section"
MODULE_TYPE = "torch.nn.Module"   # the section's base.model_type for a module without a transformers config


def qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def has_config(model: nn.Module) -> bool:
    """Whether `model` carries a transformers-style config (saved with it, where the section then goes)."""
    return hasattr(getattr(model, "config", None), "to_dict")


def section(model: nn.Module) -> dict | None:
    """`model`'s normswap section, or None where it was never converted."""
    owner = model.config if has_config(model) else model
    return getattr(owner, "normswap" if owner is not model else ATTRIBUTE, None) or None


def clear_section(model: nn.Module) -> None:
    """`model` without a normswap section (as before its first conversion)."""
    if has_config(model):
        model.config.__dict__.pop("normswap", None)
    model.__dict__.pop(ATTRIBUTE, None)


def set_section(model: nn.Module, value: dict) -> None:
    if has_config(model):
        model.config.normswap = value
    else:
        model.__dict__[ATTRIBUTE] = value   # a plain attribute: not a parameter, buffer or submodule
