"""Finding norms in a module tree and swapping modules in place."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from normswap.norms import is_rms_norm

FilterFn = Callable[[nn.Module, str], bool]


@dataclass
class NormSite:
    """A LayerNorm that `convert` will replace."""

    name: str
    module: nn.LayerNorm

    @property
    def width(self) -> int:
        return int(self.module.normalized_shape[-1])

    @property
    def gain(self) -> torch.Tensor | None:
        return getattr(self.module, "weight", None)

    @property
    def eps(self) -> float:
        return float(self.module.eps)

    @property
    def bias(self) -> torch.Tensor | None:
        return getattr(self.module, "bias", None)

    @property
    def bias_norm(self) -> float:
        b = self.bias
        return 0.0 if b is None else float(b.detach().double().norm())


@dataclass
class Skipped:
    name: str
    cls: str
    reason: str


def find_norms(model: nn.Module, filter_fn: FilterFn | None = None):
    """Walk `model`: (LayerNorms to convert, norms skipped with a reason, names of existing RMSNorms)."""
    sites: list[NormSite] = []
    skipped: list[Skipped] = []
    rms: list[str] = []
    for name, module in model.named_modules():
        cls = type(module).__name__
        if is_rms_norm(module):
            rms.append(name)
        elif isinstance(module, nn.LayerNorm):
            if len(module.normalized_shape) != 1:
                skipped.append(Skipped(name, cls, f"normalises over {tuple(module.normalized_shape)}, "
                                                  "not just the last dimension"))
            elif filter_fn is not None and not filter_fn(module, name):
                skipped.append(Skipped(name, cls, "excluded by filter_fn"))
            else:
                sites.append(NormSite(name, module))
        elif "LayerNorm" in cls or "GroupNorm" in cls:
            # A norm that is not an nn.LayerNorm: its semantics (channels-first, fused...) are unknown.
            skipped.append(Skipped(name, cls, "not an nn.LayerNorm subclass; semantics unknown"))
    return sites, skipped, rms


def get_module(model: nn.Module, name: str) -> nn.Module:
    return model.get_submodule(name) if name else model


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    """Put `new` where the submodule `name` is."""
    parent_name, _, child = name.rpartition(".")
    setattr(get_module(model, parent_name), child, new)


def ensure_bias(layer: nn.Module) -> tuple[nn.Parameter, bool]:
    """The bias of a Linear / GPT-2 Conv1D, created as zeros if absent; returns (bias, created)."""
    if getattr(layer, "bias", None) is not None:
        return layer.bias, False
    w = layer.weight
    out_features = w.shape[0] if isinstance(layer, nn.Linear) else w.shape[1]  # Conv1D stores (in, out)
    layer.bias = nn.Parameter(torch.zeros(out_features, device=w.device, dtype=w.dtype))
    return layer.bias, True
