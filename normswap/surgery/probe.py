"""Is this module a LayerNorm over the last dimension? Found by calling it, not by its class.

`probe(module, width)` runs a copy of the module on a few chosen rows (float64 where it accepts it) and
solves for its *effective* gain g, bias b and eps from LN(x) = g*(x - mean x)/sqrt(var x + eps) + b:
- rows x and -x give b (the normalised part is odd in x; no 0/0 when eps = 0);
- rows z of mean 0, variance 1 scaled by s give g*z*s/sqrt(s^2 + eps) + b: a large s gives g, a
  smaller s the factor that reveals eps (the scale with the most informative factor is used);
- random rows with random means and scales, some with variance near eps, must then match the formula.
Where the module's own 1-D parameters (or one plus them: Nemotron's LayerNorm1P) and eps attribute agree
with what was measured, they are used as is (exact bits). Anything that
fails (GroupNorm, channels-first, RMSNorm, LayerScale, modules needing other arguments) is `NotLayerNorm`
with the reason. The module itself is never called (its hooks and state are left alone).
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from torch import nn

EPS_ATTRS = ("eps", "variance_epsilon", "epsilon", "layer_norm_eps")
SCALES = [10.0 ** -k for k in range(0, 9)]     # row scales that locate eps in [~1e-17, ~1]
NONFINITE = "returns non-finite values on ordinary inputs"   # a broken module (e.g. eps < 0), not a non-norm


class NotLayerNorm(Exception):
    """The module does not compute a LayerNorm over the last dimension (message: why)."""


class Broken(NotLayerNorm):
    """The module gives NaN/inf on ordinary inputs (eps < 0, say): a broken model, not a module of another kind."""


@dataclass
class Probed:
    gain: torch.Tensor          # float64, effective
    bias: torch.Tensor | None   # float64, effective; None when the module adds nothing
    eps: float


def _copies(module: nn.Module):
    """Copies of module to probe (never the module: its state and hooks stay untouched), float64 first."""
    ref = next(module.parameters(), None)
    own = ref.dtype if ref is not None and ref.is_floating_point() else torch.float32
    for dtype in dict.fromkeys((torch.float64, own)):
        try:
            twin = copy.deepcopy(module).eval()
        except Exception as e:
            raise NotLayerNorm(f"cannot be copied for probing ({type(e).__name__})") from None
        yield (twin.to(dtype) if dtype == torch.float64 else twin), dtype


def _call(runner: nn.Module, x: torch.Tensor) -> torch.Tensor:
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


def _unit_rows(k: int, d: int, g: torch.Generator) -> torch.Tensor:
    z = torch.randn(k, d, generator=g, dtype=torch.float64)
    z = z - z.mean(-1, keepdim=True)
    return z / z.pow(2).mean(-1, keepdim=True).sqrt()


def _attr_eps(module: nn.Module) -> float | None:
    for a in EPS_ATTRS:
        v = getattr(module, a, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0:
            return float(v)
    return None


def _snap(eps: float) -> float:
    """1.0000003e-05 -> 1e-05: the value the module was written with, when the measure is that close."""
    if eps <= 0:
        return 0.0
    nice = float(f"{eps:.2g}")
    return nice if abs(nice - eps) <= 1e-3 * eps else eps


def _first(names, name: str) -> list[str]:
    """`names` with `name` first: a parameter called weight (bias) is the likeliest gain (bias)."""
    return sorted(names, key=lambda n: n != name)


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    return bool((a - b).abs().max() <= tol)


def probe(module: nn.Module, width: int, seed: int = 0) -> Probed:
    """The effective (gain, bias, eps) of `module` if it is a LayerNorm over the last dim of `width`."""
    ref = next(module.parameters(), None)
    device = ref.device if ref is not None else torch.device("cpu")
    d = width
    g = torch.Generator().manual_seed(seed)
    z, zs = _unit_rows(3, d, g), _unit_rows(len(SCALES), d, g)
    for runner, dtype in _copies(module):
        big = 1e3 if dtype in (torch.float16, torch.bfloat16) else 1e4
        x = torch.cat([-big * z[:1], big * z, zs * torch.tensor(SCALES)[:, None]])
        try:
            y = _call(runner, x.to(device, dtype)).cpu()
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
    own_eps = _attr_eps(module)
    if own_eps is not None and abs(own_eps - eps) <= 1e-2 * max(own_eps, eps) + 1e-18:
        eps = own_eps
    else:
        eps = _snap(eps)
    # snap to the module's own parameters where they are what was measured
    rel = 3e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-4  # covers modules computing in fp32
    tol = rel * float(gain.abs().max() + b.abs().max())
    own = {n: p.detach().double().cpu() for n, p in module.named_parameters(recurse=False) if p.shape == (d,)}
    used, gain = next(((n, v) for n in _first(own, "weight") for v in (own[n], own[n] + 1) if _close(gain, v, tol)),
                      (None, gain))   # own[n] + 1: "1P" norms
    if used is None and _close(gain, torch.ones_like(gain), tol):
        gain = torch.ones_like(gain)   # a non-parametric LayerNorm
    has_bias = isinstance(getattr(module, "bias", None), torch.Tensor)
    b = next((own[n] for n in _first(own, "bias") if n != used and _close(b, own[n], tol)), b)
    if not has_bias and _close(b, torch.zeros_like(b), tol):
        b = None
    # confirm on rows it has not seen: random means, scales from large down to ~sqrt(eps)
    scales = torch.tensor([3.0, 0.3, 30.0] + ([math.sqrt(eps) * f for f in (0.5, 2.0)] if eps > 0 else []),
                          dtype=torch.float64)[:, None]
    xt = scales * (torch.randn(len(scales), d, generator=g, dtype=torch.float64)
                   + 2 * torch.randn(len(scales), 1, generator=g, dtype=torch.float64))
    try:
        yt = _call(runner, xt.to(device, dtype)).cpu()
    except NotLayerNorm:
        raise
    except Exception as e:
        raise NotLayerNorm(f"fails on a probe ({type(e).__name__})") from None
    xc = xt - xt.mean(-1, keepdim=True)
    ref = gain * xc / (xc.pow(2).mean(-1, keepdim=True) + eps).sqrt() + (0 if b is None else b)
    err = float((yt - ref).abs().max())
    if not err <= tol:
        mean_kept = gain * xt / (xt.pow(2).mean(-1, keepdim=True) + eps).sqrt() + (0 if b is None else b)
        if float((yt - mean_kept).abs().max()) <= tol:
            raise NotLayerNorm("behaves as an RMSNorm (no mean subtraction): nothing to convert")
        raise NotLayerNorm(f"not a LayerNorm over the last dimension (off by {err:.2g} on a probe)")
    return Probed(gain.to(device), None if b is None else b.to(device), float(eps))
