"""A map keyed by tensor identity whose entries go with their tensors."""
from __future__ import annotations

import weakref

import torch


class TensorMap:
    """tensor -> value, holding tensors weakly: what a forward drops is freed (its activations are never all
    held at once), and an id Python reuses afterwards is told apart by the dead reference."""

    def __init__(self):
        self._held: dict[int, tuple] = {}

    def get(self, x: torch.Tensor):
        held = self._held.get(id(x))
        return held[1] if held is not None and held[0]() is x else None

    def set(self, x: torch.Tensor, value, strong: bool = False) -> None:
        """`strong`: hold x itself (a parameter: a weakref on it would stop `torch.utils.swap_tensors`)."""
        i, held = id(x), self._held

        def gone(ref):   # the entry goes with its tensor, unless the id holds a newer one already
            if held.get(i, (None,))[0] is ref:
                del held[i]
        held[i] = ((lambda: x) if strong else weakref.ref(x, gone), value)

    def pop(self, x: torch.Tensor):
        """x's value, removed; None if x has none."""
        value = self.get(x)
        if value is not None:
            del self._held[id(x)]
        return value

    def clear(self) -> None:
        self._held.clear()

    def __len__(self) -> int:
        return len(self._held)
