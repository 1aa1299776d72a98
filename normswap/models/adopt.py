"""A converted transformers model is an instance of its converted class: the original class with `NormswapMixin`
first (`NormswapGPT2LMHeadModel`), the class its folder's modeling_normswap.py defines. So transformers' own
save path (`model.save_pretrained`, and with it `push_to_hub`, Trainer's checkpoints) writes a complete,
self-verifying folder (`shipped.finish_folder`), never the original class's config with converted weights.

The class is made once per original class, here, and found again by name (module `__getattr__`), so a pickled
model (`torch.save(model)`) loads where normswap is installed. A model whose class is not transformers' own (a
folder's code, the user's subclass) gets a converted class too, whose save_pretrained refuses, before writing
anything: no folder could rebuild it without that code (normswap's own save refuses it likewise).
"""
from __future__ import annotations

import functools

from torch import nn
from transformers import PreTrainedModel

from normswap.folder.portable import InvalidConversion
from normswap.folder.shipped import NormswapMixin, original_class, register_base_mapping
from normswap.folder import modeling
from normswap.models.source import transformers_class

__all__ = ["Converted", "adopt", "converted_class", "original_class", "registered_as_built"]

PREFIX = "Normswap"


class Converted(NormswapMixin):
    """What a converted model in memory adds to `NormswapMixin`: the modeling file its save writes, and a refusal
    where there is none."""

    def normswap_code(self):
        return modeling.code(self.config.normswap)

    def save_pretrained(self, save_directory, *args, **kwargs):
        if self.normswap_code() is None:
            raise InvalidConversion(
                f"cannot save the converted {original_class(self).__name__}: its class is not transformers' own "
                "(its code came from a model folder or from you), so no saved folder could rebuild it exactly, in "
                "normswap or in plain transformers; nothing was written")
        return super().save_pretrained(save_directory, *args, **kwargs)


@functools.cache
def converted_class(cls: type) -> type:
    """The converted class of the transformers class `cls` (made once)."""
    name = PREFIX + cls.__name__
    return type(name, (Converted, cls), {"__module__": __name__, "__qualname__": name})


def __getattr__(name: str):   # pickle finds a converted class by its name
    cls = transformers_class(name.removeprefix(PREFIX)) if name.startswith(PREFIX) else None
    if cls is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return converted_class(cls)


def adopt(model: nn.Module) -> None:
    """Make the converted transformers model `model` (its config carries the section) an instance of its
    converted class; a no-op for any other module."""
    cls = type(model)
    if isinstance(model, NormswapMixin) or not isinstance(model, PreTrainedModel):
        return
    new = converted_class(cls)
    register_base_mapping(new.__name__, model.config.normswap)
    model.__class__ = new
    registered_as_built(model)


def registered_as_built(model: nn.Module) -> None:
    """What transformers 5's PreTrainedModel.__init__ registers per class, which a class set on a built model
    lacks: the outputs it can record (output_hidden_states and output_attentions read them by class)."""
    try:
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY as registry
    except ImportError:   # a transformers without that registry
        return
    registry[model] = getattr(model, "_can_record_outputs", None)
