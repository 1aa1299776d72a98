"""The exceptions users see. Messages are one line; they name options the way the caller spells them.

A library message names a parameter in backquotes (`overwrite=True`): `str(error)` shows it so, for Python
callers, and the CLI shows the flag that sets it (`--overwrite`), through `for_cli` and the table of names the
CLI generates from the options dataclasses: the library never speaks of flags, the CLI never of keywords.
"""
from __future__ import annotations

import os
import re
import sys
import warnings
from collections.abc import Mapping
from contextlib import contextmanager
from enum import Enum

_NAMED = re.compile(r"`([^`]+)`")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")   # C0 (newline, ESC of ANSI sequences), DEL and C1


def printable(text: str) -> str:
    """`text` safe for one terminal line: control characters (newlines, ANSI escapes) shown as `\\xNN`, so
    a name from a file can neither break a line nor restyle the terminal."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


class Choice(str, Enum):
    """One of an option's allowed values (a method, a target norm): a str, equal to the string a caller passes
    (`Method("auto") == "auto"`), that prints and serialises as that string, in messages and JSON alike."""

    __str__ = str.__str__
    __format__ = str.__format__

    @classmethod
    def values(cls) -> tuple[str, ...]:
        """The allowed strings, in their order of definition."""
        return tuple(m.value for m in cls)


class NormswapError(Exception):
    """A user-facing error (bad input, unsupported model, failed verification): one line."""

    def __str__(self) -> str:
        return _NAMED.sub(lambda m: m.group(1), super().__str__())

    def for_cli(self, flags: Mapping[str, str]) -> str:
        """The message with each named option as the command line spells it: `flags` maps the Python
        spelling (`overwrite=True`, `lr`) to the CLI's (`--overwrite`, `--lr`)."""
        return _NAMED.sub(lambda m: flags.get(m.group(1), m.group(1)), super().__str__())


@contextmanager
def reraised(*kinds: type[Exception]):
    """Inside it, an exception of `kinds` becomes a NormswapError with the same one-line message (for code
    that cannot know NormswapError: `io.portable`, which converted folders ship)."""
    try:
        yield
    except kinds as e:
        raise NormswapError(str(e)) from None


class FellBackToNaive(UserWarning):
    """`method="auto"` could not convert exactly and swapped naively, which changes the model's outputs; the
    message says why (the report's `warnings` holds the same line). Filter on this class, never on the text."""


def warn_caller(message: str, category: type[Warning] = UserWarning) -> None:
    """`warnings.warn`, attributed to the first frame outside normswap (the caller's own line), however deep in
    normswap it is raised: the default filter then shows it once per call site of the caller's."""
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame, level = sys._getframe(1), 2
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM, `signum`) that stopped a run after it had put `written` in place."""

    def __init__(self, signum: int | None = None, written: tuple[str, ...] = ()):
        super().__init__(signum)
        self.signum, self.written = signum, tuple(written)

    @classmethod
    def after(cls, e: KeyboardInterrupt, *written: str) -> Interrupted:
        """`e` (any KeyboardInterrupt) with `written` added to what it already says was written."""
        signum = e.signum if isinstance(e, Interrupted) else (e.args[0] if e.args and isinstance(e.args[0], int)
                                                               else None)
        before = e.written if isinstance(e, Interrupted) else ()
        return cls(signum, (*written, *before))


def one_line_interrupts() -> None:
    """Make an uncaught Ctrl-C print one line instead of a traceback (CLI only: set by its entry point
    before the heavy imports, so a Ctrl-C while they load is one line too)."""
    import sys
    previous = sys.excepthook

    def hook(kind, value, tb):
        if issubclass(kind, KeyboardInterrupt):
            print("interrupted: nothing was written", file=sys.stderr)
        else:
            previous(kind, value, tb)
    sys.excepthook = hook


def first_line(e: BaseException | str, default: str = "", *, strip: bool = False) -> str:
    """The first line of `e`'s message (of the message stripped, with `strip`), or `default` where it has none:
    how a failure from elsewhere is quoted in a one-line error. A first line that ends in a colon introduces the
    next: the next non-blank line is joined to it (and so on while they end in one), so that the reason is whole
    (huggingface_hub's "Validation error for field 'x':" then "TypeError: ... got bogus")."""
    lines = (str(e).strip() if strip else str(e)).splitlines()
    if not lines:
        return default
    line, rest = lines[0], [ln.strip() for ln in lines[1:] if ln.strip()]
    while line.rstrip().endswith(":") and rest:
        line = f"{line.rstrip()} {rest.pop(0)}"
    return line
