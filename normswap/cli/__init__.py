"""The `normswap` command line (click): the group and its error handling (app), shared options (options),
one module per command family (convert: convert, inspect; heal: heal, eval, plot; export: export; generate:
generate), named in `commands` and imported when run. Importing this package imports none of them."""
from normswap.errors import one_line_interrupts
from normswap.facade import lazy

__getattr__, __dir__ = lazy(__name__, {"main": "normswap.cli.app"})


def run() -> None:
    """Console-script entry point: a Ctrl-C while the heavy imports load is one line too, then the group."""
    one_line_interrupts()
    __getattr__("main")()
