"""The user's `requires_grad` choices, kept through a conversion: a parameter the conversion creates (a new
norm's gain, an added bias, an output fix's bias) trains only if what it stands for did."""
from __future__ import annotations

from contextlib import contextmanager

from torch import nn


@contextmanager
def kept_trainable(model: nn.Module):
    """Within: edits of `model` that replace modules and parameters and add parameters. On exit (also after an
    error), each parameter that was not there before takes its `requires_grad` from the one it replaced (the same
    name: a new norm's gain, the old norm's), else from the other parameters its module already had (a bias added
    to a layer: the layer's weight), else from those the module at its name held before (an output fix's bias on a
    new norm: the old norm's); with none of these, from the model's: trainable if any of its parameters was."""
    before = {id(p): (p, p.requires_grad) for p in model.parameters()}   # held: no id is reused meanwhile
    places = {name: {attr: p.requires_grad for attr, p in m.named_parameters(recurse=False)}
              for name, m in model.named_modules()}
    try:
        yield
    finally:   # a verification that failed after the edits leaves the model converted
        _follow(model, before, places)


def _follow(model: nn.Module, before: dict, places: dict[str, dict[str, bool]]) -> None:
    anywhere = any(flag for _, flag in before.values())
    for name, module in model.named_modules():
        own, held = dict(module.named_parameters(recurse=False)), places.get(name, {})
        kept = [before[id(p)][1] for p in own.values() if id(p) in before]
        for attr, p in own.items():
            if id(p) not in before:
                like = [held[attr]] if attr in held else kept or list(held.values())
                p.requires_grad_(any(like) if like else anywhere)
