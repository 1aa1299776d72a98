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


def _number(name: str, file: Path) -> int | None:
    """`name` as a batch or argument number (ASCII digits), else None; a number written with a leading zero
    (`00`, `01`) is refused: it would name the same batch or argument as `0`, `1`."""
    if not name or not all("0" <= c <= "9" for c in name):
        return None
    if name != str(int(name)):
        raise NormswapError(f"`example_inputs` file {file}: the number {name!r} in a tensor name has a leading zero: "
                            "write batches and positional arguments as 0, 1, 2, ... (one name for each)")
    return int(name)


def _batch(tensors: dict[str, torch.Tensor], file: Path) -> torch.Tensor | tuple | dict:
    """One batch's tensors by name: keyword arguments, or positional ones where every name is 0, 1, ..."""
    numbers = {n: _number(n, file) for n in tensors}
    if all(i is not None for i in numbers.values()):
        order = sorted(numbers.values())
        if order != list(range(len(order))):
            raise NormswapError(f"`example_inputs` file {file}: positional arguments {order} are not 0, 1, ...")
        return tuple(tensors[str(i)] for i in order)
    if any(i is not None for i in numbers.values()):
        raise NormswapError(f"`example_inputs` file {file}: names mix positional (numbers) and keyword arguments")
    return dict(tensors)


def _from_safetensors(file: Path, tensors: dict[str, torch.Tensor]) -> list | torch.Tensor | tuple | dict:
    """The batches a safetensors file's tensors make, by their names (see the module docstring)."""
    if not tensors:
        raise NormswapError(f"`example_inputs` file {file} holds no tensor")
    prefixed = {k: k.partition(".") for k in tensors}
    if not any(sep for _, sep, _ in prefixed.values()):
        return _batch(tensors, file)
    if not all(sep and _number(head, file) is not None for head, sep, _ in prefixed.values()):
        raise NormswapError(f"`example_inputs` file {file}: either every name is `<batch>.<name>` (0.input_ids) "
                            "or none is")
    by_batch: dict[int, dict] = {}
    for k, (head, _, rest) in prefixed.items():
        by_batch.setdefault(_number(head, file), {})[rest] = tensors[k]
    return [_batch(by_batch[i], file) for i in sorted(by_batch)]


def read_batches(path: str | Path):
    """The example inputs saved in `path` (see the module docstring); one-line NormswapError otherwise."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise NormswapError(f"`example_inputs` file {file} does not exist" if not file.exists() else
                            f"`example_inputs` {file} is not a file")
    if not zipfile.is_zipfile(file):   # torch.save writes a zip archive; safetensors a header and raw bytes
        from safetensors.torch import load_file
        try:
            tensors = load_file(str(file))
        except Exception as e:
            if file.suffix == ".safetensors":
                raise NormswapError(f"`example_inputs` file {file} is not a valid safetensors file "
                                    f"({first_line(e, strip=True)})") from None
        else:   # a valid file: what its names mean is checked apart (never "not a valid file")
            return _from_safetensors(file, tensors)
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:
        raise NormswapError(f"`example_inputs` file {file} is neither a safetensors file nor a torch.save of "
                            f"tensors ({type(e).__name__}: {first_line(e, strip=True)})") from None
