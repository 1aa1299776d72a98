"""Record a model's dataflow over forward passes on sample inputs: what each norm reads, who reads each
layer's output, which parameters ran.

Every followed tensor has a `rules.Flow`: the labels it is a linear combination of ("layer:<name>" for a
known layer's output, "norm:<name>" for a norm's output, "param:<name>" for a parameter used directly,
"scale:<param>" for a stream scaled by a per-channel parameter, "entry:<block>" for an opaque value
entering a block) and where their channels are; `rules` says which operations keep it pure. The first
opaque operation on a pure tensor is a *use* of its labels (with the channels it read). A known leaf
module reading a pure tensor is a use too, except a norm (it removes the mean), a per-channel scale
(LayerScale) and a linear layer reading exactly one norm's output, moved but unchanged (a *reader*).
A slice of the hidden dim that reaches a leaf is a use only once its values are read (BART's
`embed_positions(inputs_embeds[..., -1])` reads it for its shape).

Known leaves (Linear, GPT-2 Conv1D, Embedding, ConvNd, norms, LayerScale) are hooked and their inner
calls hidden; every other module is traced through, so parameters used by hand (a mixture of experts'
stacked weights, nn.MultiheadAttention's projections) are followed too. Every floating tensor the forward
returns is read by "the model output": a norm output returned keeps its bias after the norm; the returned
stream (not the main output) is listed as not preserved. Tracing every sample input and merging covers
norms called more than once and paths only some inputs take. Cost: one forward per input; tensors are
kept alive (so their ids stay unique) only for that forward.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from normswap.models.introspect import is_conv1d, is_linear
from normswap.parity import main_output
from normswap.surgery import rules
from normswap.surgery.rules import Flow

# Calls that only look at a tensor's shape, dtype or device: neither a use nor a new value.
IGNORE = {"empty_like", "ones_like", "full_like", "new_ones", "new_empty", "new_full", "new_tensor", "size",
          "dim", "numel", "is_floating_point", "__len__", "get_device", "is_complex", "element_size"}
MHA = "multi_head_attention_forward"
# Moves whose other tensor arguments are indices, masks or zeros, not values moved.
INDEXED = {"__getitem__", "index_select", "gather", "take_along_dim", "masked_fill", "masked_fill_", "where",
           "__setitem__", "index_put", "index_put_", "embedding", "repeat_interleave", "roll", "pad", "unfold",
           "expand_as", "view_as", "reshape_as"}


@dataclass
class NormInput:
    """One call of a norm: its input's sources with the channel ranges each norm row covers, or why not."""
    sources: dict[str, frozenset]           # label -> {(start, stop)} ranges of its channels
    opaque: str | None = None


@dataclass
class Trace:
    """What the forwards showed. Labels are "layer:", "norm:", "param:", "scale:", "entry:" + a name."""

    calls: dict[str, list[NormInput]] = field(default_factory=lambda: defaultdict(list))   # norm -> calls
    readers: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))       # norm -> layers
    reads: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))           # layer -> inputs
    uses: dict[str, dict] = field(default_factory=lambda: defaultdict(dict))   # label -> user -> channels
    fed_norms: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))       # label -> norms
    scales: dict[str, list[Flow]] = field(default_factory=lambda: defaultdict(list))       # scale -> inputs
    widths: dict[str, int] = field(default_factory=dict)                                   # label -> width
    ran: set[str] = field(default_factory=set)                                             # parameters
    called: set[str] = field(default_factory=set)                                          # hooked leaves
    not_kept: dict[str, str] = field(default_factory=dict)                                 # output -> why


def tensors_in(obj) -> list[torch.Tensor]:
    """The tensors in obj, a tensor or a (nested) list, tuple or dict of them."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in tensors_in(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in tensors_in(o)]
    return []


def named_outputs(obj, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """(dotted name, tensor) for every tensor a forward returned: `encoder_last_hidden_state`,
    `vision_model_output.last_hidden_state`, `hidden_states.2`... (caches are left out)."""
    if isinstance(obj, torch.Tensor):
        return [(prefix.rstrip("."), obj)]
    if isinstance(obj, dict):
        return [t for k, v in obj.items() for t in named_outputs(v, f"{prefix}{k}.")]
    if isinstance(obj, (list, tuple)):
        return [t for i, v in enumerate(obj) for t in named_outputs(v, f"{prefix}{i}.")]
    return []


def hooked(module: nn.Module, name: str, norms: set[str]) -> bool:
    """A leaf the trace treats as one labelled layer: norms, linear layers, embeddings, convolutions, and
    per-channel scales (LayerScale: one 1-D parameter). Other modules are traced through."""
    if next(module.children(), None) is not None:
        return False
    return name in norms or is_linear(module) or isinstance(module, (nn.Embedding, nn.Conv1d, nn.Conv2d,
                                                                    nn.Conv3d)) or _is_scale(module)


def _is_scale(module: nn.Module) -> bool:
    params = list(module.parameters(recurse=False))
    return len(params) == 1 and params[0].dim() == 1 and not isinstance(module, (nn.Linear, nn.Embedding))


def _in_width(module: nn.Module) -> int:
    if isinstance(module, nn.Linear):
        return module.in_features
    return module.weight.shape[0] if is_conv1d(module) else -1


class Recorder(TorchFunctionMode):
    def __init__(self, model: nn.Module, norms: set[str]):
        super().__init__()
        self.trace = Trace()
        self.flows: dict[int, tuple[torch.Tensor, Flow]] = {}
        self.params = {id(p): n for n, p in model.named_parameters()}
        self.owner = {id(p): n.rpartition(".")[0] for n, p in model.named_parameters()}
        self.norms = norms
        self.inside: str | None = None   # the hooked leaf running now: its inner calls are hidden
        self.stack: list[str] = []       # the modules being run, for messages
        self.pending: dict[int, tuple[torch.Tensor, Flow, str]] = {}   # slices not read yet

    def get(self, x: torch.Tensor) -> Flow | None:
        held = self.flows.get(id(x))
        if held is not None and held[0] is x:
            return held[1]
        if id(x) in self.params:
            return Flow(frozenset({"param:" + self.params[id(x)]}))
        return None

    def set(self, x: torch.Tensor, flow: Flow) -> None:
        self.flows[id(x)] = (x, flow)

    def where(self) -> str:
        return f" in {self.stack[-1]}" if self.stack and self.stack[-1] else ""

    def use(self, x: torch.Tensor | None, flow: Flow, user: str) -> None:
        """`user` reads the values of x (flow `flow`): record which channels of which labels."""
        if not flow.pure or flow.zero:
            return
        per_label: dict[str, object] = {label: None for label in flow.labels}
        if flow.codes is not None:
            part, _, chan = rules.decode(flow.codes, flow.parts)
            for p, (labels, _) in enumerate(flow.parts):
                seen = frozenset(chan[part == p].unique().tolist())
                for label in labels:
                    old = per_label.get(label)
                    per_label[label] = seen if old is None else old | seen
        for label, channels in per_label.items():
            held = self.trace.uses[label].get(user, frozenset())
            self.trace.uses[label][user] = None if channels is None or held is None else held | channels

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", str(func))
        ins = tensors_in((args, kwargs))
        for x in ins:
            if id(x) in self.params:
                self.trace.ran.add(self.params[id(x)])
        if self.pending and name not in IGNORE and (name != "__get__" or tensors_in(out)):  # values read
            for x in ins:
                self.read(x)
        if self.inside is None and name not in IGNORE:
            self.record(func, name, args, kwargs, out, ins)
        return out

    def read(self, x: torch.Tensor) -> None:
        """x's values are read: a pending slice becomes a use."""
        held = self.pending.get(id(x))
        if held is not None and held[0] is x:
            del self.pending[id(x)]
            self.use(x, held[1], held[2])

    def record(self, func, name: str, args, kwargs, out, ins: list[torch.Tensor]) -> None:
        outs = tensors_in(out)
        if name in rules.ZEROS and outs:
            self.set(outs[0], rules.ZERO)
            return
        tracked = [(x, f) for x in ins if (f := self.get(x)) is not None]
        inplace = name == "__setitem__" or name.endswith("_") and not name.endswith("__")
        if inplace and ins and ins[0] is args[0]:
            outs = [args[0]]
        if name == MHA and outs:   # nn.MultiheadAttention: its output is out_proj's (see `_mha_output`)
            self._mha(args, kwargs, tracked, outs)
            return
        if not outs or not tracked:
            return
        flows = self.rule(func, name, args, kwargs, tracked, outs, ins)
        if isinstance(flows, str):   # opaque: the pure inputs are used here
            for x, f in tracked:
                self.use(x, f, f"operation '{name}'{self.where()}")
            labels = frozenset().union(*(f.labels for _, f in tracked))
            why = next((f.opaque for _, f in tracked if f.opaque), flows + self.where())
            flows = [rules.opaque(labels, why)] * len(outs)
        for o, f in zip(outs, flows):   # no flows: the output is not followed
            self.set(o, f)

    def rule(self, func, name, args, kwargs, tracked, outs, ins) -> list[Flow] | str:
        """The flows of `outs`, or the name of the operation that makes them opaque. Opaque inputs act as
        weights in products and pools (a per-token routing weight), and poison everything else."""
        pure = [(x, f) for x, f in tracked if f.pure]
        if not pure:
            return name
        dark = len(pure) < len(tracked)
        others = [a for a in (*args, *kwargs.values()) if not isinstance(a, torch.Tensor) or
                  (f := self.get(a)) is None or not f.pure]
        untracked = [x for x in ins if self.get(x) is None]
        target = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if (name == "__setitem__" or name.endswith("_") and not name.endswith("__")) and \
                (target is None or all(x is not target for x, _ in pure)):
            return name   # an in-place edit of a value the trace does not follow
        if name in rules.IDENTITY or name in rules.CLAMP and rules.overflow_guard(args, kwargs):
            first = self.get(target) if target is not None else None   # type_as(y), to(y): y gives a dtype
            return [] if first is None else name if not first.pure else [first] * len(outs)
        if name in rules.MOVE:
            if dark or untracked and name not in INDEXED:
                return f"{name} with a value the trace does not follow"
            return rules.rearranged(func, name, args, kwargs, pure, outs)
        if name in rules.SUM:
            if dark or untracked or any(isinstance(a, (int, float)) and a and a is not kwargs.get("alpha")
                                        for a in args[1:]):
                return f"{name} of a value the trace does not follow"
            flow = rules.combined(pure, outs[0])
        elif name in rules.SCALE:
            flow = self._scale(name, args, pure, others, outs[0])
        elif name in rules.REDUCE or name in rules.POOL or name in rules.RESAMPLE or name in rules.MATMUL \
                or name in rules.ACCUMULATE or name == "einsum":
            flow = rules.mixed(name, args, kwargs, pure, others, outs[0])
        else:
            return name
        return flow if isinstance(flow, str) else [flow] * len(outs)

    def _scale(self, name, args, pure, others, out) -> Flow | str:
        if len(pure) == 2:   # stream * per-channel parameter: a scale, folded like LayerScale
            for (x, f), (p, g) in (pure, pure[::-1]):
                if name.startswith(("mul", "__mul", "__rmul", "__imul")) and \
                        rules.channel_scale(p, g, out, f.hd if f.codes is None else None) and \
                        all(label.startswith("layer:") for label in f.labels):
                    label = "scale:" + next(iter(g.labels))[6:]
                    self.trace.scales[label].append(f)
                    return Flow(frozenset({label}), hd=f.hd, plain=False)
        return rules.scaled(name, args, pure, others, out)

    def _mha(self, args, kwargs, tracked, outs) -> None:
        """F.multi_head_attention_forward: the attention output is its out_proj's output (a Linear); the
        query, key and value are read (used)."""
        for x, f in tracked:
            self.use(x, f, f"nn.MultiheadAttention{self.where()}")
        weight = kwargs.get("out_proj_weight", args[11] if len(args) > 11 else None)
        if id(weight) in self.params:
            layer = self.owner[id(weight)]
            self.set(outs[0], Flow(frozenset({"layer:" + layer}), hd=-1))
            self.trace.widths["layer:" + layer] = outs[0].shape[-1]
        for o in outs[1:]:
            self.set(o, rules.opaque(frozenset(), "attention weights"))

    def entry(self, name: str, args, kwargs) -> None:
        """An opaque tensor entering a block (Whisper's encoder stream after a GELU) starts a new sum there:
        "entry:<block>", centred by a pre-hook on the block if a norm reads it."""
        self.stack.append(name)
        x = next(iter(tensors_in((args, kwargs))), None)
        flow = None if x is None else self.get(x)
        if self.inside is None and flow is not None and flow.opaque and x.dim() > 1:
            self.set(x, Flow(frozenset({"entry:" + name})))
            self.trace.widths["entry:" + name] = x.shape[-1]

    def leave(self) -> None:
        if self.stack:
            self.stack.pop()

    # Hooks of the known leaves.
    def pre(self, name: str, module: nn.Module, args, kwargs) -> None:
        self.trace.called.add(name)
        self.trace.ran.update(f"{name}.{p}" if name else p for p, _ in module.named_parameters(recurse=False))
        x = next(iter(tensors_in((args, kwargs))), None)
        flow = None if x is None else self.get(x)
        if name in self.norms:
            self._norm_input(name, x, flow)
        elif flow is not None and flow.pure and not flow.zero and _is_scale(module) and flow.codes is None \
                and x.shape[-1] == next(module.parameters()).shape[0] and flow.hd == -1:
            self.trace.scales["layer:" + name].append(flow)   # foldable into the layer before: not a use
            self.inside = name
            return
        else:
            self._leaf_reads(name, module, x, flow)
        self.inside = name

    def _leaf_reads(self, name: str, module: nn.Module, x, flow: Flow | None) -> None:
        single = flow is not None and flow.pure and flow.codes is None and len(flow.labels) == 1
        norm = next(iter(flow.labels))[5:] if single and next(iter(flow.labels)).startswith("norm:") else None
        if norm is not None and flow.plain and flow.hd == -1 and x.shape[-1] == _in_width(module):
            if name not in self.trace.readers[norm]:
                self.trace.readers[norm].append(name)
            self.trace.reads[name].add("norm:" + norm)
            return
        self.trace.reads[name].add("other")
        if flow is not None and flow.pure and flow.codes is not None:
            self.pending[id(x)] = (x, flow, f"{name} ({type(module).__name__})")
        elif flow is not None:
            self.use(x, flow, f"{name} ({type(module).__name__})")

    def _norm_input(self, name: str, x, flow: Flow | None) -> None:
        if flow is None:
            call = NormInput({}, "a value the trace does not follow (not computed from the model's weights)")
        elif not flow.pure:
            call = NormInput({label: frozenset() for label in flow.labels}, flow.opaque)
        elif flow.zero:
            call = NormInput({})
        elif flow.codes is None and flow.hd != -1:
            call = NormInput({}, "normalisation over a dim other than the hidden one")
        elif flow.codes is None:
            w = x.shape[-1]
            call = NormInput({label: frozenset({(0, w)}) for label in flow.labels})
            for label in flow.labels:
                self.trace.widths.setdefault(label, w)
        else:
            call = _groups(flow)
            for labels, w in flow.parts:
                for label in labels:
                    self.trace.widths.setdefault(label, w)
        for label in call.sources:
            self.trace.fed_norms[label].add(name)
        self.trace.calls[name].append(call)

    def post(self, name: str, module: nn.Module, out) -> None:
        self.inside = None
        first = next(iter(tensors_in(out)), None)
        if first is not None and first.dim():
            conv = isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d))
            label = ("norm:" if name in self.norms else "layer:") + name
            self.set(first, Flow(frozenset({label}), hd=1 - first.dim() if conv else -1))
            self.trace.widths[label] = first.shape[1 if conv else -1]

    def outputs(self, out) -> None:
        """Every floating tensor returned is read by the model output (see the module docstring)."""
        main = main_output(out)[1]
        for name, t in named_outputs(out):
            if not t.is_floating_point():
                continue
            self.read(t)
            flow = self.get(t)
            if flow is None or not flow.pure or flow.zero:
                continue
            if t is main:
                self.use(t, flow, "the model output")
            elif all(label.startswith("norm:") for label in flow.labels):
                self.use(t, flow, f"the model output `{name}`")
            else:
                self.trace.not_kept[name] = "the residual stream, returned centred (its per-row mean removed)"


def _groups(flow: Flow) -> NormInput:
    """Per label, the channel ranges a norm's rows cover when its input is a rearrangement (`flow.codes`):
    each row must hold, per part, whole contiguous ranges of one source row."""
    codes = flow.codes.reshape(-1, flow.codes.shape[-1])
    part, row, chan = rules.decode(codes, flow.parts)
    n = codes.shape[-1]
    sources: dict[str, frozenset] = {}
    for p, (labels, _) in enumerate(flow.parts):
        sel = part == p
        k = sel.sum(-1)
        live = k > 0
        if not bool(live.any()):
            continue
        rows_lo = torch.where(sel, row, row.max() + 1).amin(-1)
        rows_hi = torch.where(sel, row, -1).amax(-1)
        ordered = torch.where(sel, chan, n + int(chan.max()) + 1).sort(-1).values
        start = ordered[:, :1]
        steps = torch.arange(n, device=codes.device)
        contiguous = ((ordered - start == steps) | (steps >= k[:, None])).all(-1)
        if not bool(((rows_lo == rows_hi) & contiguous | ~live).all()):
            return NormInput({label: frozenset() for label in labels},
                             "a rearrangement that mixes channels of different positions, or not in order")
        ranges = frozenset(zip(start[live, 0].tolist(), (start[live, 0] + k[live]).tolist()))
        for label in labels:
            sources[label] = sources.get(label, frozenset()) | ranges
    return NormInput(sources)


@torch.no_grad()
def trace(model: nn.Module, inputs: list[dict], norms: set[str]) -> Trace:
    """Run `model(**x)` for every x in `inputs`, in eval mode, and record the merged dataflow; `norms` are
    the norm modules. If some parameters never ran, one more forward in training mode (RNG state and
    buffers restored after it) shows the paths only training takes (SpecAugment's masked embedding), so
    that they are centred too rather than left unknown."""
    rec = Recorder(model, norms)
    handles = []
    for name, module in model.named_modules():
        if hooked(module, name, norms):
            handles.append(module.register_forward_pre_hook(
                lambda m, a, k, n=name: rec.pre(n, m, a, k), with_kwargs=True))
            handles.append(module.register_forward_hook(lambda m, a, o, n=name: rec.post(n, m, o)))
        elif next(module.children(), None) is not None:
            handles.append(module.register_forward_pre_hook(
                lambda m, a, k, n=name: rec.entry(n, a, k), with_kwargs=True))
            handles.append(module.register_forward_hook(lambda m, a, o: rec.leave()))
    training = model.training
    try:
        model.eval()
        for x in inputs:
            _forward(rec, model, x)
        if inputs and any(n not in rec.trace.ran for n, _ in model.named_parameters()):
            _training_forward(rec, model, inputs[0])
    finally:
        model.train(training)
        for h in handles:
            h.remove()
        rec.flows.clear()
        rec.pending.clear()
    return rec.trace


def _forward(rec: Recorder, model: nn.Module, x: dict) -> None:
    try:
        with rec:
            out = model(**x)
        rec.outputs(out)
    finally:
        rec.flows.clear()
        rec.pending.clear()
        rec.stack.clear()
        rec.inside = None


def _training_forward(rec: Recorder, model: nn.Module, x: dict) -> None:
    """One forward in training mode that leaves no trace on the model or the RNG; skipped if it fails."""
    buffers = [(b, b.clone()) for b in model.buffers()]
    cuda = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    try:
        with torch.random.fork_rng(devices=cuda):
            model.train()
            _forward(rec, model, x)
    except Exception:   # a model that needs more in training (labels...): coverage stays as eval saw it
        pass
    finally:
        model.eval()
        for b, saved in buffers:
            b.copy_(saved)
