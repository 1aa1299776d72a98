"""Record a model's dataflow over forward passes on sample inputs: what each norm reads, who reads each
layer's output, which parameters ran.

Every followed (floating) tensor has a `flow.Flow`: the labels (`labels.Label`) it combines ("layer:<name>"
for a known layer's output, "norm:<name>" for a norm's output, "param:<name>" for a parameter used directly,
"scale:<param>" for a layer output scaled by a per-channel parameter, "entry:<block>" for an opaque value
entering a block) and where their channels are; `rules` says which operations keep it pure. The first
opaque operation on a pure tensor is a *use* of its labels (with the channels it read). A known leaf
module reading a pure tensor is a use too, except a norm (it removes the mean), a per-channel scale
(LayerScale) and a linear layer reading exactly one norm's output, moved but unchanged (a *reader*).
A slice of the hidden dim that reaches a leaf is a use only once its values are read (BART's
`embed_positions(inputs_embeds[..., -1])` reads it for its shape).

Known leaves (Linear, GPT-2 Conv1D, Embedding, ConvNd, norms, LayerScale) are hooked and their inner
calls hidden; every other module is traced through, so parameters used by hand (a mixture of experts'
stacked weights, nn.MultiheadAttention's projections) are followed too. Every floating tensor the forward
returns is read by "the model output" (`plan` decides what that means). Tracing every sample input and
merging covers norms called more than once and paths only some inputs take; parameters that still did not
run get one training-mode forward (SpecAugment's masked embedding), and the rest are reported by `plan`.
Cost: one forward per input; tensors are kept alive (so their ids stay unique) only for that forward.

A forward that fails is the model's problem (`ForwardFailed`: a refusal, not a bug) unless the recorder's own
code failed inside it (`Guarded.guarded`): that failure is raised as it is, a bug of normswap's.
"""
from __future__ import annotations

import torch
from torch import nn

from normswap.errors import NormswapError, first_line
from normswap.models.introspect import is_linear, is_scale
from normswap.models.modes import eval_mode
from normswap.parity import by_rows, tensors_in
from normswap.surgery.centring import input_fixes_first
from normswap.surgery.flow import NormInput
from normswap.surgery.labels import Label
from normswap.surgery.record import Recorder, Trace
from normswap.surgery.rules import IGNORE

__all__ = ["IGNORE", "ForwardFailed", "Trace", "hooked", "tensors_in", "trace"]


class ForwardFailed(NormswapError):
    """The model's own forward failed on a sample input while traced (the model's problem, or its inputs', not
    the tracer's): `error` is what it raised; the message quotes it as "<type>: <its first line>"."""

    def __init__(self, error: Exception):
        super().__init__(f"{type(error).__name__}: {first_line(error, strip=True)}")
        self.error = error


class Guarded(Recorder):
    """The recorder, its own failures inside the model's forward kept (`failure`, the first): a bug of normswap's,
    whatever the model's code then does with it (a try/except that goes on)."""

    failure: Exception | None = None

    def guarded(self, step, *args):
        """`step(*args)`, one of the recorder's own steps (a hook, what an operation does to the flows)."""
        try:
            return step(*args)
        except Exception as e:
            self.failure = self.failure or e
            raise

    def observe(self, func, args, kwargs, out) -> None:
        self.guarded(super().observe, func, args, kwargs, out)


def hooked(module: nn.Module, name: str, norms: set[str]) -> bool:
    """A leaf the trace treats as one labelled layer: norms, linear layers, embeddings, convolutions, and
    per-channel scales (LayerScale: one 1-D parameter). Other modules are traced through."""
    if next(module.children(), None) is not None:
        return False
    return name in norms or is_linear(module) or isinstance(module, (nn.Embedding, nn.Conv1d, nn.Conv2d,
                                                                    nn.Conv3d)) or is_scale(module)


@torch.no_grad()
def trace(model: nn.Module, inputs: list[dict], norms: set[str], rotating: bool = False) -> Trace:
    """Run `model(**x)` for every x in `inputs`, in eval mode, and record the merged dataflow; `norms` are
    the norm modules (`rotating`: every RMSNorm is one, centred rows or not; else an RMSNorm reading rows that
    are not centred reads like any layer, as centring changes its output). If some parameters never ran, one
    more forward in training mode (RNG state and buffers restored after it) shows the paths only training
    takes (SpecAugment's masked embedding): what it shows of those parameters is added, so that they are
    centred too rather than left unknown (nothing else from it: training-only operations do not make an exact
    eval model inexact)."""
    with input_fixes_first(model):   # a converted model's (rotation traces it): ahead of the entry hooks below
        return _traced(model, inputs, norms, rotating)


def _traced(model: nn.Module, inputs: list[dict], norms: set[str], rotating: bool) -> Trace:
    active = [Guarded(model, norms, rotating)]
    handles = []
    for name, module in model.named_modules():
        if hooked(module, name, norms):
            handles.append(module.register_forward_pre_hook(
                lambda m, a, k, n=name: active[0].guarded(active[0].pre, n, m, a, k), with_kwargs=True))
            handles.append(module.register_forward_hook(
                lambda m, a, o, n=name: active[0].guarded(active[0].post, n, m, o)))
        elif next(module.children(), None) is not None:
            handles.append(module.register_forward_pre_hook(
                lambda m, a, k, n=name: active[0].guarded(active[0].entry, n, a, k), with_kwargs=True))
            handles.append(module.register_forward_hook(lambda m, a, o: active[0].guarded(active[0].leave)))
    rec = active[0]
    try:
        with eval_mode(model):
            _forwards(rec, model, inputs)
            rec.finish()
            unrun = {n for n, _ in model.named_parameters()} - rec.trace.ran
            if inputs and unrun:
                active[0] = Guarded(model, norms, rotating)
                _training_forward(active[0], model, inputs[0])
                active[0].finish()
                adopt(rec.trace, active[0].trace, unrun)
    finally:
        for h in handles:
            h.remove()
    return rec.trace


def adopt(t: Trace, seen: Trace, unrun: set[str]) -> None:
    """Add to `t` what `seen` (a training-mode trace) shows of labels made only of parameters `t` never ran:
    the norm inputs they are part of, their uses and widths; those parameters then count as run, unless a
    norm input they are part of went through an operation that made it opaque (their role stays unknown).
    Nothing else from `seen` is taken: a training-only operation does not make an exact eval model inexact."""
    new = seen.ran & unrun

    def params(label: Label) -> set[str]:
        if label.kind == "param":
            return {label.name}
        return {p for p in seen.ran if p.rpartition(".")[0] == label.name} if label.kind == "layer" else set()
    labels = {lb for lb in {*seen.uses, *(x for calls in seen.calls.values() for c in calls for x in c.sources)}
              if params(lb) and params(lb) <= new}
    unclear = set()   # labels part of a norm input training made opaque: their role stays unknown
    for norm, calls in seen.calls.items():
        for call in calls:
            kept = {lb: r for lb, r in call.sources.items() if lb in labels}
            if call.opaque:
                unclear |= set(kept)
            elif kept:
                t.calls[norm].append(NormInput(kept))
                for lb in kept:
                    t.fed_norms[lb].add(norm)
    for lb in labels - unclear:
        t.uses[lb].update(seen.uses.get(lb, {}))
        if lb in seen.widths:
            t.widths.setdefault(lb, seen.widths[lb])
        t.ran |= params(lb)


def _forwards(rec: Guarded, model: nn.Module, inputs: list[dict]) -> None:
    """A traced forward per input; ForwardFailed where the model fails on one, the recorder's own failure (a
    bug) as it is, even where the model's code caught it."""
    try:
        for x in inputs:   # a head that takes one row at a time (GPT-2 classifier, no pad token): by rows
            by_rows(lambda batch: _forward(rec, model, batch), x)
    except Exception as e:
        if rec.failure is None:
            raise ForwardFailed(e) from e
        raise rec.failure from None
    if rec.failure is not None:
        raise rec.failure


def _forward(rec: Guarded, model: nn.Module, x: dict) -> None:
    try:
        with rec:
            out = model(**x)
        rec.guarded(rec.outputs, out)
    finally:
        rec.flows.clear()
        rec.pending.clear()
        rec.stack.clear()
        rec.inside = None


def _training_forward(rec: Guarded, model: nn.Module, x: dict) -> None:
    """One forward in training mode that leaves no trace on the model or the RNG; skipped if it fails."""
    buffers = [(b, b.clone()) for b in model.buffers()]
    cuda = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    try:
        with torch.random.fork_rng(devices=cuda):
            model.train()
            _forward(rec, model, x)
    except Exception:   # a model that needs more in training (labels...): coverage stays as eval saw it
        if rec.failure is not None:   # but a failure of the recorder's own is a bug
            raise rec.failure from None
    finally:
        model.eval()
        for b, saved in buffers:
            b.copy_(saved)
    if rec.failure is not None:   # caught by the model's own code: still a bug
        raise rec.failure
