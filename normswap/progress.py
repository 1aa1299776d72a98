"""Progress bars for the long steps (load, convert, verify, export, eval, heal), off unless the caller asks.

The API stays silent by default (a library should not draw on your terminal): every function that can show
a bar takes `show_progress`; the CLI passes True when stderr is a terminal and neither -q nor --json was given.
"""
from __future__ import annotations

import contextlib
import sys


def bar(iterable=None, desc: str = "", total: int | None = None, unit: str = "it", unit_scale: bool = False,
        enabled: bool = False):
    """A tqdm bar on stderr with a percentage and an ETA when `enabled`, else the iterable itself (or, for a
    manual bar, a stand-in whose update/close do nothing). A manual bar with a total never counts past it:
    an estimate short of the work (a tensor read twice) stays at 100%, not at "652MB" of 498MB with no
    percentage (tqdm drops the percentage once past the total)."""
    if not enabled:
        return iterable if iterable is not None else _Null()
    from tqdm.auto import tqdm
    shown = tqdm(iterable, desc=desc, total=total, unit=unit, unit_scale=unit_scale, file=sys.stderr, leave=False,
                 dynamic_ncols=True)
    return shown if iterable is not None or total is None else _Capped(shown)


class _Null(contextlib.nullcontext):
    """Stands in for a manual bar (update/close) when progress is off; `with` yields the stand-in itself."""

    def __enter__(self):
        return self

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, **kw) -> None:
        pass

    def close(self) -> None:
        pass


class _Capped(_Null):
    """A manual tqdm bar whose count stops at its total."""

    def __init__(self, shown):
        super().__init__()
        self.shown = shown

    @property
    def n(self):
        return self.shown.n

    def update(self, n: int = 1) -> None:
        n = min(n, self.shown.total - self.shown.n)
        if n > 0:
            self.shown.update(n)

    def set_postfix(self, **kw) -> None:
        self.shown.set_postfix(**kw)

    def __str__(self) -> str:   # the line as drawn
        return str(self.shown)

    def close(self) -> None:
        self.shown.close()

    def __exit__(self, *exc):
        self.close()
