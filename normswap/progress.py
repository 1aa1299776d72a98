"""Progress bars for the long steps (load, convert, verify, export, eval), off unless the caller asks.

The API stays silent by default (a library should not draw on your terminal): every function that can show
a bar takes `show_progress`; the CLI passes True when stderr is a terminal and neither -q nor --json was given.
"""
from __future__ import annotations

import contextlib
import sys


def bar(iterable=None, desc: str = "", total: int | None = None, unit: str = "it", unit_scale: bool = False,
        enabled: bool = False):
    """A tqdm bar on stderr with an ETA when `enabled`, else the iterable itself (or, for a manual bar, a
    stand-in whose update/close do nothing)."""
    if not enabled:
        return iterable if iterable is not None else _Null()
    from tqdm.auto import tqdm
    return tqdm(iterable, desc=desc, total=total, unit=unit, unit_scale=unit_scale, file=sys.stderr, leave=False,
                dynamic_ncols=True)


class _Null(contextlib.nullcontext):
    """Stands in for a manual bar (update/close) when progress is off; `with` yields the stand-in itself."""

    def __enter__(self):
        return self

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass
