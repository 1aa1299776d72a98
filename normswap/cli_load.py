"""`--trust-remote-code` and `--allow-missing-weights`, shared by every command that loads a SRC."""
from __future__ import annotations

import click


def _set_policy(ctx, param, value):
    from normswap.io import LOAD_POLICY
    setattr(LOAD_POLICY, param.name, bool(value))  # called with the default too: each run starts safe
    return value


def load_options(command):
    """Add the two loading options to a click command (they set normswap.io.LOAD_POLICY)."""
    command = click.option("--allow-missing-weights", is_flag=True, expose_value=False, callback=_set_policy,
                           help="Load SRC even if its weights lack tensors, have extra ones or wrong shapes "
                                "(missing ones get random values). Default: an error naming them.")(command)
    return click.option("--trust-remote-code", is_flag=True, expose_value=False, callback=_set_policy,
                        help="Run the Python code a model folder ships (auto_map). Default: never run it, "
                             "never prompt.")(command)
