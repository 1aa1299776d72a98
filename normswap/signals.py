"""Ctrl-C and SIGTERM, handled one way everywhere: set handlers and put the old ones back, hold the signals
off for a block (ignored, or deferred and delivered after it), or turn one into a KeyboardInterrupt.

Only the main thread may set signal handlers; elsewhere every function here leaves the handlers alone.
"""
from __future__ import annotations

import contextlib
import signal
import threading

STOPS = (signal.SIGINT, signal.SIGTERM)   # the signals that end a run


def interrupt(signum, frame):
    """A handler: the signal ends the run the way Ctrl-C does (cleaned up, one line), its number kept."""
    raise KeyboardInterrupt(signum)


def install(handler, signums=STOPS) -> dict:
    """Set `handler` for `signums`; the handlers it replaced, for `restore` (none off the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {s: signal.signal(s, handler) for s in signums}


def restore(previous: dict) -> None:
    """Put back the handlers `install` replaced (the default where Python had none of its own)."""
    for s, handler in previous.items():
        signal.signal(s, handler if handler is not None else signal.SIG_DFL)


@contextlib.contextmanager
def handled(handler, signums=STOPS):
    """`handler` for `signums` inside the block, then the handlers as before."""
    previous = install(handler, signums)
    try:
        yield
    finally:
        restore(previous)


def held():
    """Ctrl-C and SIGTERM ignored inside the block, then as before."""
    return handled(signal.SIG_IGN)


@contextlib.contextmanager
def deferred():
    """Ctrl-C and SIGTERM held during the block, then the first one delivered to the handlers restored."""
    got: list[int] = []
    try:
        with handled(lambda signum, frame: got.append(signum)):
            yield
    finally:
        if got:
            signal.raise_signal(got[0])
