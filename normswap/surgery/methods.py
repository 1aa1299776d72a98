"""Conversion methods: how a LayerNorm's bias (and the rest of the model) is handled before the swap.

A method takes the model and the LayerNorms found by the walk, may rewrite weights, and says what it
did per norm. The walk and the module swap are the same for every method (see `convert`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from torch import nn

from normswap.errors import NormswapError
from normswap.surgery.walk import NormSite


@dataclass
class MethodResult:
    method: str                                          # the method that ran ("auto" resolves to one)
    bias: dict[str, str] = field(default_factory=dict)   # norm name -> "dropped" | "folded" | "none"
    added_biases: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    per_norm_method: dict[str, str] = field(default_factory=dict)  # when methods differ per norm

    def after_swap(self, model: nn.Module, report) -> None:
        """Called by `convert` once the norms are swapped (exact finishes and verifies here)."""


MethodFn = Callable[[nn.Module, list[NormSite]], MethodResult]
_METHODS: dict[str, MethodFn] = {}


def register_method(name: str):
    def deco(fn: MethodFn) -> MethodFn:
        _METHODS[name] = fn
        return fn
    return deco


def get_method(name: str) -> MethodFn:
    if name not in _METHODS:
        raise NormswapError(f"unknown method '{name}': choose one of {', '.join(sorted(_METHODS))}")
    return _METHODS[name]


def available_methods() -> list[str]:
    return sorted(_METHODS)


@register_method("naive")
def naive(model: nn.Module, sites: list[NormSite]) -> MethodResult:
    """The paper's swap: keep the gain, drop the bias. Changes the function wherever a bias is non-zero."""
    return MethodResult("naive", bias={s.name: "dropped" if s.bias is not None and s.bias_norm > 0 else "none"
                                       for s in sites})
