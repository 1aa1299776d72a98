"""The one exception type users see: its message is printed as a single line by the CLI."""


class NormswapError(Exception):
    """A user-facing error (bad input, unsupported model, failed verification)."""
