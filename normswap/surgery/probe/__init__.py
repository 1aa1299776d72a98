"""Is this module a LayerNorm over the last dimension? Found by calling it, not by its class.

`probe(module, width)` runs a copy of the module (float64 where it accepts it) in three steps:
- `estimate`: solve for its *effective* gain g, bias b and eps from its outputs on a few chosen rows;
- `snap`: where the module's own 1-D parameters (or one plus them: Nemotron's LayerNorm1P) and eps
  attribute agree with what was measured, use them as is (exact bits);
- `confirm`: random rows with random means and scales, some with variance near eps, must match the formula.
Anything that fails (GroupNorm, channels-first, RMSNorm, LayerScale, modules needing other arguments) is
`NotLayerNorm` with the reason. The module itself is never called (its hooks and state are left alone).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from normswap.surgery.probe import confirm, estimate, snap
from normswap.surgery.probe.runner import NONFINITE, Broken, NotLayerNorm, call, copies

__all__ = ["NONFINITE", "Broken", "NotLayerNorm", "Probed", "ProbedRMS", "computes_rms_norm", "probe", "probe_rms"]
RMS_TOL = 1e-4   # relative: eps up to ~1e-5 against rows of mean square >= 1 stays far below it


@dataclass
class Probed:
    gain: torch.Tensor          # float64, effective
    bias: torch.Tensor | None   # float64, effective; None when the module adds nothing
    eps: float


def probe(module: nn.Module, width: int, seed: int = 0) -> Probed:
    """The effective (gain, bias, eps) of `module` if it is a LayerNorm over the last dim of `width`."""
    g = torch.Generator().manual_seed(seed)
    est = estimate.estimate(module, width, g)
    gain, b, eps = snap.snap(module, est)
    confirm.confirm(est, gain, b, eps, g)
    return Probed(gain.to(est.device), None if b is None else b.to(est.device), float(eps))


@dataclass
class ProbedRMS:
    """An RMSNorm's effective gain (float64, on the CPU) and where it lives: gain = the module's own parameter
    `param` + `offset` (Gemma's 1 + w: offset 1); `param` None: no parameter (a gain of ones)."""
    gain: torch.Tensor
    eps: float
    param: str | None
    offset: float


def probe_rms(module: nn.Module, width: int, seed: int = 0) -> ProbedRMS:
    """What `module` computes if it is an RMSNorm over the last dim of `width`, x * rsqrt(mean(x²) + eps) * g (no
    mean subtracted, no bias), whatever its class; `NotLayerNorm` (why) where it is not one."""
    g = torch.Generator().manual_seed(seed)
    est = estimate.estimate(module, width, g)
    gain, b, eps = snap.snap(module, est)
    if b is not None:
        raise NotLayerNorm("adds a bias after normalising: not an RMSNorm")
    confirm.confirm(est, gain, None, eps, g, centred=False)
    used, offset = snap.own_gain(module, gain, est.tol) or (None, 0.0)
    if used is None and not bool((gain == 1).all()):
        raise NotLayerNorm("its gain is none of its parameters (nor one plus one): it cannot be set to ones")
    return ProbedRMS(gain.cpu(), float(eps), used, offset)


def computes_rms_norm(module: nn.Module, width: int, seed: int = 0) -> bool:
    """Whether `module` computes x / rms(x) times one gain vector over the last dim of `width` on rows far from
    eps, whatever its class, formula or eps form (lucidrains' F.normalize(x) * sqrt(d) clamps the norm instead
    of adding eps, which `probe_rms`'s exact formula refuses): the export's count of norms."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(8, width, generator=g, dtype=torch.float64) + 3 * torch.randn(8, 1, generator=g,
                                                                                      dtype=torch.float64)) \
        * torch.linspace(1, 10, 8, dtype=torch.float64)[:, None]
    try:
        for twin, dtype in copies(module):
            try:
                y = call(twin, x.to(dtype))
            except Exception:   # another signature, dtype or shape (the user's code): not a norm it can call
                continue
            normed = x.to(dtype).double() * torch.rsqrt(x.to(dtype).double().pow(2).mean(-1, keepdim=True))
            gain = y[-1] / normed[-1]
            tol = RMS_TOL if dtype == torch.float64 else 1e-3
            return bool(torch.isfinite(gain).all() and ((y - normed * gain).abs() <= tol * y.abs().amax(
                -1, keepdim=True)).all())
    except NotLayerNorm:   # it cannot be copied to be called
        pass
    return False
