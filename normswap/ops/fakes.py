"""Shape-only (fake) forms of the RMSNorm ops, shared by the Triton custom ops (`autograd`) and the C++ ops
(`cpu`), whose signatures are the same: torch.compile and torch.export trace through them."""
from __future__ import annotations

import torch
from torch import Tensor


def _like(x: Tensor) -> Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _rows(x: Tensor) -> Tensor:
    return x.new_empty(x.shape[:-1], dtype=torch.float32)


def forward(x, weight, eps, k):
    """(y, rstd)"""
    return _like(x), _rows(x)


def forward_add(x, residual, weight, eps, k):
    """(y, h, rstd)"""
    return _like(x), _like(x), _rows(x)


def backward(dy, h, rstd, weight, dh_out, k, need_dw):
    """(dx, dw); dw is empty when there is no weight or it needs no gradient."""
    dw = _like(weight) if weight is not None and need_dw else h.new_empty(0)
    return _like(h), dw
