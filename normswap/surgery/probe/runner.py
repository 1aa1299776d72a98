"""What the probe's steps share: the refusal (`NotLayerNorm`) and copies of the module run on rows. The module
itself is never called (its hooks and state are left alone)."""
from __future__ import annotations

import copy

import torch
from torch import nn

from normswap.folder.fixes import unfixed_class

NONFINITE = "returns non-finite values on ordinary inputs"   # a broken module (e.g. eps < 0), not a non-norm


class NotLayerNorm(Exception):
    """The module does not compute a LayerNorm over the last dimension (message: why)."""


class Broken(NotLayerNorm):
    """The module gives NaN/inf on ordinary inputs (eps < 0, say): a broken model, not a module of another kind."""


def copies(module: nn.Module):
    """Copies of module to probe (never the module: its state and hooks stay untouched), float64 first, without
    the conversion's fixes (`fixes.fixed_class`: a norm's output centred after it is still a norm's)."""
    ref = next(module.parameters(), None)
    own = ref.dtype if ref is not None and ref.is_floating_point() else torch.float32
    for dtype in dict.fromkeys((torch.float64, own)):
        try:
            twin = copy.deepcopy(module).eval()
        except Exception as e:
            raise NotLayerNorm(f"cannot be copied for probing ({type(e).__name__})") from None
        twin.__class__ = unfixed_class(twin)
        yield (twin.to(dtype) if dtype == torch.float64 else twin), dtype


def call(runner: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Rows (n, d) through the module as (n/m, m, d) with m != d, so a channels-first norm cannot pass."""
    n, d = x.shape
    m = 2 if d != 2 else 3
    pad = (-n) % m
    xs = torch.cat([x, x[:pad]]) if pad else x
    with torch.no_grad():
        y = runner.forward(xs.reshape(-1, m, d))
    if not isinstance(y, torch.Tensor) or y.shape != (xs.shape[0] // m, m, d):
        raise NotLayerNorm("does not return one tensor of its input's shape")
    return y.reshape(-1, d)[:n].double()
