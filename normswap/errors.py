"""The exceptions users see. Messages are one line; they name options the way the caller spells them.

A library message names a parameter in backquotes (`overwrite=True`): `str(error)` shows it so, for Python
callers, and the CLI shows the flag that sets it (`--overwrite`), through `for_cli`. One table below maps
the two, so the library never speaks of flags and the CLI never of keyword arguments.
"""
from __future__ import annotations

import re
from contextlib import contextmanager

# Python spelling -> CLI spelling of the options errors name.
FLAGS = {
    "overwrite=True": "--overwrite", "overwrite='any'": "--overwrite-any",
    "allow_missing_weights=True": "--allow-missing-weights", "trust_remote_code=True": "--trust-remote-code",
    "method='naive'": "--method naive", "method='auto'": "--method auto", "to='prmsnorm'": "--to prmsnorm",
    "train='all'": "--train all", "objective='lm'": "--objective lm", "texts": "--data FILE", "data": "--data",
    "finetune_steps": "--finetune-steps", "onnx": "--onnx", "src": "SRC", "out": "OUT", "teacher": "--teacher",
    "with_past=True": "--with-past", "device": "--device", "reference": "--reference ORIG", "lr": "--lr",
    "max_shard_size": "--max-shard-size", "dtype": "--dtype",
    "train='lora'": "--train lora", "lora.rank": "--lora-rank",
    "lora.alpha": "--lora-alpha", "lora.targets": "--lora-targets", "eval_every": "--eval-every",
    "eval_fraction": "--eval-fraction", "eval_windows": "--eval-windows", "eval_texts": "--eval-data",
    "early_stop=True": "--early-stop", "patience": "--patience", "report_to": "--report-to",
    "logging_dir": "--logging-dir",
}
_NAMED = re.compile(r"`([^`]+)`")


class NormswapError(Exception):
    """A user-facing error (bad input, unsupported model, failed verification): one line."""

    def __str__(self) -> str:
        return _NAMED.sub(lambda m: m.group(1), super().__str__())

    def for_cli(self) -> str:
        """The message with each named option as the command line spells it."""
        return _NAMED.sub(lambda m: FLAGS.get(m.group(1), m.group(1)), super().__str__())


@contextmanager
def reraised(*kinds: type[Exception]):
    """Inside it, an exception of `kinds` becomes a NormswapError with the same one-line message (for code
    that cannot know NormswapError: `models.portable`, which converted folders ship)."""
    try:
        yield
    except kinds as e:
        raise NormswapError(str(e)) from None


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
