"""The `normswap` command group: a thin shell over the Python API. Every failure is one line on stderr: "error:
..." for what the user can act on (a NormswapError, out of memory, an OS error), "internal error: ..." for any
other exception, a bug of normswap's, whose traceback `-v` prints.

Exit codes: 0 success, 1 runtime error (or internal error), 2 usage error, 130 Ctrl-C, 143 SIGTERM.
"""
from __future__ import annotations

import importlib
import logging
import signal
import sys
import traceback

import click

from normswap import signals
from normswap.cli.commands import COMMANDS
from normswap.cli.flags import error_names
from normswap.errors import Interrupted, NormswapError, first_line, printable

_NoArgs = getattr(click.exceptions, "NoArgsIsHelpError", ())


def _one_line(text: str) -> str:
    return " ".join(text.split())


def out_of_memory(e: Exception) -> bool:
    """Whether `e` says the machine ran out of memory: a MemoryError, torch's OutOfMemoryError (GPU), or the plain
    RuntimeError torch's CPU allocator raises, which says so only in its text: this is the one place that reads it."""
    torch = sys.modules.get("torch")   # imported by every command that can run out of memory
    gpu = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    return isinstance(e, MemoryError) or gpu is not None and isinstance(e, gpu) or \
        isinstance(e, RuntimeError) and "DefaultCPUAllocator" in str(e)


def _environment(e: Exception) -> bool:
    """Out of memory or an OS error (disk full, no permission): the machine's, not a bug."""
    return isinstance(e, OSError) or out_of_memory(e)


class Group(click.Group):
    """Turns every failure into one line on stderr and a non-zero exit (a bug's traceback only with -v). Its commands
    (`lazy`: name -> "module:function") are imported when first asked for."""

    def __init__(self, *args, lazy: dict[str, str] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.lazy = dict(lazy or {})

    def list_commands(self, ctx) -> list[str]:
        return sorted({*self.commands, *self.lazy})

    def get_command(self, ctx, name: str):
        if name not in self.commands and name in self.lazy:
            module, _, function = self.lazy[name].partition(":")
            self.add_command(getattr(importlib.import_module(module), function), name)
        return self.commands.get(name)

    def main(self, *args, standalone_mode=True, **kwargs):
        # Where torchao is installed, transformers imports it and torch logs two deprecation warnings about
        # torchao's enums: nothing a user can act on, and two lines before every command's own output
        logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            rv = super().main(*args, standalone_mode=False, **kwargs)
        except _NoArgs as e:  # plain `normswap`: the help, as before
            click.echo(e.ctx.get_help())
            sys.exit(0)
        except click.UsageError as e:  # click would print usage + a hint + the error: three lines
            hint = f" (see '{e.ctx.command_path} --help')" if e.ctx else ""
            click.echo(f"error: {_one_line(e.format_message())}{hint}", err=True)
            sys.exit(2)
        except click.ClickException as e:
            click.echo(f"error: {_one_line(e.format_message())}", err=True)
            sys.exit(e.exit_code)
        except click.Abort:
            # Ctrl-C outside a command's run (commands' own are handled in invoke): while a command's module
            # imports, say; nothing was written yet
            click.echo("interrupted: nothing was written", err=True)
            sys.exit(130)
        sys.exit(rv if isinstance(rv, int) else 0)

    def flag_names(self) -> dict[str, str]:
        """How errors name options on the command line, from the options dataclasses of every command."""
        commands = [self.get_command(None, name) for name in self.list_commands(None)]
        classes = dict.fromkeys(getattr(c.callback, "options_class", None) for c in commands)
        return error_names(*(c for c in classes if c is not None))

    def invoke(self, ctx):
        old_term = signals.install(signals.interrupt, (signal.SIGTERM,))  # SIGTERM ends a run as Ctrl-C does
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.ClickException, click.Abort, BrokenPipeError):
            raise   # a closed pipe (`| head -3`): click's main ends quietly, exit 1
        except NormswapError as e:
            try:
                names = self.flag_names()
            except Exception:   # it imports every command's module, and memory may have run out (ulimit -v)
                names = {}
            click.echo(f"error: {printable(e.for_cli(names))}", err=True)
        except KeyboardInterrupt as e:
            e = Interrupted.after(e)
            done = f"{', '.join(e.written)} written" if e.written else "nothing was written"
            click.echo(f"interrupted: {done}", err=True)
            sys.exit(128 + (e.signum if isinstance(e.signum, int) else 2))
        except Exception as e:  # out of memory, or a bug of ours: still one line (-v: the traceback before it)
            msg = first_line(e, strip=True) or ("out of memory" if isinstance(e, MemoryError) else "(no message)")
            line = f"{type(e).__name__}: {printable(msg)}"
            if _environment(e):
                click.echo(f"error: {line}", err=True)
            elif ctx.find_root().params.get("verbose"):
                click.echo("".join(traceback.format_exception(type(e), e, e.__traceback__)), err=True, nl=False)
                click.echo(f"internal error: {line}", err=True)
            else:
                click.echo(f"internal error: {line} (run with -v for the traceback)", err=True)
        finally:
            signals.restore(old_term)
        sys.exit(1)


@click.group(cls=Group, lazy=COMMANDS, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="normswap")
@click.option("-q", "--quiet", "quiet", count=True,
              help="No warnings, no progress bars (errors and the result still print).")
@click.option("-v", "--verbose", "verbose", count=True, help="Also the libraries' info messages.")
@click.pass_context
def main(ctx, quiet, verbose):
    """Turn a model's LayerNorms into RMSNorm, verify it, save it."""
    ctx.obj = verbose - quiet   # the verbosity every command's `Shared` options read
