"""The one exception type users see: its message is printed as a single line by the CLI."""


class NormswapError(Exception):
    """A user-facing error (bad input, unsupported model, failed verification)."""


def one_line_interrupts() -> None:
    """Make an uncaught Ctrl-C print one line instead of a traceback (CLI only: while its imports load,
    before the command's own handling). The exit stays Python's for SIGINT (130 in a shell)."""
    import sys
    previous = sys.excepthook

    def hook(kind, value, tb):
        if issubclass(kind, KeyboardInterrupt):
            print("interrupted: nothing was written", file=sys.stderr)
        else:
            previous(kind, value, tb)
    sys.excepthook = hook
