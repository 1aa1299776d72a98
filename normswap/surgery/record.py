"""The recorder behind `trace`: a TorchFunctionMode plus hooks on known leaves that give every followed
tensor a `flow.Flow` and record, per norm call, its input; per leaf, what it read; per label, who used it
(see `trace` for the whole story, `rules` for the operations and `labels` for labels and users)."""
from __future__ import annotations


import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from normswap.folder.fixes import first_input
from normswap.models.introspect import floating_buffers, in_width, is_scale, norm_kind
from normswap.parity import main_output, tensors, tensors_in
from normswap.surgery import rules
from normswap.surgery.algebra import rows_centred
from normswap.surgery.flow import OTHER, ZERO, Flow, Trace, channel_dim, channels_read, norm_call, opaque
from normswap.surgery.labels import Label, User
from normswap.surgery.rules import IGNORE
from normswap.surgery.tensormap import TensorMap

MHA = "multi_head_attention_forward"




class Recorder(TorchFunctionMode):
    def __init__(self, model: nn.Module, norms: set[str], rotating: bool = False):
        super().__init__()
        self.trace = Trace()
        self.flows = TensorMap()   # tensor -> Flow
        # persistent buffers (saved with the weights) are followed as parameters are, and centred the same way;
        # a non-persistent one is rebuilt by the model's code, so no edit of it lasts: it stays unfollowed
        buffers = floating_buffers(model)
        kept = {n: model.get_buffer(n) for n, persistent in buffers.items() if persistent}
        self.by_name = {**dict(model.named_parameters()), **kept}
        self.labels = {id(p): Label("param", n) for n, p in self.by_name.items()}
        self.params = {**{id(model.get_buffer(n)): n for n in buffers}, **{i: lb.name for i, lb in self.labels.items()}}
        self.rebuilt = {i: n for i, n in self.params.items() if i not in self.labels}   # non-persistent buffers
        self.owner = {id(p): n.rpartition(".")[0] for n, p in model.named_parameters()}
        self.norms, self.model, self.rotating = norms, model, rotating   # rotating: every RMSNorm reads as a norm
        self.given: set[int] = set()     # ids of the floating tensors the model itself was called with
        self.inside: str | None = None   # the hooked leaf running now: its inner calls are hidden
        self.stack: list[str] = []       # the modules being run, for messages
        self.pending = TensorMap()       # slice -> (Flow, User): slices not read yet
        self.deferred: list[tuple[User, frozenset, list, dict]] = []      # uses of rearranged tensors
        self.scaled: dict[str, tuple] = {}   # a scale module running now -> (input, flow, channel dim, input * g)

    def get(self, x: torch.Tensor) -> Flow | None:
        """x's flow; None for a tensor not followed (integer and bool tensors are indices and masks)."""
        if not x.is_floating_point():
            return None
        held = self.flows.get(x)
        return held if held is not None else Flow(frozenset({self.labels[id(x)]})) if id(x) in self.labels else None

    def set(self, x: torch.Tensor, flow: Flow) -> None:
        self.flows.set(x, flow, strong=id(x) in self.params)

    def here(self) -> str:
        """The module running now ("" outside any)."""
        return self.stack[-1] if self.stack else ""

    def where(self) -> str:
        return f" in {self.here()}" if self.here() else ""

    def use(self, x: torch.Tensor | None, flow: Flow, user: User) -> None:
        """`user` reads the values of x (flow `flow`): record which labels, all channels; for a rearranged
        tensor (q/k/v slices...) which channels is worked out at the end, for sources only (`finish`)."""
        if not flow.pure:   # an opaque sum: the labels whose shift it carries are read now (`rules.carried`)
            for label in flow.carried:
                self.trace.uses[label][user] = None
                self.trace.poison.setdefault(user, flow.opaque)
            return
        if flow.zero:
            return
        if flow.codes is not None:   # the channels each part gave, now: its per-element codes are not held
            self.deferred.append((user, flow.labels, flow.parts, channels_read(flow)))
        for label in flow.labels:
            self.trace.uses[label].setdefault(user, None if flow.codes is None else frozenset())
            if flow.codes is None:
                self.trace.uses[label][user] = None

    def finish(self) -> None:
        """The channels read by the deferred uses, for labels some norm reads (the rest: present, all)."""
        sources = {label for calls in self.trace.calls.values() for call in calls for label in call.sources}
        for user, all_labels, parts, seen in self.deferred:
            for p, (labels, _) in enumerate(parts):
                for label in labels & sources:
                    held = self.trace.uses[label].get(user)
                    self.trace.uses[label][user] = None if held is None else held | seen.get(p, frozenset())
            for label in all_labels - sources:
                self.trace.uses[label][user] = None
        self.deferred.clear()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))   # the model's own operation: a failure here is the model's
        self.observe(func, args, kwargs or {}, out)
        return out

    def observe(self, func, args, kwargs, out) -> None:
        """What `func` did to the flows of the tensors it read and wrote."""
        name = getattr(func, "__name__", str(func))
        if name == "__get__" and tensors_in(out):   # a property giving a tensor: .data, .T, .mT...
            name = "__get__." + getattr(getattr(func, "__self__", None), "__name__", "")
        ins = tensors_in((args, kwargs))
        values = name not in IGNORE and (name != "__get__" or bool(tensors_in(out)))   # not .shape, .is_meta
        for x in ins if values else ():
            if id(x) in self.params:
                self.trace.ran.add(self.params[id(x)])
            if self.pending:   # values read
                self.read(x)
        if self.inside is None and name not in IGNORE:
            self.record(func, name, args, kwargs, out, ins)

    def read(self, x: torch.Tensor) -> None:
        """x's values are read: a pending slice becomes a use."""
        held = self.pending.pop(x)
        if held is not None:
            self.use(x, *held)

    def record(self, func, name: str, args, kwargs, out, ins: list[torch.Tensor]) -> None:
        outs = tensors_in(out)
        if name in rules.ZEROS and outs:
            self.set(outs[0], ZERO)
            return
        tracked = [(x, f) for x in ins if (f := self.get(x)) is not None]
        inplace = name == "__setitem__" or name.endswith("_") and not name.endswith("__")
        if inplace and ins and ins[0] is args[0]:
            outs = [args[0]]
        if name == MHA and outs:   # nn.MultiheadAttention: its output is its out_proj's
            self._mha(args, kwargs, tracked, outs)
            return
        if name == "layer_norm" and outs and self._layer_norm(args, kwargs, outs[0]):
            return
        if not outs or not tracked:
            return
        flows = self.rule(func, name, args, kwargs, tracked, outs, ins)
        if isinstance(flows, (str, Flow)):   # opaque: the pure inputs are used here
            user = User("operation", name, where=self.here())
            carried = None if self.rotating else rules.carried(name, flows, tracked, outs)
            if isinstance(flows, Flow) and carried is None:   # mixed with an opaque value: that value is the cause
                self.trace.poison[user] = flows.opaque
            elif isinstance(flows, str) and (name in rules.SUM or name in rules.MOVE):   # the stream passes here
                self.trace.passes.setdefault(user, flows + self.where())
            for x, f in tracked if carried is None else ():
                self.use(x, f, user)
            labels = frozenset().union(*(f.labels for _, f in tracked))
            why = flows + self.where() if isinstance(flows, str) else flows.opaque   # an opaque input's cause
            flows = [opaque(labels, why, carried or frozenset())] * len(outs)
        for o, f in zip(outs, flows):   # no flows: the output is not followed
            if o.is_floating_point():
                self.set(o, f)

    def rule(self, func, name, args, kwargs, tracked, outs, ins) -> list[Flow] | str | Flow:
        """The flows of `outs`; or why this operation makes them opaque; or the opaque input whose cause they
        inherit. Opaque inputs act as weights in products and pools (a per-token routing weight), and poison
        sums and moves."""
        pure = [(x, f) for x, f in tracked if f.pure]
        dark = next((f for _, f in tracked if not f.pure), None)   # poisons sums and moves, weights products
        if not pure:
            return dark
        others = [a for a in (*args, *kwargs.values()) if not isinstance(a, torch.Tensor) or
                  (f := self.get(a)) is None or not f.pure]
        untracked = [x for x in ins if self.get(x) is None]
        target = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if (name == "__setitem__" or name.endswith("_") and not name.endswith("__")) and \
                (target is None or all(x is not target for x, _ in pure)):
            return f"in-place {name} into a value the trace does not follow"
        if name in rules.IDENTITY or name in rules.CLAMP and rules.overflow_guard(args, kwargs):
            first = self.get(target) if target is not None else None   # type_as(y), to(y): y gives a dtype
            return [] if first is None else first if not first.pure else [first] * len(outs)
        if name in rules.MOVE:
            if dark or (dark := self.rebuilt_in(untracked)):
                return dark
            if untracked and name not in rules.INDEXED:
                return f"{name} with a value the trace does not follow"
            return rules.rearranged(func, name, args, kwargs, pure, outs)
        if name in rules.SUM:
            if dark or (dark := self.rebuilt_in(untracked)):
                return dark
            if untracked or any(isinstance(a, (int, float)) and a and a is not kwargs.get("alpha")
                                        for a in args[1:]):
                return f"{name} of a value the trace does not follow"
            flow = rules.combined(pure, outs[0])
        elif name in rules.SCALE:
            flow = self._scale(name, args, pure, others, outs[0])
        elif name in rules.PRODUCTS and (flow := self._weights(name, args, kwargs)) is not None:
            pass
        elif name in rules.ACCUMULATE and dark:
            return dark
        elif name in rules.REDUCE or name in rules.POOL or name in rules.RESAMPLE or name in rules.MATMUL \
                or name in rules.ACCUMULATE or name == "einsum":
            flow = rules.mixed(name, args, kwargs, pure, others, outs[0])
        else:
            return name
        return flow if isinstance(flow, str) else [flow] * len(outs)

    def rebuilt_in(self, values: list[torch.Tensor]) -> Flow | None:
        """An opaque value naming the first non-persistent buffer among `values` (unfollowed tensors summed or
        moved with the stream), a refusal's cause; None if none."""
        name = next((self.rebuilt[id(x)] for x in values if id(x) in self.rebuilt), None)
        return name and opaque(frozenset(), f"the buffer {name} (not persistent: the model rebuilds it)")

    def _scale(self, name, args, pure, others, out) -> Flow | str:
        if len(pure) == 2:   # stream * per-channel parameter: a scale, folded like LayerScale
            for (_, f), (p, g) in (pure, pure[::-1]):
                if name.startswith(("mul", "__mul", "__rmul", "__imul")) and \
                        rules.channel_scale(p, g, out, f.hd if f.codes is None else None) and \
                        all(label.kind == "layer" for label in f.labels):
                    label = next(iter(g.labels)).of("scale")
                    self.trace.scales[label].append(f)
                    return Flow(frozenset({label}), hd=f.hd, plain=False)
        return rules.scaled(name, args, pure, others, out)

    def _weights(self, name: str, args, kwargs) -> Flow | None:
        """A product of computed values and a parameter (F.linear, matmul, bmm, grouped_mm: experts' stacked
        weights, by hand): the output's channels are one dim of the parameter, which is centred along it
        (a "param" label with that axis, none for the last dim). None: not such a product."""
        a = args[0] if args else kwargs.get("input")
        b = args[1] if len(args) > 1 else kwargs.get("weight", kwargs.get("mat2", kwargs.get("other")))
        if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
            return None
        af, bf = self.get(a), self.get(b)
        if name == "linear":   # x W^T: channels are W's rows
            w, j, x = b, -2, af
        elif bf is not None and bf.pure and not (af is not None and af.pure):
            w, j, x = b, -1, af
        else:   # W x: channels are W's rows, at the output's dim -2
            w, j, x = a, -2, bf
        label = self._param_dim(w, self.get(w), j)
        if label is None or x is not None and x.pure:
            return None
        flow = Flow(frozenset({label}), hd=-1 if name == "linear" or w is b else -2, plain=False)
        bias = kwargs.get("bias", args[2] if name == "linear" and len(args) > 2 else None)
        if bias is not None:
            bflow = self.get(bias)
            if bflow is None or not bflow.pure or bflow.codes is not None or bflow.hd != -1:
                return None
            flow = Flow(flow.labels | bflow.labels, hd=-1, plain=False)
        return flow

    def _param_dim(self, w: torch.Tensor, flow: Flow | None, j: int) -> Label | None:
        """The label of the parameter whose dim shows as w's dim j (a view: by strides; a copy indexed on
        leading dims: its trailing dims)."""
        if flow is None or not flow.pure or flow.codes is not None or len(flow.labels) != 1 or w.dim() < 2:
            return None
        label = next(iter(flow.labels))
        p = self.by_name.get(label.name) if label.kind == "param" else None
        if p is None or p.dim() < 2:
            return None
        j %= w.dim()
        if w.untyped_storage().data_ptr() == p.untyped_storage().data_ptr():
            dims = [k for k in range(p.dim()) if p.stride(k) == w.stride(j) and p.shape[k] == w.shape[j]]
            if len(dims) != 1:
                return None
            k = dims[0] - p.dim()
        elif flow.hd == -1 and tuple(w.shape[-2:]) == tuple(p.shape[-2:]) and j >= w.dim() - 2:
            k = j - w.dim()
        else:
            return None
        return label if k == -1 else Label("param", label.name, k)

    def _layer_norm(self, args, kwargs, out: torch.Tensor) -> bool:
        """F.layer_norm of whole rows (`rules.whole_rows`) ignores their writers' centring: a tolerant read, not a
        use (`plan` centres such rows whole); its output a new opaque value. False: an ordinary operation."""
        x = args[0] if args else kwargs.get("input")
        flow = self.get(x) if isinstance(x, torch.Tensor) else None
        if self.rotating or not rules.whole_rows(args, kwargs, x, flow):   # a rotation changes what it gives
            return False
        for label in flow.labels:
            self.trace.tolerant[label].add(x.shape[-1])
        self.set(out, opaque(frozenset(), "layer_norm" + self.where()))
        return True

    def _mha(self, args, kwargs, tracked, outs) -> None:
        """F.multi_head_attention_forward: its output is its out_proj's (a Linear); query, key, value are used."""
        for x, f in tracked:
            self.use(x, f, User("attention", where=self.here()))
        weight = kwargs.get("out_proj_weight", args[11] if len(args) > 11 else None)
        if id(weight) in self.owner:
            layer = Label("layer", self.owner[id(weight)])
            self.set(outs[0], Flow(frozenset({layer}), hd=-1))
            self.trace.widths[layer] = outs[0].shape[-1]
        for o in outs[1:]:
            self.set(o, opaque(frozenset(), "attention weights"))

    def entry(self, name: str, args, kwargs) -> None:
        """An opaque tensor entering a block (Whisper's encoder stream after a GELU) starts a new sum there:
        an "entry" label, centred by an input fix on the block if a norm reads it. So does a floating tensor the
        model itself was called with, entering a block unchanged (the stream nn.TransformerEncoder is given)."""
        self.stack.append(name)
        if not name:   # the model's own floating inputs: a stream the caller passes in (nn.TransformerEncoder's src)
            self.given = {id(t) for t in tensors_in((args, kwargs)) if t.is_floating_point()}
        key = first_input(self.model.get_submodule(name), args, kwargs)
        x = args[0] if key == 0 else kwargs.get(key)
        flow = self.get(x) if isinstance(x, torch.Tensor) else None
        given = flow is None and isinstance(x, torch.Tensor) and id(x) in self.given
        if self.inside is None and (given or flow is not None and flow.opaque) and x.dim() > 1:
            if flow is not None:   # the block reads what the opaque sum carries
                self.use(x, flow, User("module", name, type(self.model.get_submodule(name)).__name__))
            self.set(x, Flow(frozenset({Label("entry", name)})))
            self.trace.widths[Label("entry", name)] = x.shape[-1]

    def leave(self) -> None:
        if self.stack:
            self.stack.pop()

    # Hooks of the known leaves.
    def pre(self, name: str, module: nn.Module, args, kwargs) -> None:
        self.trace.called.add(name)
        self.trace.ran.update(f"{name}.{p}" if name else p for p, _ in module.named_parameters(recurse=False))
        x = next(iter(tensors_in((args, kwargs))), None)
        flow = None if x is None else self.get(x)
        # an RMSNorm reading rows that are not centred reads them like any layer (centring changes its output);
        # one reading centred rows (converted by an earlier exact pass) is a norm the stream feeds
        reader = False
        if name in self.norms and x is not None and norm_kind(module) == "rmsnorm" and not self.rotating:
            self.inside = name   # rows_centred's own ops are not the model's
            reader = not rows_centred(x, next(module.parameters(), x).dtype)
            self.inside = None
        if name in self.norms and not reader:
            if flow is not None and flow.carried and norm_kind(module) == "rmsnorm":   # not blind to a shift
                self.use(x, flow, User("module", name, type(module).__name__))
            self._norm_input(name, x, flow)
        elif name not in self.norms and x is not None and is_scale(module):
            # along the channels wherever they are (timm's LayerScale2d scales (B, C, H, W) along C); whether it
            # is one is seen in `post`, from what it gave: x * g here, before an in-place scale changes x
            gain = next(module.parameters())
            hd = channel_dim(x, gain.shape[0], flow)
            self.inside = name   # the reference's own op is not the model's
            ref = x * gain.view([-1] + [1] * (-hd - 1)) if x.shape[hd] == gain.shape[0] else None
            self.scaled[name] = (x, flow, hd, ref)
        else:
            self._leaf_reads(name, module, x, flow)
        self.inside = name

    def _leaf_reads(self, name: str, module: nn.Module, x, flow: Flow | None) -> None:
        single = flow is not None and flow.pure and flow.codes is None and len(flow.labels) == 1
        norm = next(iter(flow.labels)) if single else None
        if norm is not None and norm.kind == "norm" and flow.plain and flow.hd == -1 and \
                x.shape[-1] == in_width(module):
            if name not in self.trace.readers[norm.name]:
                self.trace.readers[norm.name].append(name)
            self.trace.reads[name].add(norm)
            return
        self.trace.reads[name].add(OTHER)
        user = User("module", name, type(module).__name__)
        if flow is not None and flow.pure and flow.codes is not None:
            self.pending.set(x, (flow, user), strong=True)   # held until read or the forward ends
        elif flow is not None:
            self.use(x, flow, user)

    def _norm_input(self, name: str, x, flow: Flow | None) -> None:
        call = norm_call(x, flow, self.trace.widths)
        for label in [*call.sources, *(flow.carried if flow is not None else ())]:
            self.trace.fed_norms[label].add(name)
        self.trace.calls[name].append(call)

    def _scale_leaf(self, name: str, module: nn.Module, first: torch.Tensor | None) -> int:
        """A module with one 1-D parameter gave `first`: if that is its input times the parameter along the
        channels (LayerScale), a scale (foldable into the layer before when that wrote the input unmixed: not a
        use); else (an RMSNorm of any class name, `x * rsqrt(mean(x^2)) * g`) a layer reading its input, whose
        result centring changes. The dim of the output's channels."""
        x, flow, hd, ref = self.scaled.pop(name)
        if first is None or ref is None or first.shape != ref.shape or not torch.equal(first, ref.to(first.dtype)):
            self._leaf_reads(name, module, x, flow)
            return -1
        if flow is not None and flow.pure and not flow.zero and flow.codes is None and flow.hd == hd:
            self.trace.scales[Label("layer", name)].append(flow)
        else:
            self._leaf_reads(name, module, x, flow)
        return hd

    def post(self, name: str, module: nn.Module, out) -> None:
        self.inside = None
        first = next(iter(tensors_in(out)), None)
        scale = self._scale_leaf(name, module, first) if name in self.scaled else -1
        if first is not None and first.dim():
            conv = isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d))
            label = Label("norm" if name in self.norms else "layer", name)
            hd = 1 - first.dim() if conv else scale   # a scale: where its input's channels were
            self.set(first, Flow(frozenset({label}), hd=hd))
            self.trace.widths[label] = first.shape[hd]

    def outputs(self, out) -> None:
        """Every floating tensor returned is read by the model output, the main one or one by name (see `plan`:
        what it means for a norm's bias and for the centred stream)."""
        named = list(tensors(out))   # `encoder_last_hidden_state`, `hidden_states.2`... (caches left out)
        try:
            main = out if isinstance(out, torch.Tensor) else main_output(out)[1]
        except (KeyError, IndexError, TypeError):   # an output parity does not know: its first tensor
            main = named[0][1] if named else None
        for name, t in named:
            if not t.is_floating_point():
                continue
            self.read(t)
            flow = self.get(t)
            if flow is None or flow.zero:
                continue
            self.use(t, flow, User("output", "" if t is main else name))
