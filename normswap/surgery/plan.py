"""The exact-conversion plan: plain data naming modules and parameters, derived from the traced forwards.

Per norm: its sources (what its input is a sum of, over every call), its readers (linear layers reading
its output) and what happens to its bias (a `labels.BiasPlan`): FOLD into the readers (a bias-less one given a
bias: an LM head's, vocabulary-wide, even when its weight is tied), AFTER (kept as a bias after the norm: a reader is
not linear or also reads something else, or the output is returned, as a headless model's final norm's), STREAM
(the norm's output is itself a stream writer, as BLOOM's embedding norm: its output is centred and its centred bias
kept after), NONE (no bias). `reason` (a `labels.Refusal`) says why a norm cannot be made exact (then the
plan is refused as a whole); `Plan.reasons` holds the model-wide ones (a parameter that never ran);
`not_kept` lists returned outputs that cannot be preserved (the residual stream). Sources are
`labels.Label`s; decisions read a refusal's cause, never its text.

The steps (`steps`: one small class per kind of edit) apply the plan one small independent edit at a time.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from normswap.models.introspect import floating_buffers, is_linear, norm_kind
from normswap.surgery.labels import BiasPlan, Cause, Label, Refusal, User
from normswap.surgery.reach import dead, never_runs, read_names, unreachable
from normswap.surgery.record import Trace
from normswap.surgery.steps import Centre, Fix, Fold, Module, Param, Scale, Step
from normswap.surgery.walk import NormSite


@dataclass
class NormPlan:
    name: str
    width: int
    sources: list[Label] = field(default_factory=list)
    readers: list[str] = field(default_factory=list)
    bias: BiasPlan = BiasPlan.NONE
    reason: Refusal | None = None   # why this norm cannot be made exact
    shifted: bool = False           # its input is no plain sum: centring its sources changes it, even as a LayerNorm


@dataclass
class Plan:
    norms: dict[str, NormPlan]
    steps: list[Step]
    reasons: list[Refusal] = field(default_factory=list)   # model-wide: untraced writers
    not_kept: dict[str, str] = field(default_factory=dict)   # returned output -> why it is not preserved
    uncalled: list[str] = field(default_factory=list)    # centred layers whose weights are used by hand

    @property
    def refusal(self) -> Refusal | None:
        """Why the plan is refused: a post-LN norm says the most, then the first norm refused, then a model-wide
        reason; None: the plan is exact."""
        reasons = [p.reason for p in self.norms.values() if p.reason]
        return next((r for r in reasons if r.cause is Cause.POST_LN), reasons[0] if reasons else
                    self.reasons[0] if self.reasons else None)

    @property
    def reason(self) -> str | None:
        """The refusal's text (see `refusal`)."""
        return None if self.refusal is None else str(self.refusal)


def centrable(layer: nn.Module) -> str | None:
    """Why a layer's outputs cannot be made zero-mean by editing its weights (None: they can)."""
    if isinstance(layer, (nn.Conv1d, nn.Conv2d, nn.Conv3d)) and layer.groups != 1:
        kind = "depthwise" if layer.groups == layer.in_channels else "grouped"
        return (f"a {kind} convolution (groups={layer.groups}): each output channel reads only its own "
                "group of input channels, so no weight edit centres its outputs")
    if is_linear(layer) or isinstance(layer, (nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        return None
    return "not a linear layer"


def tied(model: nn.Module, param: nn.Parameter) -> bool:
    return sum(p is param for _, p in model.named_parameters(remove_duplicate=False)) > 1


def _covered(ranges) -> set[int]:
    return {c for a, b in ranges for c in range(a, b)}


def _conflict(t: Trace, label: Label, ranges) -> User | None:
    """A reader other than a norm of the channels of `label` that are centred (nested outputs aside)."""
    centred = None
    for user, channels in sorted(t.uses.get(label, {}).items()):
        if user.nested:
            continue
        if channels is None or (centred := centred if centred is not None else _covered(ranges)) & channels:
            return user
    return None


def _mixed(t: Trace, user: User, what: str, modules: tuple) -> Refusal | None:
    """The refusal when `user` read the stream only because it mixed it with an opaque value, or summed or moved
    it so that the trace cannot follow its rows (a sum of values laid out otherwise: MLP-Mixer's token mixing)."""
    if (cause := t.poison.get(user)) is not None:
        return Refusal(Cause.MIXED, f"the stream that {what} is mixed ({user}) with a value that went through "
                       f"{cause}, which no weight edit centres", modules)
    if (why := t.passes.get(user)) is not None:
        return Refusal(Cause.MIXED, f"the stream that {what} goes through {user}: {why}, whose rows no weight edit "
                       "centres", modules)
    return None


def _stream(user: User, name: str) -> Refusal:
    by = name or "the model's own input"   # "": an "entry" of the whole model (the stream it is called with)
    return Refusal(Cause.STREAM, f"{user} is the unnormalised residual stream (written by {by}); only outputs read "
                   "through a final norm can be kept exact", (name,))


def _post_ln(t: Trace, name: str, fed: str, many: bool = True) -> Refusal | None:
    """Why the norm `name`, whose output is part of the input of the norm `fed`, cannot be exact; `many`: more
    than one norm is placed so (a post-LN model)."""
    label = Label("norm", name)
    users = [User("reader", r) for r in t.readers.get(name, [])] + \
        [u for u in sorted(t.uses.get(label, ())) if not u.nested]
    if not users:
        return None
    if fed == name:
        return Refusal(Cause.REAPPLIED, f"{name} is applied again to its own output (a norm of a norm's output, "
                       f"whose mean depends on the input), and its first output is also read by {users[0]}, so it "
                       "cannot be centred", (name,))
    if (why := _mixed(t, users[0], f"{name} writes", (name,))) is not None:
        return why
    if all(u.kind == "output" for u in users):
        return _stream(users[0], name)
    if many:
        return Refusal(Cause.POST_LN, f"{name} is post-LN: its output is added to the residual stream and also read "
                       f"by {users[0]}, so the stream carries a mean that depends on the input", (name,))
    return Refusal(Cause.READ, f"{name}'s output is added to the residual stream and also read directly by "
                   f"{users[0]} (no norm of its own in between), so the stream carries a mean that depends on the "
                   "input", (name,))


def _rms_norm(model: nn.Module, user: User) -> bool:
    """Whether `user` is an RMSNorm module."""
    try:
        return user.kind == "module" and norm_kind(model.get_submodule(user.name)) == "rmsnorm"
    except AttributeError:
        return False


def _source_reason(model: nn.Module, t: Trace, norm: str, label: Label, ranges, many: bool) -> Refusal | None:
    name, both = label.ref, (label.ref, norm)
    if label.kind == "norm":
        return _post_ln(t, label.name, norm, many)
    if (user := _conflict(t, label, ranges)) is not None:
        if (why := _mixed(t, user, f"{name} writes into the input of {norm}", both)) is not None:
            return why
        if user.kind == "output":
            return _stream(user, name)
        if _rms_norm(model, user):
            return Refusal(Cause.READ, f"{name} writes the input of {norm} but its output is also read by {user}, "
                           "an RMSNorm, which is not invariant to the mean that centring removes", both)
        return Refusal(Cause.READ, f"{name} writes the input of {norm} but its output is also read unnormalised "
                       f"by {user}", both)
    if label in t.scales:   # folded into the one layer it scales, which is then centred
        inner = {lb for f in t.scales[label] for lb in f.labels}
        one = next(iter(inner)) if len(inner) == 1 and all(len(f.labels) == 1 for f in t.scales[label]) else None
        param = label.of("param") if label.kind == "scale" else None
        if one is None or one.kind != "layer" or t.uses.get(one) or t.fed_norms.get(one) or \
                centrable(model.get_submodule(one.name)) or param and (t.uses.get(param) or t.fed_norms.get(param)):
            return Refusal(Cause.SCALE, f"{name} scales the input of {norm} but scales something other than one "
                           "layer's output (or is used elsewhere), so it cannot be folded into a layer and centred",
                           both)
        return None
    if label.kind == "layer" and (why := centrable(model.get_submodule(label.name))):
        kind = type(model.get_submodule(label.name)).__name__
        return Refusal(Cause.UNCENTRABLE, f"{name} ({kind}) writes the input of {norm} and cannot be centred: {why}",
                       both)
    return None


def _bias_fate(model: nn.Module, t: Trace, s: NormSite, readers: list[str]) -> BiasPlan:
    label = Label("norm", s.name)
    if s.bias is None or not s.bias.detach().any():
        return BiasPlan.NONE
    if t.fed_norms.get(label):
        return BiasPlan.STREAM
    # Folded, a bias-less reader's new bias adds no op per call: its matmul becomes one addmm; kept after the
    # norm, the bias is one more op per call, which in eager decode costs more (benchmarks/RESULTS.md, issue 50).
    if readers and not t.uses.get(label) and all(is_linear(model.get_submodule(r)) and t.reads[r] == {label}
                                                 for r in readers):
        return BiasPlan.FOLD
    return BiasPlan.AFTER


def derive(model: nn.Module, t: Trace, sites: list[NormSite]) -> Plan:
    """The plan for converting `sites` exactly, from the trace `t` of `model`."""
    norms: dict[str, NormPlan] = {}
    needs: dict[Label, dict[tuple, str]] = {}   # label -> channel range -> a norm that needs it centred
    # post-LN: norms whose output is both in the stream and read, one feeding the next (not one such norm per
    # tower: LLaVA's image and video towers' pre-norms, read by the projector)
    placed = {s.name for s in sites if t.fed_norms.get(Label("norm", s.name))
              and (t.readers.get(s.name) or t.uses.get(Label("norm", s.name)))}
    many = any(set(t.fed_norms[Label("norm", n)]) & (placed - {n}) for n in placed)
    for s in sites:
        p = norms[s.name] = NormPlan(s.name, s.width)
        calls = t.calls.get(s.name)
        if not calls and never_runs(model, s.name):
            p.reason = Refusal(Cause.UNREACHABLE, f"{s.name} never runs: its model's code reads it only under a "
                               "constructor switch that is off, or only in a forward nothing calls, so no input "
                               "reaches it", (s.name,))
            continue
        if not calls:
            p.reason = Refusal(Cause.UNRUN, f"{s.name} did not run on the sample inputs", (s.name,))
            continue
        sources: dict[Label, frozenset] = {}
        for call in calls:
            if call.opaque and not p.reason:
                p.reason = Refusal(Cause.OPAQUE, f"the input of {s.name} is not a sum of layer outputs (it passes "
                                   f"through {call.opaque})", (s.name,))
            p.shifted = p.shifted or bool(call.opaque)
            for label, ranges in call.sources.items():
                sources[label] = sources.get(label, frozenset()) | ranges
        p.sources, p.readers = sorted(sources), list(t.readers.get(s.name, []))
        for label, ranges in sources.items():
            for r in ranges:
                needs.setdefault(label, {}).setdefault(r, s.name)
        p.reason = p.reason or next((r for r in (_source_reason(model, t, s.name, lb, sources[lb], many)
                                                 for lb in p.sources) if r), None)
        if t.fed_norms.get(Label("norm", s.name)):
            p.reason = p.reason or next((r for fed in sorted(t.fed_norms[Label("norm", s.name)])
                                         if (r := _post_ln(t, s.name, fed, many))), None)
        p.bias = _bias_fate(model, t, s, p.readers)
    groups = {label: _grouping(t, label, needs[label], norms) for label in needs}
    for label, (group, ranges) in groups.items():   # a functional layer_norm ignores only a shift of whole rows
        if label in t.tolerant and (ranges or {group} != t.tolerant[label]):
            p = norms[next(iter(needs[label].values()))]
            p.reason = p.reason or Refusal(Cause.GROUPS, f"{label.ref} is normalised whole by a functional "
                                           "layer_norm but centred in groups of channels", (label.name, p.name))
    for label, (group, ranges) in groups.items():   # output and input fixes centre whole rows only
        if _fixed(model, t, label) and (ranges or group != t.widths.get(label, group)):
            p = norms[next(iter(needs[label].values()))]
            p.reason = p.reason or Refusal(Cause.GROUPS, f"{label.ref} is normalised in groups of channels, which "
                                           "its output (or input) centring cannot do", (label.name, p.name))
    reasons = _unrun(model, t, sites, needs)
    # a norm's output that another norm reads is centred too (BLOOM's embedding norm, PaddleOCR-VL's vision
    # post-norm read by the projector's norm)
    not_kept = {name: "a norm's output that another norm reads, returned centred (each row minus its mean)"
                if label.kind == "norm" else "the residual stream, returned centred (each row minus its mean)"
                for label in needs for user in t.uses.get(label, {}) if (name := user.nested)}
    steps = _steps(model, t, norms, {s.name for s in sites}, groups)
    # centred layers whose weights are used without a call (or read directly too): rehearsed by their values
    uncalled = [s.target.name for s in steps if isinstance(s, Centre) and isinstance(s.target, Module)
                and (s.target.name not in t.called or _read_directly(t, s.target.name, owner=True))]
    return Plan(norms, steps, reasons, dict(sorted(not_kept.items())), uncalled)


def _grouping(t: Trace, label: Label, ranges: dict[tuple, str], norms: dict[str, NormPlan]) -> tuple[int, tuple]:
    """(group, ranges) of a source's centre step; a conflict sets the reason of a norm that reads it."""
    spans = sorted(ranges)
    for (a, b), (c, d) in zip(spans, spans[1:]):
        if c < b:   # overlapping but different: no centring satisfies both
            p = norms[ranges[(c, d)]]
            p.reason = p.reason or Refusal(Cause.GROUPS, f"{label.ref} is normalised in different channel groups "
                                           f"by {ranges[(a, b)]} and {ranges[(c, d)]}",
                                           (label.name, ranges[(a, b)], ranges[(c, d)]))
    width = t.widths.get(label, 0)
    size = spans[0][1] - spans[0][0]
    if spans == [(i, i + size) for i in range(0, width, size)]:
        return size, ()
    return 0, tuple(spans)


def _fixed(model: nn.Module, t: Trace, label: Label) -> bool:
    """A source centred by an output or input fix rather than by its weights: a norm, an entry, a tied embedding
    (tied as parameters, or by hand: its weight also read directly, as Whisper's `x @ embedding.weight.T` head)."""
    if label.kind in ("norm", "entry"):
        return True
    layer = model.get_submodule(label.name) if label.kind == "layer" else None
    return isinstance(layer, nn.Embedding) and (tied(model, layer.weight) or hasattr(layer, "normswap_centre") or
                                                _read_directly(t, f"{label.name}.weight"))


def _read_directly(t: Trace, name: str, owner: bool = False) -> bool:
    """Whether the forward reads the parameter `name` itself (not through its module's call), along any dim; with
    `owner`, any parameter of the module `name`."""
    return any(label.kind == "param" and (label.name.rpartition(".")[0] if owner else label.name) == name and users
               for label, users in t.uses.items())


def _unrun(model: nn.Module, t: Trace, sites: list[NormSite], needs: dict) -> list[Refusal]:
    """Parameters and floating buffers (a position table, one added only to long inputs) that never ran, are
    as wide as a normalised stream, and that the model's code can reach (`reach`: read at all, and not only
    behind an optional argument its parent never passes): the trace cannot tell what they write (a path only
    some inputs take: image tokens, masked positions, longer inputs)."""
    widths = {t.widths[label] for label in needs if label in t.widths}
    skip = {s.name for s in sites}
    found: dict[str, str] = {}   # what a message names -> the module, parameter or buffer
    buffers = [(name, model.get_buffer(name)) for name in floating_buffers(model)]
    unrun = [(name, tensor) for name, tensor in [*model.named_parameters(), *buffers]
             if name not in t.ran and name.rpartition(".")[0] not in skip and widths & set(tensor.shape)]
    names = read_names(model) if unrun else None
    for name, tensor in unrun:
        owner = name.rpartition(".")[0]
        if dead(model, name, names) or unreachable(model, name):   # no input can run it
            continue
        module = model.get_submodule(owner)
        if not isinstance(tensor, nn.Parameter):
            found.setdefault(f"{name} (buffer)", name)
            continue
        what = f"{owner} ({type(module).__name__})" if next(module.children(), None) is None and \
            len(list(module.parameters(recurse=False))) > 1 else name
        found.setdefault(what, owner if what != name else name)
    if not found:
        return []
    more = f" (and {len(found) - 3} more)" if len(found) > 3 else ""
    return [Refusal(Cause.UNRUN, f"{', '.join(list(found)[:3])}{more} did not run on the sample inputs, so the "
                    "trace cannot tell whether it writes into a normalised stream (a path only some inputs take: "
                    "pass inputs that run it, or use naive)", tuple(found.values()))]


def _steps(model: nn.Module, t: Trace, norms: dict[str, NormPlan], sites: set[str],
           groups: dict[Label, tuple[int, tuple]]) -> list[Step]:
    steps, seen = [], set()
    for p in norms.values():
        for label in p.sources:
            if label in seen:
                continue
            seen.add(label)
            kind, name = label.kind, label.name
            group, ranges = groups.get(label, (p.width, ()))
            if kind == "norm":   # a norm writing the stream: centre its output (bias: see below)
                if name not in sites and not hasattr(model.get_submodule(name), "normswap_centre"):
                    steps.append(Fix(name, centre=True))
                continue
            if kind == "entry":   # an opaque sum entering a block: centred at the block's input
                if not getattr(model.get_submodule(name), "normswap_centre_input", False):
                    steps.append(Fix(name, centre=True, at_input=True))
                continue
            layer = model.get_submodule(name) if kind == "layer" else None
            if _fixed(model, t, label):
                if not hasattr(layer, "normswap_centre"):   # centred at lookup already (earlier pass)
                    steps.append(Fix(name, centre=True))
                continue
            if label in t.scales:
                inner = next(iter(t.scales[label][0].labels)).name
                scale = Param(name) if kind == "scale" else Module(name)
                steps += [Scale(scale, into=inner), Centre(Module(inner), group, ranges)]
                continue
            if kind == "param":   # axis -2: F.linear's weight, whose rows are the channels
                axis = -1 if label.axis is None else label.axis
                steps.append(Centre(Param(name, axis), group, ranges))
                continue
            steps.append(Centre(Module(name), group, ranges))
    for p in norms.values():
        if p.bias is BiasPlan.FOLD:
            steps += [Fold(r, p.name) for r in p.readers]
        elif p.bias in (BiasPlan.AFTER, BiasPlan.STREAM):
            steps.append(Fix(p.name, norm=p.name, centre=p.bias is BiasPlan.STREAM))
        elif Label("norm", p.name) in t.fed_norms:
            steps.append(Fix(p.name, centre=True))
    return steps


def keepable(p: Plan, sites: list[NormSite], kept: set[str] = frozenset()) -> dict[str, Refusal]:
    """Norms of `sites` refused for what reaches their own input, which could stay LayerNorms while the others
    become exact RMSNorms (post-LN ones too: a later post-LN stage stays LayerNorm, an earlier pre-LN one
    converts), and the norms that then stay too (`Cause.PINNED`); `kept`: norms already kept. Only the norms no
    input can run (`Cause.UNREACHABLE`) where a parameter never ran (that concerns every norm). A LayerNorm ignores
    the mean its input loses when the stream's writers are centred, so keeping one is exact whenever the rest of
    the plan is (the rehearsal checks it); the caller refuses the model where every norm would be kept."""
    refused = {n: q.reason for n, q in p.norms.items() if q.reason}
    if p.reasons:
        return {n: r for n, r in refused.items() if r.cause is Cause.UNREACHABLE}
    # A kept norm whose input is no plain sum (Swin's patch merging: a concatenation along the hidden dim of
    # four positions of the stream) sees every centring of its sources: those stay as they are, so every norm
    # reading one, or writing one, stays a LayerNorm too (Swin: all stages but the last).
    pinned = {label: n for n in refused if p.norms[n].shifted for label in p.norms[n].sources}
    # A kept norm's output is left as it is (no fix added to it): a norm reading it stays a LayerNorm too.
    outputs = {Label("norm", n): n for n in [*kept, *refused]}
    for s in sites:
        own = Label("norm", s.name)
        hit = next((lb for lb in [*p.norms[s.name].sources, own] if lb in pinned), None)
        held = next((lb for lb in p.norms[s.name].sources if lb in outputs), None)
        if s.name in refused:
            continue
        if hit:
            what = "its output" if hit == own else f"its input holds {hit.ref}, which"
            refused[s.name] = Refusal(Cause.PINNED, f"{what} also reaches {pinned[hit]}, whose input is not a plain "
                                      "sum, so it cannot be centred", (s.name, pinned[hit]))
        elif held:
            refused[s.name] = Refusal(Cause.PINNED, f"its input holds the output of {outputs[held]}, which stays a "
                                      "LayerNorm (its output left as it is, not centred)", (s.name, outputs[held]))
    return refused
