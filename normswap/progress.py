"""Progress bars for the long steps (load, convert, verify, export, eval), off unless a caller turns them on.

The API stays silent by default (a library should not draw on your terminal); the CLI turns bars on when
stderr is a terminal and neither -q nor --json was given.
"""
from __future__ import annotations

import contextlib
import sys

_enabled = False


def enable(on: bool) -> None:
    global _enabled
    _enabled = bool(on)


def enabled() -> bool:
    return _enabled


def bar(iterable=None, desc: str = "", total: int | None = None, unit: str = "it", unit_scale: bool = False):
    """A tqdm bar on stderr with an ETA when progress is on, else the iterable itself (or, for a manual
    bar, a stand-in whose update/close do nothing)."""
    if not _enabled:
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

    def set_postfix_str(self, s: str) -> None:
        pass
