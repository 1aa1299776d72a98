"""KL(reference || model) of the logits, per token, and the mean as reported."""
from __future__ import annotations

import torch


def token_kl(ref_logp: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """KL(reference || model) per position, from log-probabilities over the last dim."""
    return (ref_logp.exp() * (ref_logp - logp)).sum(-1)


def nonnegative(kl: float) -> float:
    """A mean KL as reported: KL is never negative, so a mean below 0 (-1e-9 where the two models agree) is
    rounding, and is 0 (NaN stays NaN)."""
    return 0.0 if kl < 0 else kl
