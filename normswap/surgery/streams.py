"""The residual streams of an exactly converted model, found by the trace the exact plan uses, for a rotation.

A model whose norms are all RMSNorms is invariant under an orthogonal Q of each stream they read: RMSNorm(xQ)
= RMSNorm(x)Q (‖xQ‖ = ‖x‖), once a norm's gain g is folded into the linear layers reading it. So a stream
can be rotated when everything that writes it is a layer (or a parameter) whose output can be multiplied by Q,
and everything that reads it is a norm whose output only linear layers read (`Stream`). A norm's sources are
what its input is a sum of (`trace`); norms that share a source, or a reader, read one stream. Two kinds of
norm get a d x d matrix after them instead (an output fix): one whose output is read other than by linear
layers (the model output, an attention module, an activation) keeps its output unrotated (`Stream.kept`: its
linear readers, if any, are left as they are), and one that writes the stream (BLOOM's and mBART's embedding
norms: `Writer.norm`) reads an unrotated input and rotates its output. An opaque value entering the stream
(Whisper's encoder, after a GELU) is rotated by the block input fix that centres it, with a matrix too.

The norms are normswap's and torch's RMSNorms and any module another library defines that computes
x * rsqrt(mean(x²) + eps) * g, found by calling it (`probe_rms`), whose gain g is one of its parameters, or one
plus it (Gemma). A per-head norm inside a block (Qwen3's q and k norms: groups of channels of a layer's output
that no norm of a stream reads) is no stream's and stays as it is (`Streams.inner`).

Refused, naming the part (`Refusal`): a LayerNorm left (convert exactly first), a pRMSNorm (its RMS of a few
features does not commute with Q), a module whose class says RMSNorm but that computes something else (or whose
gain is not a parameter), a norm that did not run or whose input is not a plain sum, a per-head norm of a stream's
writer (it normalises groups of channels the rotation mixes), a norm writing the stream whose output is also read
(by the model output, a layer) or normalised again by a norm writing a stream, or whose input is also part of a
rotated stream, an opaque value writing the stream without an input fix, a writer also read unnormalised (a head
reading the raw stream), a writer no weight edit can rotate (a grouped convolution, a non-constant per-channel
scale), a bias kept after a writer, a centred input. A bias the conversion kept after a norm (its output is also
returned, as CLIP's text tower's) is folded into its (linear) readers instead. A tuple or sub-model output holding
the stream (`hidden_states`) is returned rotated: listed as not preserved, as the exact conversion lists it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from normswap.errors import NormswapError
from normswap.folder.attached import section
from normswap.models.introspect import is_linear, norm_kind
from normswap.norms import PartialRMSNorm, RMSNorm
from normswap.surgery.algebra import scale_parameter
from normswap.surgery.labels import Label
from normswap.surgery.plan import centrable
from normswap.surgery.probe import NotLayerNorm, probe_rms
from normswap.surgery.record import OTHER, Trace
from normswap.surgery.steps import Module, Param, Target


class NotRotatable(NormswapError):
    """The model cannot be rotated exactly; the message names the part."""


@dataclass
class Writer:
    """A stream writer: `target` a `Module`, or a `Param` (whose dim `axis` holds the channels);
    `centre`: its output is centred by an output fix, which the rotation moves into its weights; `norm`: a norm
    (its input is not rotated; an output fix multiplies its output by Q); `entry`: a block whose input fix
    centres an opaque value entering the stream (Whisper's encoder: it multiplies it by Q too)."""
    target: Target
    centre: bool = False
    norm: bool = False
    entry: bool = False


@dataclass
class Stream:
    width: int
    norms: list[str] = field(default_factory=list)
    writers: list[Writer] = field(default_factory=list)
    readers: dict[str, str] = field(default_factory=dict)   # linear layer -> the norm it reads
    biased: list[str] = field(default_factory=list)   # norms whose bias the conversion kept after them
    kept: dict[str, str] = field(default_factory=dict)   # norm -> who reads its output, which stays unrotated


@dataclass
class Streams:
    streams: list[Stream]
    not_preserved: dict[str, str] = field(default_factory=dict)   # returned output -> why
    gains: dict[str, Gain] = field(default_factory=dict)   # every norm's (`check_norms`)
    inner: list[str] = field(default_factory=list)   # per-head norms inside a block, which no rotation reaches


@dataclass
class Gain:
    """A norm's gain: `value` (float64, on the CPU) = its parameter `param` + `offset` (Gemma's 1 + w: offset 1;
    `param` None: no gain, ones). How the rotation reads it and sets it to ones."""
    value: torch.Tensor
    param: str | None = None
    offset: float = 0.0

    @property
    def width(self) -> int:
        return int(self.value.shape[0])

    @torch.no_grad()
    def to_ones(self, norm: nn.Module) -> None:
        if self.param is not None:
            getattr(norm, self.param).fill_(1.0 - self.offset)


def _known(m: nn.Module, name: str) -> Gain:
    """normswap's RMSNorm and torch's, taken at their word: the gain is their weight."""
    w = getattr(m, "weight", None)
    if w is None:
        return Gain(torch.ones(_width(m, name), dtype=torch.float64))
    if w.dim() != 1:
        raise NotRotatable(f"{name} normalises over more than the last dim: only a stream of vectors is rotated")
    return Gain(w.detach().double().cpu(), "weight")


def _probed(m: nn.Module, name: str, said: bool) -> Gain | None:
    """Another library's module that computes an RMSNorm over the last dim (found by calling it: LlamaRMSNorm,
    Gemma's 1 + w...): its gain; None for a module that is not one (a layer the trace reads like any other).
    `said`: its class says RMSNorm, so one that is not exactly one is refused, naming it."""
    own = list(m.parameters(recurse=False))
    if next(m.children(), None) is not None or isinstance(m, (nn.Linear, nn.Embedding)) or \
            not own or any(p.dim() != 1 for p in own) or len({p.shape[0] for p in own}) != 1:
        if said:
            raise NotRotatable(f"{name} ({type(m).__name__}) is an RMSNorm whose gain is not one vector over the "
                               "last dim: it cannot be folded")
        return None
    try:
        found = probe_rms(m, int(own[0].shape[0]))
    except NotLayerNorm as e:
        if said:
            raise NotRotatable(f"{name} ({type(m).__name__}) is not an RMSNorm rotation can fold, "
                               f"x * rsqrt(mean(x²) + eps) * g: {e}") from None
        return None
    return Gain(found.gain, found.param, found.offset)


def check_norms(model: nn.Module) -> dict[str, Gain]:
    """The model's RMSNorms and their gains: normswap's, torch's, and any module another library defines that
    computes one (probed: `probe_rms`); NotRotatable naming the first norm that cannot be rotated."""
    norms = {}
    for name, m in model.named_modules():
        kind = norm_kind(m)
        if isinstance(m, PartialRMSNorm):
            raise NotRotatable(f"{name} is a pRMSNorm: its RMS over a few features does not commute with a "
                               "rotation of the stream (convert with --to rmsnorm)")
        # a class that only its name calls a LayerNorm (MT5LayerNorm) is one if it computes one: probed
        named = kind == "layernorm" and not isinstance(m, nn.LayerNorm)
        if kind == "layernorm" and (not named or (found := _probed(m, name, False)) is None):
            if section(model) is not None:   # converted already: this norm is one the conversion left
                raise NotRotatable(f"{name} ({type(m).__name__}) is a LayerNorm the conversion kept (its report says "
                                   "why it could not be converted exactly): a rotation needs every norm an RMSNorm")
            raise NotRotatable(f"{name} ({type(m).__name__}) is a LayerNorm: convert the model exactly to RMSNorm "
                               "first (`normswap convert --method exact`)")
        if named:
            norms[name] = found
        elif isinstance(m, (RMSNorm, nn.RMSNorm)):
            norms[name] = _known(m, name)
        elif (found := _probed(m, name, kind == "rmsnorm")) is not None:
            norms[name] = found
    if not norms:
        raise NotRotatable("the model has no RMSNorm: convert it exactly first (`normswap convert --method exact`)")
    return norms


def _sources(t: Trace, norm: str, width: int) -> set[Label]:
    calls = t.calls.get(norm)
    if not calls:
        raise NotRotatable(f"{norm} did not run on the sample inputs: pass inputs that run it")
    found: set[Label] = set()
    for call in calls:
        if call.opaque:
            raise NotRotatable(f"the input of {norm} is not a sum of layer outputs ({call.opaque})")
        for label, ranges in call.sources.items():
            if ranges != {(0, width)} or t.widths.get(label, width) != width:
                raise NotRotatable(f"{norm} normalises groups of channels of {label.ref} (a per-head norm): only a "
                                   "whole residual stream can be rotated")
            found.add(label)
    return found


def _kept(t: Trace, norm: str) -> str | None:
    """Who reads the norm's output other than a linear layer that could absorb the rotation (then its output
    stays unrotated); None where none does (a returned tuple's or sub-model's part is listed as not preserved)."""
    return next((str(u) for u in sorted(t.uses.get(Label("norm", norm), {})) if not u.nested), None)


def _readers(model: nn.Module, t: Trace, norm: str) -> list[str]:
    label = Label("norm", norm)
    if getattr(model.get_submodule(norm), "normswap_centre", False):
        raise NotRotatable(f"{norm} centres its output (a norm writing the stream): it does not commute with a "
                           "rotation")
    readers = list(t.readers.get(norm, []))
    for r in readers:
        if not is_linear(model.get_submodule(r)) or OTHER in t.reads.get(r, ()) or t.reads.get(r) != {label}:
            raise NotRotatable(f"{r} reads {norm}'s output together with something else: it cannot absorb the "
                               "rotation of one stream")
    return readers


def _writer(model: nn.Module, t: Trace, label: Label) -> Writer:
    """How a source of a stream is rotated; NotRotatable naming it where it cannot be."""
    users = [u for u in sorted(t.uses.get(label, {})) if not u.nested]
    if users and label.kind == "norm":
        raise NotRotatable(f"{label.name}'s output is written into the stream and also read by {users[0]}: it "
                           "cannot be both rotated (for the stream) and kept")
    if users:
        raise NotRotatable(f"{users[0]} reads the unnormalised stream (written by {label.ref}): only a stream read "
                           "through norms and linear layers can be rotated")
    if label.kind == "norm":
        if t.readers.get(label.name):
            raise NotRotatable(f"{t.readers[label.name][0]} reads {label.name}'s output, which is also written into "
                               "the stream: only a stream read through norms can be rotated")
        return Writer(Module(label.name), norm=True)
    if label.kind == "entry":
        if not getattr(model.get_submodule(label.name), "normswap_centre_input", False):
            raise NotRotatable(f"an opaque value enters the stream at {label.name} without an input fix: nothing "
                               "rotates it")
        return Writer(Module(label.name), entry=True)
    if label in t.scales:   # a per-channel scale (folded into its layer by the conversion): constant, or refused
        lam = scale_parameter(model, Param(label.name) if label.kind == "scale" else Module(label.name)).detach()
        inner = {lb for f in t.scales[label] for lb in f.labels}
        if len(inner) != 1 or not bool((lam == lam.flatten()[0]).all()):
            raise NotRotatable(f"{label.ref} scales the stream per channel: a rotation does not commute with it "
                               "(fold it first: convert exactly)")
        return _writer(model, t, next(iter(inner)))
    if label.kind == "param":
        return Writer(Param(label.name, -1 if label.axis is None else label.axis))
    module = model.get_submodule(label.name)
    if label.kind != "layer" or centrable(module) is not None:
        raise NotRotatable(f"{label.ref} ({type(module).__name__}) writes the stream and no weight edit rotates its "
                           "output")
    if getattr(module, "normswap_bias", None) is not None or getattr(module, "normswap_centre_input", False):
        raise NotRotatable(f"{label.name} has a bias kept after it (or a centred input): move it into weights first")
    centre = getattr(module, "normswap_centre", False)
    if centre and not isinstance(module, (nn.Embedding, nn.Linear)) and not is_linear(module):
        raise NotRotatable(f"{label.name} ({type(module).__name__}) is centred by an output fix that cannot be "
                           "moved into its weights")
    return Writer(Module(label.name), centre=bool(centre))


def find_streams(model: nn.Module, t: Trace, gains: dict[str, Gain]) -> Streams:
    """The model's streams (see the module docstring) from the trace `t` of the converted model; `gains`: its
    norms' (`check_norms`)."""
    widths = {n: g.width for n, g in gains.items()}
    inner = _inner(t, widths)
    norms = [n for n in gains if n not in inner]
    writing = {n for n in norms if t.fed_norms.get(Label("norm", n))}   # norms writing a stream: input unrotated
    for w in sorted(writing):
        fed = sorted(t.fed_norms[Label("norm", w)])[0]
        if widths[w] != widths[fed]:
            raise NotRotatable(f"{w} normalises groups of channels (a per-head norm, width {widths[w]}) of the stream "
                               f"{fed} reads (width {widths[fed]}): only a whole residual stream can be rotated")
    norms = [n for n in norms if n not in writing]
    parent = {n: n for n in norms}

    def root(n: str) -> str:
        while parent[n] != n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n
    sources = {n: _sources(t, n, widths[n]) for n in norms}
    kept = {n: who for n in norms if (who := _kept(t, n))}
    readers = {n: [] if n in kept else _readers(model, t, n) for n in norms}
    _check_writing(t, writing, sources)
    first: dict[str, str] = {}   # a source's or a reader's key -> the first norm seen with it
    for n in norms:
        for key in [f"s:{lb}" for lb in sources[n]] + [f"r:{r}" for r in readers[n]]:
            parent[root(n)] = root(first.setdefault(key, n))
    groups: dict[str, Stream] = {}
    for n in norms:
        s = groups.setdefault(root(n), Stream(widths[n]))
        if widths[n] != s.width:
            raise NotRotatable(f"{n} (width {widths[n]}) and {s.norms[0]} (width {s.width}) read one stream")
        s.norms.append(n)
        if n in kept:
            s.kept[n] = kept[n]
        elif getattr(model.get_submodule(n), "normswap_bias", None) is not None:
            s.biased.append(n)
        for r in readers[n]:
            held = s.readers.setdefault(r, n)
            if held != n and not torch.equal(gains[held].value, gains[n].value):
                raise NotRotatable(f"{r} reads both {held} and {n}, whose gains differ: one weight cannot absorb both")
    for s in groups.values():
        labels = sorted({lb for n in s.norms for lb in sources[n]})
        s.writers = [_writer(model, t, lb) for lb in labels]
    rotated = {n: [*sources[n], *([] if n in kept else [Label("norm", n)])] for n in norms}   # returned rotated
    not_kept = {u.name: "the residual stream, returned rotated (and centred)"
                for n in norms for lb in rotated[n] for u in t.uses.get(lb, {}) if u.nested}
    return Streams(list(groups.values()), dict(sorted(not_kept.items())), gains, inner)


def _inner(t: Trace, widths: dict[str, int]) -> list[str]:
    """The per-head norms inside blocks (Qwen3's q and k norms): each normalises groups of channels of a layer
    whose output no other norm reads, and writes no stream, so no rotation of a stream changes what it reads or
    writes. One whose groups are of a stream's writer, or that writes a stream, is left to be refused."""
    def grouped(n: str) -> bool:
        return any(ranges != {(0, widths[n])} or t.widths.get(label, widths[n]) != widths[n]
                   for call in t.calls.get(n, []) if not call.opaque for label, ranges in call.sources.items())
    heads = [n for n in widths if grouped(n) and not t.fed_norms.get(Label("norm", n))]   # not writing a stream
    whole = {label for n in widths if n not in heads for call in t.calls.get(n, []) for label in call.sources}
    return [n for n in heads if not any(label in whole or label.kind != "layer"
                                        for call in t.calls[n] for label in call.sources)]


def _check_writing(t: Trace, writing: set[str], sources: dict[str, set[Label]]) -> None:
    """A norm writing a stream reads an unrotated input and writes a rotated stream's: NotRotatable where its
    input is also part of a rotated stream, or its output is normalised again only by norms writing a stream."""
    read_by = {lb: n for n, labels in sorted(sources.items()) for lb in labels}   # a rotated source -> a norm
    for w in sorted(writing):
        if not set(t.fed_norms[Label("norm", w)]) - writing:
            raise NotRotatable(f"{w}'s output is normalised again by {sorted(t.fed_norms[Label('norm', w)])[0]}, "
                               "which writes a stream too: stacked norms are not rotated")
        shared = sorted({lb for call in t.calls.get(w, []) for lb in call.sources} & set(read_by))
        if shared:
            raise NotRotatable(f"{shared[0].ref} is read by {w}, which writes a stream from an unrotated input, and "
                               f"by {read_by[shared[0]]}, whose stream is rotated: it cannot be both")


def _width(norm: nn.Module, name: str) -> int:
    shape = getattr(norm, "normalized_shape", None)
    shape = (shape,) if isinstance(shape, int) else tuple(shape or ())
    if len(shape) != 1:
        raise NotRotatable(f"{name} normalises over more than the last dim: only a stream of vectors is rotated")
    return int(shape[0])
