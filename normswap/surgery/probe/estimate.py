"""Step 1: solve a module's effective gain g, bias b and eps from its outputs on chosen rows, with
LN(x) = g*(x - mean x)/sqrt(var x + eps) + b:
- rows x and -x give b (the normalised part is odd in x; no 0/0 when eps = 0);
- rows z of mean 0, variance 1 scaled by s give g*z*s/sqrt(s^2 + eps) + b: a large s gives g, a
  smaller s the factor that reveals eps (the scale with the most informative factor is used).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from normswap.surgery.probe.runner import NONFINITE, Broken, NotLayerNorm, call, copies

SCALES = [10.0 ** -k for k in range(0, 9)]     # row scales that locate eps in [~1e-17, ~1]


@dataclass
class Estimate:
    """What the chosen rows gave, and the copy that gave it (the confirmation runs the same one)."""
    gain: torch.Tensor      # float64, on the CPU
    bias: torch.Tensor      # float64, on the CPU; zeros where the module adds nothing
    eps: float              # as measured: the module's own value up to rounding
    runner: nn.Module       # the copy of the module that ran
    dtype: torch.dtype      # its dtype: float64, else the module's own
    device: torch.device    # the module's
    tol: float              # how far its outputs may be from the formula: its dtype's rounding at this scale


def unit_rows(k: int, d: int, g: torch.Generator) -> torch.Tensor:
    z = torch.randn(k, d, generator=g, dtype=torch.float64)
    z = z - z.mean(-1, keepdim=True)
    return z / z.pow(2).mean(-1, keepdim=True).sqrt()


def estimate(module: nn.Module, d: int, g: torch.Generator) -> Estimate:
    """(gain, bias, eps) of `module` from its outputs on chosen rows of width `d` (random ones drawn from `g`)."""
    ref = next(module.parameters(), None)
    device = ref.device if ref is not None else torch.device("cpu")
    z, zs = unit_rows(3, d, g), unit_rows(len(SCALES), d, g)
    for runner, dtype in copies(module):
        big = 1e3 if dtype in (torch.float16, torch.bfloat16) else 1e4
        x = torch.cat([-big * z[:1], big * z, zs * torch.tensor(SCALES)[:, None]])
        try:
            y = call(runner, x.to(device, dtype)).cpu()
            break
        except NotLayerNorm:
            raise
        except Exception:
            continue
    else:
        raise NotLayerNorm(f"fails on a tensor of shape (..., {d}) alone: not a last-dimension norm "
                           "(channels-first? extra arguments?)")
    if not torch.isfinite(y).all():
        raise Broken(NONFINITE)
    b = (y[0] + y[1]) / 2   # the normalised part is odd in x: LN(x) + LN(-x) = 2b
    gain = ((y[1:4] - b) * z).sum(0) / z.pow(2).sum(0)   # least squares per feature, a(big) ~ 1
    if not gain.abs().max() > 0:
        raise NotLayerNorm("its output does not depend on its input")
    # factor a(s) = s/sqrt(s^2 + eps) per small scale, relative to a(big)
    gz = gain * zs
    r = ((y[4:] - b) * gz).sum(-1) / gz.pow(2).sum(-1)
    i = int((r - 2 ** -0.5).abs().argmin())
    r2, s = float(r[i]) ** 2, SCALES[i]
    denom = r2 / s ** 2 - 1 / big ** 2
    if not denom > 0:  # a(s) = s/big: the output scales with the input
        raise NotLayerNorm("not a LayerNorm: its output is not normalised (it scales with the input)")
    eps = max(0.0, (1 - r2) / denom) if r2 < 1 else 0.0
    rel = 3e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-4  # covers modules computing in fp32
    tol = rel * float(gain.abs().max() + b.abs().max())
    return Estimate(gain, b, eps, runner, dtype, device, tol)
