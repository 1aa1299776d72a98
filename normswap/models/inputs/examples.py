"""The user's own example inputs (`example_inputs=`), as torch.export takes them, and the inputs a model is
traced, rehearsed and verified on: normswap's own samples where it can build them (transformers models), the
user's examples added to them; the examples alone for any other nn.Module.

`example_inputs` is one batch or a list of batches. A batch is a tensor (the forward's first argument), a
tuple of positional arguments, or a dict of keyword arguments. Each batch is bound to the forward's
signature once, so the rest of normswap passes it by name (`model(**batch)`), as it does its own samples.
"""
from __future__ import annotations

import inspect
from pathlib import Path

import torch

from normswap.errors import NormswapError, first_line
from normswap.io.batches import read_batches
from normswap.folder.attached import has_config
from normswap.models.inputs import sample_inputs
from normswap.folder.shipped import original_class

Batch = torch.Tensor | tuple | dict
HOW = ("pass `example_inputs`: a batch of what its forward takes (a tensor, a tuple of positional arguments or "
       "a dict of keyword arguments), or a list of batches")


class Example(dict):
    """One batch of the user's `example_inputs`, bound to the forward's arguments (a dict of them, as normswap's
    own samples are); `index`: its place among the user's batches, so that a failure on it is called theirs."""

    def __init__(self, arguments: dict, index: int):
        super().__init__(arguments)
        self.index = index


class NoInputs(NormswapError):
    """normswap cannot build sample inputs for a model, and no example inputs were given."""


def batches_of(example_inputs) -> list:
    """`example_inputs` as a list of batches (one batch or a list of them, or a file of them: `io.batches`;
    None: none)."""
    if example_inputs is None:
        return []
    if isinstance(example_inputs, (str, Path)):
        example_inputs = read_batches(example_inputs)
    if isinstance(example_inputs, list):
        if not example_inputs:
            raise NormswapError("`example_inputs` is an empty list: give at least one batch")
        return list(example_inputs)
    return [example_inputs]


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (tuple, list)) else ()
    return [t for v in items for t in _tensors(v)]


def _placed(value, device: torch.device, dtype: torch.dtype):
    """`value` with its tensors on `device`, floating ones in `dtype` (the model's, as for normswap's samples)."""
    if isinstance(value, torch.Tensor):
        return value.to(device, dtype) if value.is_floating_point() else value.to(device)
    if isinstance(value, dict):
        return {k: _placed(v, device, dtype) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_placed(v, device, dtype) for v in value)
    return value


def check_batch(batch, i: int) -> str:
    """How errors name batch `i`; a one-line NormswapError where it is not a batch."""
    where = f"`example_inputs` batch {i}"
    if not isinstance(batch, (torch.Tensor, tuple, dict)):
        raise NormswapError(f"{where} is a {type(batch).__name__}: a batch is a tensor, a tuple of positional "
                            "arguments or a dict of keyword arguments")
    if isinstance(batch, dict) and not all(isinstance(k, str) for k in batch):
        raise NormswapError(f"{where}: a dict batch is keyword arguments, so its keys must be strings")
    if not _tensors(batch):
        raise NormswapError(f"{where} holds no tensor")
    if any(t.is_meta for t in _tensors(batch)):
        raise NormswapError(f"{where} holds a tensor on the meta device, which has a shape but no values: give "
                            "tensors with values")
    return where


def bind(model, batch: Batch, i: int = 0) -> dict:
    """One batch as the keyword arguments of `model.forward` (one-line NormswapError where it does not fit)."""
    where = check_batch(batch, i)
    args, kwargs = ((batch,), {}) if isinstance(batch, torch.Tensor) else (batch, {}) \
        if isinstance(batch, tuple) else ((), batch)
    sig = inspect.signature(model.forward)
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as e:
        name = original_class(model).__name__
        raise NormswapError(f"{where} does not fit {name}.forward{sig}: {first_line(e)}") from None
    out = {}
    for name, value in bound.arguments.items():
        kind = sig.parameters[name].kind
        if kind == inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        elif kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.POSITIONAL_ONLY):
            raise NormswapError(f"{where}: {original_class(model).__name__}.forward takes `{name}` only by position "
                                "(*args or positional-only), which normswap cannot pass by name: wrap the model "
                                "in a module whose forward names its inputs")
        else:
            out[name] = value
    return out


def as_batches(model, example_inputs) -> list[Example]:
    """The user's `example_inputs` bound to `model.forward`, on the model's device, floating tensors in its
    dtype."""
    ref = next((p for p in model.parameters() if p.is_floating_point()), None)
    device = ref.device if ref is not None else torch.device("cpu")
    dtype = ref.dtype if ref is not None else torch.float32
    return [Example(_placed(bind(model, b, i), device, dtype), i) for i, b in enumerate(batches_of(example_inputs))]


def model_inputs(model, example_inputs=None) -> list[dict]:
    """The batches `model` is traced, rehearsed and verified on: normswap's samples (where it can build them)
    followed by the user's `example_inputs`; the examples alone where it cannot. Neither: a one-line
    NormswapError that says to pass `example_inputs`."""
    own = as_batches(model, example_inputs)
    if not has_config(model):   # normswap builds inputs from a transformers config
        if own:
            return own
        name = type(getattr(model.forward, "__self__", model)).__name__
        raise NoInputs(f"normswap cannot build sample inputs for {name} (not a transformers model with a "
                            f"config): {HOW}")
    try:
        return sample_inputs(model) + own
    except NormswapError as e:
        if own:
            return own
        raise NoInputs(f"{e}; {HOW}") from None


def check_examples(example_inputs) -> None:
    """Refuse malformed `example_inputs` before any work (how they bind to a forward is checked once a model
    is loaded)."""
    for i, b in enumerate(batches_of(example_inputs)):
        check_batch(b, i)


