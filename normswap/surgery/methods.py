"""Conversion methods: how a LayerNorm's bias (and the rest of the model) is handled before the swap.

A method takes the model and the LayerNorms found by the walk, may rewrite weights, and says what it
did per norm. The walk and the module swap are the same for every method (see `convert`). "naive" is
here; "exact" and "auto" are in `exact`, and take the `ExactSteps` that plan and apply the exact edits
(in memory by default; `pipeline.lazy_convert` records them instead, to apply while it writes).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from torch import nn

from normswap.errors import Choice
from normswap.surgery.plan import Plan
from normswap.surgery.walk import NormSite


class Method(Choice):
    """How `convert` treats a LayerNorm's bias: `convert(method=...)` takes these (or their strings)."""

    AUTO = "auto"     # exact where the traced plan allows it, else naive with a warning
    EXACT = "exact"   # function-preserving, verified; refuses what it cannot do
    NAIVE = "naive"   # the paper's swap: the bias dropped


class BiasFate(Choice):
    """What became of a converted norm's bias (a report row's `bias`)."""

    DROPPED = "dropped"
    FOLDED = "folded"   # into the readers, or kept after the norm: either way the function is kept
    NONE = "none"       # it had none


@dataclass
class MethodResult:
    method: Method                                            # the method that ran ("auto" resolves to one)
    bias: dict[str, BiasFate] = field(default_factory=dict)   # norm name -> what became of its bias
    added_biases: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    per_norm_method: dict[str, str] = field(default_factory=dict)  # when methods differ per norm
    not_preserved: dict[str, str] = field(default_factory=dict)    # outputs that change -> why (the folder's)
    unverified: dict[str, str] = field(default_factory=dict)       # of those, the ones by name: not compared
    kept: dict[str, str] = field(default_factory=dict)             # norms left as they were -> why
    undo: object | None = None   # in memory: how to put the edits back (`undo.Undo`) if verification fails

    def after_swap(self, model: nn.Module, report) -> None:
        """Called by `convert` once the norms are swapped (exact finishes and verifies here)."""


class ExactSteps(Protocol):
    """How the exact method plans a model and applies the plan."""

    def inputs(self, model: nn.Module) -> list[dict]: ...

    def plan(self, model: nn.Module, sites: list[NormSite]) -> Plan: ...

    def apply(self, model: nn.Module, sites: list[NormSite], plan: Plan) -> MethodResult: ...


def naive(model: nn.Module, sites: list[NormSite], steps: ExactSteps | None = None) -> MethodResult:
    """The paper's swap: keep the gain, drop the bias. Changes the function wherever a bias is non-zero."""
    return MethodResult(Method.NAIVE, bias={s.name: BiasFate.DROPPED if s.bias is not None and s.bias_norm > 0
                                            else BiasFate.NONE for s in sites})
