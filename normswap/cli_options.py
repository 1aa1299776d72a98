"""Options shared by every command: --device, --dtype, and the -q/-v verbosity set on the main group."""
from __future__ import annotations

import sys

import click
import torch

from normswap.errors import NormswapError

# CLI names -> torch dtype names; the long names stay accepted (earlier releases used them).
DTYPE_NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16",
               "float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}


def resolve_device(name: str | None) -> torch.device:
    """auto: CUDA when available, else CPU. cuda / cuda:N / cpu / mps are checked, not assumed."""
    name = (name or "auto").strip().lower()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise NormswapError(f"unknown device '{name}': use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise NormswapError(f"--device {name}: no CUDA device is available here")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise NormswapError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) here")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise NormswapError(f"--device {name}: MPS is not available here")
    elif device.type not in ("cpu", "cuda", "mps"):
        raise NormswapError(f"unsupported device '{name}': use auto, cpu, cuda or cuda:N")
    return device


device_option = click.option("--device", default="auto", show_default=True,
                             help="auto (CUDA when available), cpu, cuda, cuda:N.")
dtype_option = click.option("--dtype", type=click.Choice(list(DTYPE_NAMES)), default=None,
                            help="Load the model in this dtype (default: as stored; the demo model: fp32).")


def dtype_name(dtype: str | None) -> str | None:
    return DTYPE_NAMES[dtype] if dtype else None


def setup_output(verbosity: int, as_json: bool = False) -> None:
    """Library logging and progress bars for one command: -q errors only, default warnings, -v info."""
    import warnings

    import transformers

    from normswap import progress
    log = transformers.utils.logging
    if verbosity < 0:
        log.set_verbosity_error()
        warnings.filterwarnings("ignore")
    else:
        log.set_verbosity_info() if verbosity > 0 else log.set_verbosity_warning()
    bars = verbosity >= 0 and not as_json and sys.stderr.isatty()
    log.enable_progress_bar() if bars else log.disable_progress_bar()
    progress.enable(bars)


def warn(message: str) -> None:
    """A warning for the user, on stderr whatever the output format."""
    click.echo(f"warning: {message}", err=True)
