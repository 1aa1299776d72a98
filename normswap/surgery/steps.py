"""The exact plan's steps as types: one small class per kind of edit, naming what it edits by typed targets.

Each step touches only the modules it names (through `model.get_submodule`), so a lazy applier can
materialise just what a step needs; `interpret.carry_out` is the one place that dispatches on the kind:
- `Centre(target, group, ranges)`: make the target's outputs zero-mean over groups of `group` channels
  along its output dim, or over each of `ranges` only (q/k of a fused q/k/v projection; v stays): a
  layer's weight and bias (`Module`), or a parameter's channels (`Param`, along its `axis`);
- `Fold(reader, norm)`: reader.bias += W @ norm.bias;
- `Scale(scale, into)`: fold the per-channel scale (a LayerScale `Module`, or a `Param` multiplied into the
  stream) into the layer `into` before it, and set the scale to 1;
- `Fix(target, norm, centre, at_input)`: after the swap, centre target's output and/or add `norm`'s bias
  after it (see `centring`); `at_input`: centre target's first input instead (an "entry" source).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Module:
    """A module, by its qualified name."""

    name: str

    @property
    def module(self) -> str:
        """The module whose tensors an edit of this target touches: itself."""
        return self.name

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class Param:
    """A parameter (or persistent buffer) used directly, by its qualified name; `axis`: its dim that holds the
    channels (-2: F.linear's weight, whose rows are the channels)."""

    name: str
    axis: int = -1

    @property
    def module(self) -> str:
        """The module that holds it."""
        return self.name.rpartition(".")[0]

    def __str__(self) -> str:   # as reports name a parameter among modules
        return f"param:{self.name}"


Target = Module | Param


@dataclass(frozen=True)
class Centre:
    target: Target
    group: int = 0         # channels per group along the output dim (0: all of them)
    ranges: tuple[tuple[int, int], ...] = ()   # ((start, stop), ...) centred one by one, the other channels kept


@dataclass(frozen=True)
class Fold:
    reader: str            # a linear layer reading `norm`
    norm: str


@dataclass(frozen=True)
class Scale:
    scale: Target          # a LayerScale module, or a parameter multiplied into the stream
    into: str              # the layer whose outputs it scales


@dataclass(frozen=True)
class Fix:
    target: str               # the module whose output (or input) is fixed
    norm: str | None = None   # the norm whose bias is kept after it (None: no bias)
    centre: bool = False      # centre the output too
    at_input: bool = False    # centre its first input instead (an opaque sum entering a block)


Step = Centre | Fold | Scale | Fix
