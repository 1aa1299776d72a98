"""Example inputs from a file (`normswap convert --inputs FILE`): what a Python caller passes as
`example_inputs`, saved.

Two formats:
- a `torch.save` of the batches (a tensor, a tuple of positional arguments, a dict of keyword arguments, or a
  list of those), read with `weights_only=True`, so the file can run no code;
- a safetensors file: its tensors are one batch of keyword arguments (`input_ids`, `attention_mask`), or
  several batches as `<batch>.<name>` (`0.input_ids`, `1.input_ids`). A name that is a number is a positional
  argument (`0`, `1`; `0.0` in batch 0).
"""
from __future__ import annotations

import zipfile
from pathlib import Path

import torch

from normswap.errors import NormswapError, first_line


def _batch(tensors: dict[str, torch.Tensor], file: Path) -> torch.Tensor | tuple | dict:
    """One batch's tensors by name: keyword arguments, or positional ones where every name is 0, 1, ..."""
    names = list(tensors)
    if all(n.isdigit() for n in names):
        order = sorted(int(n) for n in names)
        if order != list(range(len(order))):
            raise NormswapError(f"`example_inputs` file {file}: positional arguments {order} are not 0, 1, ...")
        return tuple(tensors[str(i)] for i in order)
    if any(n.isdigit() for n in names):
        raise NormswapError(f"`example_inputs` file {file}: names mix positional (numbers) and keyword arguments")
    return dict(tensors)


def _from_safetensors(file: Path) -> list | torch.Tensor | tuple | dict:
    from safetensors.torch import load_file
    tensors = load_file(str(file))
    if not tensors:
        raise NormswapError(f"`example_inputs` file {file} holds no tensor")
    prefixed = {k: k.partition(".") for k in tensors}
    if not any(sep for _, sep, _ in prefixed.values()):
        return _batch(tensors, file)
    if not all(sep and head.isdigit() for head, sep, _ in prefixed.values()):
        raise NormswapError(f"`example_inputs` file {file}: either every name is `<batch>.<name>` (0.input_ids) "
                            "or none is")
    by_batch: dict[int, dict] = {}
    for k, (head, _, rest) in prefixed.items():
        by_batch.setdefault(int(head), {})[rest] = tensors[k]
    return [_batch(by_batch[i], file) for i in sorted(by_batch)]


def read_batches(path: str | Path):
    """The example inputs saved in `path` (see the module docstring); one-line NormswapError otherwise."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise NormswapError(f"`example_inputs` file {file} does not exist" if not file.exists() else
                            f"`example_inputs` {file} is not a file")
    if not zipfile.is_zipfile(file):   # torch.save writes a zip archive; safetensors a header and raw bytes
        try:
            return _from_safetensors(file)
        except NormswapError:
            raise
        except Exception as e:
            if file.suffix == ".safetensors":
                raise NormswapError(f"`example_inputs` file {file} is not a valid safetensors file "
                                    f"({first_line(e, strip=True)})") from None
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:
        raise NormswapError(f"`example_inputs` file {file} is neither a safetensors file nor a torch.save of "
                            f"tensors ({type(e).__name__}: {first_line(e, strip=True)})") from None
