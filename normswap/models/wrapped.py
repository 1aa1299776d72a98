"""Wrappers that run another module: the module normswap works on in their place.

`nn.DataParallel` replicates its `.module` at every forward and `torch.compile`'s `OptimizedModule` runs its
`._orig_mod` (and compiles again when that module's structure changes), so converting the wrapped module in
place leaves the wrapper computing the converted model. `DistributedDataParallel` is refused: it registered
its parameters with its reducer when it was built, so parameters a conversion adds (new norms' gains, added
biases) would never have their gradients averaged across processes.
"""
from __future__ import annotations

import sys

from torch import nn

from normswap.errors import NormswapError


def _compiled(model: nn.Module) -> bool:
    """A `torch.compile`d module (its class lives in torch._dynamo, loaded by whoever compiled it: normswap does
    not import it to find out)."""
    dynamo = sys.modules.get("torch._dynamo.eval_frame")
    return dynamo is not None and isinstance(model, dynamo.OptimizedModule)


def unwrapped(model: nn.Module) -> nn.Module:
    """The module `model` runs: itself, or the one inside nn.DataParallel / torch.compile (nested ones too);
    a one-line NormswapError for DistributedDataParallel, saying what to do instead."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            raise NormswapError("`model` is wrapped in DistributedDataParallel, which registered its parameters "
                                "when it was built (a conversion's new norm gains and biases would not be "
                                "synchronised): convert the model first, then wrap it")
        if isinstance(model, nn.DataParallel):
            model = model.module
        elif _compiled(model):
            model = model._orig_mod
        else:
            return model
