"""Record a model's dataflow in one forward pass: what each norm reads, and who reads each layer's output.

Every tensor gets a provenance: the set of labels it is a *sum* of ("layer:<name>" for a leaf module's
output, "norm:<name>" for a norm's output, "param:<name>" for a parameter used directly) and whether it
is still such a sum ("pure") or went through another operation (then `opaque` names that operation).
Sums, differences, scaling by scalars or per-token factors, dropout, reshapes, permutes, expands,
indexing and concatenation along other dims keep a tensor pure: they keep each label's contribution
zero-mean along the hidden dim if it was. So does a clamp to near the dtype's largest value (an fp16
overflow guard): it is the identity on every value that has not overflowed already. Anything else makes it
opaque; the first opaque operation on a pure tensor is recorded as a *use* of its labels. A leaf module
reading a pure tensor is a use too, except a norm (it removes the mean) and a layer reading exactly one norm's
output (a *reader*).

A slice that drops the hidden dim (BART's `embed_positions(inputs_embeds[..., -1])`, "just for the
shape") is a use only once its values are read: a later call that takes it, inside a leaf module or not,
other than for its shape, dtype or device.

A TorchFunctionMode sees the torch calls made outside leaf modules; forward hooks label leaf outputs and
hide the calls made inside them. Cost: one forward on a small input; tensors are kept alive (so their
ids stay unique) only for that forward.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from normswap.models.introspect import is_conv1d
from normswap.parity import main_output

PASS = {"view", "reshape", "permute", "transpose", "contiguous", "to", "float", "half", "bfloat16", "double",
        "type", "type_as", "clone", "dropout", "expand", "expand_as", "flatten", "unflatten", "squeeze",
        "unsqueeze", "__getitem__", "detach", "view_as", "reshape_as", "movedim", "cat", "concat", "concatenate",
        "stack", "requires_grad_", "narrow", "select", "index_select", "split", "chunk", "unbind"}
SLICE = {"__getitem__", "narrow", "select", "index_select", "split", "chunk", "unbind"}   # not of the hidden dim
SUM = {"add", "__add__", "__radd__", "__iadd__", "add_", "sub", "__sub__", "__rsub__", "__isub__", "sub_"}
SCALE = {"mul", "__mul__", "__rmul__", "__imul__", "mul_", "div", "__truediv__", "__itruediv__", "div_"}
HIDDEN_SLICE = "slice of the hidden dim"
CLAMP = {"clamp", "clip", "clamp_", "clip_"}
# Calls that only look at a tensor's shape, dtype or device: neither a use nor a new value.
IGNORE = {"zeros_like", "ones_like", "empty_like", "full_like", "new_zeros", "new_ones", "new_empty",
          "new_full", "new_tensor", "size", "dim", "numel", "is_floating_point", "__len__", "get_device"}


@dataclass
class Trace:
    """What one forward showed. Labels are "layer:<name>", "norm:<name>", "param:<name>", "entry:<name>"."""

    norm_inputs: dict[str, tuple[frozenset, str | None]] = field(default_factory=dict)  # norm -> input
    readers: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))   # norm -> layers
    uses: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))        # label -> users
    fed_norms: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))   # label -> norms
    scales: dict[str, tuple[frozenset, str | None]] = field(default_factory=dict)       # LayerScale -> input


def tensors_in(obj) -> list[torch.Tensor]:
    """The tensors in obj, a tensor or a (nested) list, tuple or dict of them."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in tensors_in(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in tensors_in(o)]
    return []


class _Recorder(TorchFunctionMode):
    def __init__(self, model: nn.Module, norms: set[str]):
        super().__init__()
        self.trace = Trace()
        self.info: dict[int, tuple[torch.Tensor, frozenset, str | None]] = {}
        self.params = {id(p): n for n, p in model.named_parameters()}
        self.norms = norms
        self.inside: str | None = None   # the leaf module running now: its inner calls are hidden
        self.pending: dict[int, tuple[torch.Tensor, frozenset, str]] = {}   # slices not read yet: id -> use

    def get(self, x: torch.Tensor):
        held = self.info.get(id(x))
        if held is not None and held[0] is x:
            return held[1], held[2]
        if id(x) in self.params:
            return frozenset({"param:" + self.params[id(x)]}), None
        return None

    def set(self, x: torch.Tensor, labels: frozenset, opaque: str | None) -> None:
        self.info[id(x)] = (x, labels, opaque)

    def use(self, labels, user: str) -> None:
        for label in labels:
            self.trace.uses[label].add(user)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", str(func))
        if self.pending and name not in IGNORE and (name != "__get__" or tensors_in(out)):  # values read
            for x in tensors_in((args, kwargs)):
                self.read(x)
        if self.inside is None and name not in IGNORE:
            self.record(name, args, kwargs, out)
        return out

    def read(self, x: torch.Tensor) -> None:
        """x's values are read: a pending slice becomes a use."""
        held = self.pending.get(id(x))
        if held is not None and held[0] is x:
            del self.pending[id(x)]
            self.use(held[1], held[2])

    def record(self, name: str, args, kwargs, out) -> None:
        outs = tensors_in(out)
        ins = [(x, self.get(x)) for x in tensors_in((args, kwargs))]
        tracked = [(x, i) for x, i in ins if i is not None]
        if not outs or not tracked:
            return
        labels = frozenset().union(*(i[0] for _, i in tracked))
        opaque = next((i[1] for _, i in tracked if i[1]), None)
        if opaque is None:
            opaque = _why_not_pure(name, args, kwargs, ins, outs)
            if opaque is not None and opaque.startswith(HIDDEN_SLICE):   # a use once read (see above)
                self.pending.update((id(o), (o, labels, f"operation '{name}'")) for o in outs)
            elif opaque is not None:
                self.use(labels, f"operation '{name}'")
        else:
            self.use(frozenset().union(*(i[0] for _, i in tracked if not i[1])), f"operation '{name}'")
        for o in outs:
            self.set(o, labels, opaque)

    def entry(self, name: str, args, kwargs) -> None:
        """An opaque tensor entering a block (Whisper's encoder stream after a GELU) starts a new sum there:
        "entry:<block>", centred by a pre-hook on the block if a norm reads it."""
        x = next(iter(tensors_in((args, kwargs))), None)
        info = None if x is None else self.get(x)
        if self.inside is None and info is not None and info[1] and x.dim() > 1:
            self.set(x, frozenset({"entry:" + name}), None)

    # Leaf-module hooks.
    def pre(self, name: str, module: nn.Module, args, kwargs) -> None:
        x = next(iter(tensors_in((args, kwargs))), None)
        info = None if x is None else self.get(x)
        if name in self.norms:
            if info is not None:
                self.trace.norm_inputs[name] = info
                if not info[1]:
                    for label in info[0]:
                        self.trace.fed_norms[label].add(name)
        elif info is not None and _is_scale(module, x):   # foldable into the layer before: not a use
            self.trace.scales[name] = info
        elif info is not None and not info[1]:
            norm = next(iter(info[0]))[5:] if len(info[0]) == 1 and next(iter(info[0])).startswith("norm:") else None
            if norm is not None and x.shape[-1] == _in_width(module):
                self.trace.readers[norm].append(name)
            else:
                self.use(info[0], f"{name} ({type(module).__name__})")
        self.inside = name

    def post(self, name: str, module: nn.Module, out) -> None:
        self.inside = None
        first = next(iter(tensors_in(out)), None)
        if first is not None:
            self.set(first, frozenset({("norm:" if name in self.norms else "layer:") + name}), None)


def _is_scale(module: nn.Module, x: torch.Tensor) -> bool:
    """A per-channel scale (LayerScale): one 1-D parameter as wide as its input, nothing else."""
    params = list(module.parameters(recurse=False))
    return (len(params) == 1 and params[0].dim() == 1 and params[0].shape[0] == x.shape[-1]
            and not isinstance(module, (nn.Linear, nn.Embedding)))


def _in_width(module: nn.Module) -> int:
    w = getattr(module, "weight", None)
    if isinstance(module, nn.Linear):
        return module.in_features
    if is_conv1d(module):
        return w.shape[0]
    return -1


def _last(x: torch.Tensor) -> int:
    return x.shape[-1] if x.dim() else 1


def _why_not_pure(name, args, kwargs, ins, outs) -> str | None:
    """None if `name` keeps a sum of zero-mean terms zero-mean along the hidden dim, else why not."""
    if name in PASS:
        if name in ("cat", "concat", "concatenate", "stack"):
            dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
            parts = tensors_in(args[0])
            if any(i is None for x, i in ins if any(x is p for p in parts)):
                return f"{name} with an untracked tensor"
            if name != "stack" and dim in (-1, parts[0].dim() - 1):
                return f"{name} along the hidden dim"
        elif name in SLICE and any(_last(o) != _last(ins[0][0]) for o in outs):
            return f"{HIDDEN_SLICE} ({name})"
        return None
    if name in CLAMP and _overflow_guard(args, kwargs):
        return None
    if name in SUM:
        if any(i is None for _, i in ins) or any(isinstance(a, (int, float)) and a for a in args):
            return f"{name} of an untracked value"
        return None
    if name in SCALE:
        tracked = [x for x, i in ins if i is not None]
        other = [x for x, i in ins if i is None]
        if len(tracked) == 1 and all(o.numel() == 1 or _last(o) == 1 for o in other) and \
                (name.startswith(("mul", "__mul", "__rmul", "__imul")) or tracked[0] is args[0]):
            return None
        return f"{name} by a per-channel or traced tensor"
    return name


def _overflow_guard(args, kwargs) -> bool:
    """clamp(x, -m, m) with m near the dtype's largest value (BART-family encoders in fp16): the identity on
    every value that is not already an overflow, so not an operation on the stream's values."""
    x = args[0] if args and isinstance(args[0], torch.Tensor) else None
    lo = kwargs.get("min", args[1] if len(args) > 1 else None)
    hi = kwargs.get("max", args[2] if len(args) > 2 else None)
    if x is None or not x.is_floating_point() or (lo is None and hi is None):
        return False
    big = torch.finfo(x.dtype).max / 2
    return all(b is None or isinstance(b, (int, float)) and abs(b) >= big for b in (lo, hi)) and \
        (lo is None or lo < 0) and (hi is None or hi > 0)


@torch.no_grad()
def trace(model: nn.Module, inputs: dict, norms: set[str]) -> Trace:
    """Run `model(**inputs)` once in eval mode and record its dataflow; `norms` are the norm modules."""
    rec = _Recorder(model, norms)
    handles = []
    for name, module in model.named_modules():
        leaf = not any(True for _ in module.children())
        if not leaf and name:
            handles.append(module.register_forward_pre_hook(
                lambda m, a, k, n=name: rec.entry(n, a, k), with_kwargs=True))
        elif leaf and (name in norms or any(True for _ in module.parameters(recurse=False))):
            handles.append(module.register_forward_pre_hook(
                lambda m, a, k, n=name: rec.pre(n, m, a, k), with_kwargs=True))
            handles.append(module.register_forward_hook(lambda m, a, o, n=name: rec.post(n, m, o)))
    training = model.training
    try:
        model.eval()
        with rec:
            out = model(**inputs)
        main = main_output(out)[1]
        rec.read(main)
        info = rec.get(main)
        if info is not None and not info[1]:
            rec.use(info[0], "the model output")
    finally:
        model.train(training)
        for h in handles:
            h.remove()
        rec.info.clear()
        rec.pending.clear()
    return rec.trace
