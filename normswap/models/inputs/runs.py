"""Trial forwards: whether the model runs on some inputs (with its weights, or on a meta skeleton of it when
converting lazily), and its error where it does not, which the input builders read to correct their guesses."""
from __future__ import annotations

import torch
from torch import nn

from normswap.errors import first_line
from normswap.models.inputs.context import Ctx
from normswap.models.modes import eval_mode


def run_either(ctx: Ctx, x: dict) -> str:
    """The model's error on `x` ("" if it runs): with its weights, else on a meta skeleton."""
    if ctx.runnable:
        return run(ctx.model, x)
    return "" if runs_on_meta(ctx, x) else "does not run on the meta device"


@torch.no_grad()
def runs_on_meta(ctx: Ctx, x: dict) -> bool:
    """Whether the model's structure takes `x` (a model without weights here, as a lazy conversion builds it: a forward
    on the meta device checks shapes and the paths the inputs open, not values)."""
    if not isinstance(ctx.module, nn.Module) or not any(p.is_meta for p in ctx.module.parameters()):
        return False
    try:   # a fresh skeleton: a lazy conversion's model holds some real tensors (norms, biases) beside meta ones
        with torch.device("meta"):
            skeleton = type(ctx.module)(ctx.config)
    except Exception:
        return False
    meta = {k: (v.to("meta") if isinstance(v, torch.Tensor) else tuple(t.to("meta") for t in v)
                if isinstance(v, tuple) else v) for k, v in x.items()}
    return not run(skeleton, meta)


@torch.no_grad()
def run(model: nn.Module, x: dict) -> str:
    """"" if `model(**x)` runs, else the first line of its error; the model's mode is kept."""
    try:
        with eval_mode(model):
            model(**x)
        return ""
    except Exception as e:
        return first_line(e, type(e).__name__, strip=True)
