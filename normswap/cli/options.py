"""The options of a command, generated from its workflow's options dataclass (`flags`) beside the ones every
command shares (--json; -q/-v from the main group), collected into a frozen `Shared` the command receives as
`opts` and the workflow's options object it receives as `options`."""
from __future__ import annotations

import functools
import sys
import warnings
from dataclasses import dataclass, fields

import click
import transformers

from normswap.cli.flags import build, click_options
from normswap.errors import FellBackToNaive, printable


@dataclass(frozen=True)
class Shared:
    """One command's shared options."""
    verbosity: int = 0                    # -q: -1, -v: 1
    as_json: bool = False                 # --json: stdout is exactly one JSON object

    @property
    def show_progress(self) -> bool:
        """Bars only on a terminal, never with -q or --json (stdout must stay one JSON object)."""
        return self.verbosity >= 0 and not self.as_json and sys.stderr.isatty()


def shared(options=None, skip=()):
    """Decorator: add --json and the options of dataclass `options` (but the dotted fields in `skip`) to a
    command, which receives them as `opts: Shared` and `options` (its show_progress set from `opts`)."""
    def deco(command):
        @functools.wraps(command)
        def run(*args, **kw):
            opts = Shared(click.get_current_context().find_root().obj or 0, kw.pop("as_json"))
            if options is not None:
                progress = [f.name for f in fields(options) if f.name == "show_progress"]
                kw["options"] = build(options, kw, skip, **dict.fromkeys(progress, opts.show_progress))
            setup_output(opts)
            return command(*args, opts=opts, **kw)
        run.options_class = options   # the group's error messages name the flags of every command's options
        for option in reversed([click.option("--json", "as_json", is_flag=True,
                                             help="Print one JSON object instead of text.")]
                               + (click_options(options, skip) if options is not None else [])):
            run = option(run)
        return run
    return deco


def setup_output(opts: Shared) -> None:
    """Library logging and progress bars for one command: -q errors only, default warnings, -v info."""
    log = transformers.utils.logging
    warnings.formatwarning = _one_line_warning
    # the command prints a report's warnings itself (also with --json): auto's fallback would show twice
    warnings.filterwarnings("ignore", category=FellBackToNaive)
    if opts.verbosity < 0:
        log.set_verbosity_error()
        warnings.filterwarnings("ignore")
    else:
        log.set_verbosity_info() if opts.verbosity > 0 else log.set_verbosity_warning()
    log.enable_progress_bar() if opts.show_progress else log.disable_progress_bar()


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    """A library's (or a folder load's) warning as the CLI prints its own: `warning: ...`, one line, no source line."""
    return f"warning: {' '.join(str(message).split())}\n"


def warn(message: str) -> None:
    """A warning for the user, on stderr whatever the output format."""
    click.echo(f"warning: {printable(message)}", err=True)
