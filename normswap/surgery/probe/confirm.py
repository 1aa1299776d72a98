"""Step 3: confirm the snapped (gain, bias, eps) on random rows the estimate has not seen (random means,
scales from large down to ~sqrt(eps)); a module that computes something else is `NotLayerNorm`, one that
keeps the mean named as an RMSNorm."""
from __future__ import annotations

import math

import torch

from normswap.surgery.probe.estimate import Estimate
from normswap.surgery.probe.runner import NotLayerNorm, call


def confirm(est: Estimate, gain: torch.Tensor, b: torch.Tensor | None, eps: float, g: torch.Generator,
            centred: bool = True) -> None:
    """Raise `NotLayerNorm` unless `est`'s copy of the module gives LN(x) with `gain`, `b`, `eps` within
    `est.tol` on random rows drawn from `g` (`centred=False`: RMSNorm(x), the mean kept)."""
    d = gain.shape[0]
    scales = torch.tensor([3.0, 0.3, 30.0] + ([math.sqrt(eps) * f for f in (0.5, 2.0)] if eps > 0 else []),
                          dtype=torch.float64)[:, None]
    xt = scales * (torch.randn(len(scales), d, generator=g, dtype=torch.float64)
                   + 2 * torch.randn(len(scales), 1, generator=g, dtype=torch.float64))
    try:
        yt = call(est.runner, xt.to(est.device, est.dtype)).cpu()
    except NotLayerNorm:
        raise
    except Exception as e:
        raise NotLayerNorm(f"fails on a probe ({type(e).__name__})") from None
    xc = xt - xt.mean(-1, keepdim=True) if centred else xt
    ref = gain * xc / (xc.pow(2).mean(-1, keepdim=True) + eps).sqrt() + (0 if b is None else b)
    err = float((yt - ref).abs().max())
    if not err <= est.tol and not centred:
        raise NotLayerNorm(f"not an RMSNorm over the last dimension (off by {err:.2g} on a probe)")
    if not err <= est.tol:
        mean_kept = gain * xt / (xt.pow(2).mean(-1, keepdim=True) + eps).sqrt() + (0 if b is None else b)
        if float((yt - mean_kept).abs().max()) <= est.tol:
            raise NotLayerNorm("behaves as an RMSNorm (no mean subtraction): nothing to convert")
        raise NotLayerNorm(f"not a LayerNorm over the last dimension (off by {err:.2g} on a probe)")
