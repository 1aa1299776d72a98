"""Train/eval flags kept module by module: `model.train(flag)` sets every submodule to the top module's flag,
so a submodule the user put in eval() would come back training (dropout on) after normswap ran the model."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn


@contextmanager
def eval_mode(*models: nn.Module | None) -> Iterator[None]:
    """The `models` (None ones skipped) in eval mode for the block; every module's own `training` flag is put
    back after it, as it was (not through `train()`, which would set a whole subtree to one flag)."""
    flags = [(m, m.training) for model in models if model is not None for m in model.modules()]
    try:
        for model in models:
            if model is not None:
                model.eval()
        yield
    finally:
        for m, training in flags:
            m.training = training
