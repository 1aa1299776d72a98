"""The original's outputs on sample inputs, recorded before its weights are edited (instead of a copy of the
model): in memory, or spilled to disk as they are produced (`io.spill`) and mapped back a block at a time."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn

from normswap.errors import NormswapError, first_line
from normswap.folder.shipped import original_class
from normswap.io.spill import Spill, Spilled
from normswap.models.inputs.examples import Example, model_inputs
from normswap.parity.outputs import floating_outputs, main_output
from normswap.parity.rows import by_rows


@dataclass
class Reference:
    """A model's outputs on sample inputs, kept instead of a copy of the model (see `reference_outputs`)."""
    inputs: list[dict]
    outputs: list[dict]  # per batch: name -> tensor (or `Spilled`: on disk), every compared output
    output: str          # name of the main output
    excluded: dict = field(default_factory=dict)   # name -> why it is not compared

    @property
    def nonfinite(self) -> int:
        n = 0
        for out in self.outputs:
            for o in out.values():
                with reading(o) as (values, _):
                    n += int((~values.isfinite()).sum())
        return n


@contextmanager
def reading(v: torch.Tensor | Spilled):
    """(values, drop) of a recorded output: the tensor itself, or one kept on disk mapped back, whose
    `drop()` gives back the pages read so far (`Spilled.mapped`)."""
    if isinstance(v, Spilled):
        with v.mapped() as pair:
            yield pair
    else:
        yield v, _nothing


def _nothing() -> None:
    pass


def run(model: nn.Module, batch: dict, seed: int):
    """model(**batch) with the RNG seeded: random draws inside a forward repeat in the comparison run."""
    device = next((v.device for v in batch.values() if isinstance(v, torch.Tensor)), torch.device("cpu"))
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        return model(**batch)


@torch.no_grad()
def reference_outputs(model: nn.Module, inputs: list[dict] | None = None, skip: dict | None = None,
                      spill: Spill | None = None) -> Reference:
    """Run `model` on `inputs` (default: `model_inputs`, its sample inputs) and keep every floating output,
    detached, but those `skip` names (name -> why; "a.b" covers "a.b.c" too), which go to `excluded` with their reason.
    With `spill`, the outputs are written there as they are produced and none stays in memory (a lazy conversion: the
    converted model then runs with none of them resident).

    Take it before editing the weights; `compare_to` later needs only this, not a copy of the model.
    """
    inputs = inputs if inputs is not None else model_inputs(model)
    ref = Reference([], [], "output")
    for i, batch in enumerate(inputs):
        _record(ref, model, i, batch, skip, spill)   # its outputs freed before the next batch runs
    return ref


def _record(ref: Reference, model: nn.Module, i: int, batch: dict, skip: dict | None, spill: Spill | None) -> None:
    """Run batch `i` (row by row where the batch fails: `by_rows`) and add what it gives to `ref`."""
    try:
        runs = by_rows(partial(run, model, seed=i), batch)
    except Exception as e:
        raise unrunnable(model, e, batch) from None
    # sparse tensors (Whisper's alignment_heads buffer) have no storage: an edit never writes into one
    mine = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())
            if not t.is_meta and t.layout == torch.strided}
    while runs:
        x, result = runs.pop(0)
        ref.output = main_output(result)[0]
        kept, left = floating_outputs(result)
        del result
        ref.excluded.update(left)
        for k in [k for k in kept if skipped(k, skip)]:
            ref.excluded[k] = skipped(k, skip)
            del kept[k]
        ref.inputs.append(x)
        ref.outputs.append({k: spill.put(v) if spill is not None else _owned(v, mine) for k, v in kept.items()})


def _owned(v: torch.Tensor, mine: set[int]) -> torch.Tensor:
    """v detached, copied only where it is a view or a model's own tensor (`mine`: their storages' addresses,
    which an in-place edit would change): copying every output held two of each (a big vocabulary's logits)."""
    if v.layout != torch.strided:   # no storage to share with the model
        return v.detach().clone()
    storage = v.untyped_storage()
    view = v._base is not None or storage.nbytes() != v.numel() * v.element_size()
    return v.detach().clone() if view or storage.data_ptr() in mine else v.detach()


def unrunnable(model: nn.Module, e: Exception, batch: dict | None = None) -> NormswapError:
    """The one-line refusal for a model that fails on an input `batch`: nothing can be compared, so no conversion
    of it can be checked. A batch of the user's `example_inputs` is named as theirs; others normswap built."""
    if isinstance(e, NormswapError):
        return e
    line = first_line(e, strip=True)
    if isinstance(batch, Example):
        return NormswapError(f"{original_class(model).__name__} fails on your `example_inputs` batch {batch.index} "
                             f"({type(e).__name__}: {line}): give batches the model runs on")
    return NormswapError(f"{original_class(model).__name__} fails on the sample inputs normswap built for it "
                         f"({type(e).__name__}: {line}), so no conversion of it can be checked (inputs of this "
                         "kind are not supported yet)")


def skipped(name: str, skip: dict | None) -> str | None:
    """Why output `name` is not compared, if `skip` (name -> why) names it or an output holding it."""
    for k, why in (skip or {}).items():
        if name == k or name.startswith(k + "."):
            return why
    return None
