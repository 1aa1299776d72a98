"""Finding norms in a module tree and swapping modules in place."""
from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable
from enum import Enum

import torch
from torch import nn

from normswap.models.introspect import config_int, norm_kind
from normswap.surgery.labels import Refusal
from normswap.surgery.probe import Broken, NotLayerNorm, probe

FilterFn = Callable[[nn.Module, str], bool]


@dataclass
class NormSite:
    """A module that computes a LayerNorm over the last dim, which `convert` will replace.

    gain, bias, eps are its *effective* values, measured by probing (`probe`), float64 on the
    module's device: a `weight + 1` norm has gain weight + 1, a non-parametric one gain 1 and bias None.
    Built with only (name, module), they are read from an nn.LayerNorm's attributes.
    """

    name: str
    module: nn.Module
    gain: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    eps: float | None = None

    def __post_init__(self):
        if self.gain is None:  # an nn.LayerNorm taken at its word
            m = self.module
            d = int(m.normalized_shape[-1])
            w = getattr(m, "weight", None)
            self.gain = torch.ones(d, dtype=torch.float64) if w is None else w.detach().double()
            b = getattr(m, "bias", None)
            self.bias = None if b is None else b.detach().double()
            self.eps = float(m.eps)

    @property
    def width(self) -> int:
        return int(self.gain.shape[-1])

    @property
    def bias_norm(self) -> float:
        b = self.bias
        return 0.0 if b is None else float(b.detach().double().norm())


class Skip(Enum):
    """Why a norm-like module is left as it is (a `Skipped` record's cause)."""

    SHAPE = "shape"          # not one vector over the last dim (a multi-dim normalized_shape, 2-D gains, no width)
    NOT_NORM = "not a norm"  # probed: not a LayerNorm over the last dim (RMSNorm, channels-first, extra arguments)
    BROKEN = "broken"        # probed: NaN/inf on ordinary inputs (eps < 0, say): the model is broken
    UNPROBED = "unprobed"    # probing it failed (weights that cannot be cast or copied)
    FILTERED = "filtered"    # excluded by `filter_fn`
    KEPT = "kept"            # a LayerNorm kept so that the rest converts exactly (`refusal`: why it could not be)


@dataclass
class Skipped:
    """A module left as it is: its name and class, why (`reason`, the report's text) and the `cause` decisions
    read; a kept norm's `refusal` (with its `labels.Cause`)."""

    name: str
    cls: str
    reason: str
    cause: Skip
    refusal: Refusal | None = None

    def to_dict(self) -> dict:
        """The report's JSON form of it."""
        return {"name": self.name, "cls": self.cls, "reason": self.reason}


def _candidate(module: nn.Module, hidden: int | None) -> tuple[int | None, str | None]:
    """(width to probe, None) for a possible LayerNorm; (None, reason) to skip it; (None, None): not one."""
    own = dict(module.named_parameters(recurse=False))
    leaf = next(module.children(), None) is None
    named = norm_kind(module) == "layernorm"
    leaf = leaf and ("weight" in own or "bias" in own) and all(p.dim() == 1 for p in own.values())
    vectors = list(own.values())
    if not (named or leaf):
        return None, None
    shape = getattr(module, "normalized_shape", None)
    if isinstance(shape, int):
        shape = (shape,)
    shape = tuple(shape) if isinstance(shape, (tuple, list, torch.Size)) else None
    if shape is not None and len(shape) != 1:
        return None, f"normalises over {shape}, not just the last dimension"
    if any(p.dim() != 1 for p in vectors):
        return None, f"gain/bias of shape {tuple(vectors[0].shape)}: not one vector over the last dimension"
    widths = {int(p.shape[0]) for p in vectors} | ({int(shape[0])} if shape else set())
    if len(widths) > 1:
        return None, f"parameters of different widths {sorted(widths)}"
    width = next(iter(widths), hidden)
    return (width, None) if width else (None, "its width is unknown (no weight, bias or normalized_shape)")


def find_norms(model: nn.Module, filter_fn: FilterFn | None = None):
    """Walk `model`: (LayerNorms to convert, modules skipped with a reason, names of existing RMSNorms).

    Candidates are nn.LayerNorm (and subclasses), modules whose class name says LayerNorm and leaf
    modules with only 1-D weight/bias; each is probed and kept only if it behaves as a LayerNorm over
    the last dimension (see `probe`).
    """
    sites: list[NormSite] = []
    skipped: list[Skipped] = []
    rms: list[str] = []
    hidden = config_int(getattr(model, "config", None), "hidden")
    for name, module in model.named_modules():
        if any(name.startswith(s.name + "." if s.name else "") for s in sites):
            continue  # inside a norm already found: replaced with it
        cls = type(module).__name__
        if norm_kind(module) == "rmsnorm":
            rms.append(name)
            continue
        width, reason = _candidate(module, hidden)
        if reason:
            skipped.append(Skipped(name, cls, reason, Skip.SHAPE))
        if width is None:
            continue
        try:
            found = probe(module, width)
        except NotLayerNorm as e:
            skipped.append(Skipped(name, cls, str(e), Skip.BROKEN if isinstance(e, Broken) else Skip.NOT_NORM))
            continue
        except Exception as e:  # e.g. weights that cannot be cast or copied: leave the module alone
            skipped.append(Skipped(name, cls, f"could not be probed ({type(e).__name__})", Skip.UNPROBED))
            continue
        if filter_fn is not None and not filter_fn(module, name):
            skipped.append(Skipped(name, cls, "excluded by filter_fn", Skip.FILTERED))
        else:
            sites.append(NormSite(name, module, found.gain, found.bias, found.eps))
    return sites, skipped, rms


def get_module(model: nn.Module, name: str) -> nn.Module:
    return model.get_submodule(name) if name else model


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    """Put `new` where the submodule `name` is."""
    parent_name, _, child = name.rpartition(".")
    setattr(get_module(model, parent_name), child, new)
