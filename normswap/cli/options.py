"""The options every command shares, defined once: click options collected into one frozen `Shared`
object that the command receives as `opts` (its -q/-v verbosity comes from the main group)."""
from __future__ import annotations

import functools
import sys
import warnings
from dataclasses import dataclass

import click
import transformers

from normswap.models.load import LoadOptions

# CLI names -> torch dtype names; the long names stay accepted (earlier releases used them).
DTYPE_NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16",
               "float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}


@dataclass(frozen=True)
class Shared:
    """One command's shared options."""
    verbosity: int = 0                    # -q: -1, -v: 1
    as_json: bool = False                 # --json: stdout is exactly one JSON object
    device: str = "auto"
    load: LoadOptions = LoadOptions()     # --dtype (load dtype), --trust-remote-code, --allow-missing-weights
    overwrite: bool | str = False         # --overwrite: True, --overwrite-any: "any"

    @property
    def show_progress(self) -> bool:
        """Bars only on a terminal, never with -q or --json (stdout must stay one JSON object)."""
        return self.verbosity >= 0 and not self.as_json and sys.stderr.isatty()


def _click_options(load: bool, dtype: bool, device: bool, overwrite: bool) -> list:
    opts = [click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")]
    if dtype:
        opts.append(click.option("--dtype", type=click.Choice(list(DTYPE_NAMES)), default=None,
                                 help="Load the model in this dtype (default: as stored; the demo model: fp32)."))
    if device:
        opts.append(click.option("--device", default="auto", show_default=True,
                                 help="auto (CUDA when available), cpu, cuda, cuda:N."))
    if overwrite:
        opts += [click.option("--overwrite", is_flag=True,
                              help="Replace the output if normswap wrote it (or it is empty)."),
                 click.option("--overwrite-any", is_flag=True,
                              help="Replace the output even if normswap did not write it (its files are deleted).")]
    if load:
        opts += [click.option("--trust-remote-code", is_flag=True,
                              help="Run the Python code a model folder ships (auto_map). Default: never run it, "
                                   "never prompt."),
                 click.option("--allow-missing-weights", is_flag=True,
                              help="Load SRC even if its weights lack tensors, have extra ones or wrong shapes "
                                   "(missing ones get random values). Default: an error naming them.")]
    return opts


def shared(load: bool = True, dtype: bool = True, device: bool = True, overwrite: bool = True):
    """Decorator: add the shared options to a command, which receives them as `opts: Shared`."""
    def deco(command):
        @functools.wraps(command)
        def run(*args, **kw):
            dtype_name = kw.pop("dtype", None)
            load_opts = LoadOptions(DTYPE_NAMES[dtype_name] if dtype_name else None,
                                    kw.pop("trust_remote_code", False), kw.pop("allow_missing_weights", False))
            replace = "any" if kw.pop("overwrite_any", False) else kw.pop("overwrite", False)
            kw.pop("overwrite", None)
            verbosity = click.get_current_context().find_root().obj or 0
            opts = Shared(verbosity, kw.pop("as_json"), kw.pop("device", "auto"), load_opts, replace)
            setup_output(opts)
            return command(*args, opts=opts, **kw)
        for option in reversed(_click_options(load, dtype, device, overwrite)):
            run = option(run)
        return run
    return deco


def setup_output(opts: Shared) -> None:
    """Library logging and progress bars for one command: -q errors only, default warnings, -v info."""
    log = transformers.utils.logging
    if opts.verbosity < 0:
        log.set_verbosity_error()
        warnings.filterwarnings("ignore")
    else:
        log.set_verbosity_info() if opts.verbosity > 0 else log.set_verbosity_warning()
    log.enable_progress_bar() if opts.show_progress else log.disable_progress_bar()


def warn(message: str) -> None:
    """A warning for the user, on stderr whatever the output format."""
    click.echo(f"warning: {message}", err=True)
