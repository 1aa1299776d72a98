"""Where a workflow runs: `resolve_device`."""
from __future__ import annotations

import torch

from normswap.errors import NormswapError


def resolve_device(name: str | torch.device | None) -> torch.device:
    """auto: CUDA when available, else CPU. cuda / cuda:N / cpu / mps are checked, not assumed."""
    if isinstance(name, torch.device):
        return name
    name = (name or "auto").strip().lower()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise NormswapError(f"unknown device '{name}': use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise NormswapError(f"`device` {name}: no CUDA device is available here")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise NormswapError(f"`device` {name}: only {torch.cuda.device_count()} CUDA device(s) here")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise NormswapError(f"`device` {name}: MPS is not available here")
    elif device.type not in ("cpu", "cuda", "mps"):
        raise NormswapError(f"unsupported device '{name}': use auto, cpu, cuda or cuda:N")
    return device
