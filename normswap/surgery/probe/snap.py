"""Step 2: snap what was measured to the values the module was written with, where they agree within the
estimate's tolerance: its eps attribute (else a round value), its own 1-D parameters (or one plus them:
Nemotron's LayerNorm1P) as exact bits, a gain of ones and a bias of zeros where it has none."""
from __future__ import annotations

import torch
from torch import nn

from normswap.surgery.probe.estimate import Estimate

EPS_ATTRS = ("eps", "variance_epsilon", "epsilon", "layer_norm_eps")


def snap(module: nn.Module, est: Estimate) -> tuple[torch.Tensor, torch.Tensor | None, float]:
    """(gain, bias or None where the module adds nothing, eps) of `module`: `est`'s, snapped."""
    d = est.gain.shape[0]
    gain, b, tol = est.gain, est.bias, est.tol
    own_eps = attr_eps(module)
    if own_eps is not None and abs(own_eps - est.eps) <= 1e-2 * max(own_eps, est.eps) + 1e-18:
        eps = own_eps
    else:
        eps = round_eps(est.eps)
    own = vectors(module, d)
    used, offset = own_gain(module, gain, tol) or (None, 0.0)
    gain = gain if used is None else own[used] + offset
    if used is None and close(gain, torch.ones_like(gain), tol):
        gain = torch.ones_like(gain)   # a non-parametric LayerNorm
    has_bias = isinstance(getattr(module, "bias", None), torch.Tensor)
    b = next((own[n] for n in first(own, "bias") if n != used and close(b, own[n], tol)), b)
    if not has_bias and close(b, torch.zeros_like(b), tol):
        b = None
    return gain, b, eps


def vectors(module: nn.Module, d: int) -> dict[str, torch.Tensor]:
    """The module's own 1-D parameters of width d, float64 on the CPU."""
    return {n: p.detach().double().cpu() for n, p in module.named_parameters(recurse=False) if p.shape == (d,)}


def own_gain(module: nn.Module, gain: torch.Tensor, tol: float) -> tuple[str, float] | None:
    """(the module's own parameter p, offset) with gain = p + offset within `tol` (offset 1: "1P" norms,
    Gemma's 1 + w), the weight tried first; None where none is."""
    own = vectors(module, gain.shape[0])
    return next(((n, off) for n in first(own, "weight") for off in (0.0, 1.0) if close(gain, own[n] + off, tol)),
                None)


def attr_eps(module: nn.Module) -> float | None:
    for a in EPS_ATTRS:
        v = getattr(module, a, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0:
            return float(v)
    return None


def round_eps(eps: float) -> float:
    """1.0000003e-05 -> 1e-05: the value the module was written with, when the measure is that close."""
    if eps <= 0:
        return 0.0
    nice = float(f"{eps:.2g}")
    return nice if abs(nice - eps) <= 1e-3 * eps else eps


def first(names, name: str) -> list[str]:
    """`names` with `name` first: a parameter called weight (bias) is the likeliest gain (bias)."""
    return sorted(names, key=lambda n: n != name)


def close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    return bool((a - b).abs().max() <= tol)
