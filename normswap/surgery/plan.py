"""The exact-conversion plan: plain data naming modules and parameters, derived from the traced forwards.

Per norm: its sources (what its input is a sum of, over every call), its readers (linear layers reading
its output) and what happens to its bias: "fold" into the readers, "after" (kept as a bias after the norm:
a reader is not linear or also reads something else, or the output is returned), "stream" (the norm's
output is itself a stream writer, as BLOOM's embedding norm: its output is centred and its centred bias
kept after), "none" (no bias). `reason` says why a norm cannot be made exact (then the plan is refused as
a whole); `Plan.reasons` holds the model-wide ones (a parameter that never ran); `not_kept` lists returned
outputs that cannot be preserved (the residual stream).

The steps apply the plan one small independent edit at a time, each touching only the modules it names
through `model.get_submodule`, so a streaming applier can materialise just what a step needs:
- Step("centre", target, group, ranges): make the target's outputs zero-mean over groups of `group`
  channels along its output dim, or over each of `ranges` only (q/k of a fused q/k/v projection; v stays);
  a layer's weight and bias, or a "param:" parameter's last dim;
- Step("fold", target, norm): target.bias += W @ norm.bias;
- Step("scale", target, norm): fold the per-channel scale `target` (a LayerScale module, or a "param:"
  parameter multiplied into the stream) into the layer `norm` before it and set the scale to 1;
- Step("fix", target, norm, centre): after the swap, centre target's output and/or add norm's bias
  after it (see `centring`); norm="input": centre target's first input instead (an "entry" source).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from normswap.models.introspect import is_linear, norm_kind
from normswap.surgery.reach import dead, read_names, unreachable
from normswap.surgery.record import Trace
from normswap.surgery.walk import NormSite


@dataclass
class NormPlan:
    name: str
    width: int
    sources: list[str] = field(default_factory=list)
    readers: list[str] = field(default_factory=list)
    bias: str = "none"          # "fold" | "after" | "stream" | "none"
    reason: str | None = None   # why this norm cannot be made exact
    shifted: bool = False       # its input is no plain sum: centring its sources changes it, even as a LayerNorm


@dataclass
class Step:
    op: str                # "centre" | "fold" | "scale" | "fix"
    target: str            # a module's (or a "param:"-prefixed parameter's) qualified name
    group: int = 0         # centre: group size along the output dim
    norm: str = ""         # fold/fix: the norm whose bias moves; scale: the layer the scale folds into
    centre: bool = False   # fix: centre the output too
    ranges: tuple = ()     # centre: ((start, stop), ...) centred one by one, the other channels kept
    axis: int = -1         # centre of a "param:": the dim that holds its output channels


@dataclass
class Plan:
    norms: dict[str, NormPlan]
    steps: list[Step]
    reasons: list[str] = field(default_factory=list)     # model-wide: untraced writers
    not_kept: dict[str, str] = field(default_factory=dict)   # returned output -> why it is not preserved
    uncalled: list[str] = field(default_factory=list)    # centred layers whose weights are used without a call

    @property
    def reason(self) -> str | None:
        reasons = [p.reason for p in self.norms.values() if p.reason]  # post-LN says the most: first
        return next((r for r in reasons if "post-LN" in r), reasons[0] if reasons else
                    self.reasons[0] if self.reasons else None)


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


def nested(user: str) -> str | None:
    """The name of a returned tensor that is part of a sub-model's output or a tuple (`hidden_states.2`,
    `vision_model_output.last_hidden_state`): the centred stream there is listed as not kept, not refused."""
    name = user[len("the model output '"):-1] if user.startswith("the model output '") else ""
    return name if "." in name else None


def _conflict(t: Trace, label: str, ranges) -> str | None:
    """A reader other than a norm of the channels of `label` that are centred (nested outputs aside)."""
    centred = None
    for user, channels in sorted(t.uses.get(label, {}).items()):
        if nested(user):
            continue
        if channels is None or (centred := centred if centred is not None else _covered(ranges)) & channels:
            return user
    return None


def _mixed(t: Trace, user: str, what: str) -> str | None:
    """The reason when `user` read the stream only because it mixed it with an opaque value."""
    cause = t.poison.get(user)
    return None if cause is None else (f"the stream that {what} is mixed ({user}) with a value that went through "
                                       f"{cause}, which no weight edit centres")


def _post_ln(t: Trace, name: str, fed: str, many: bool = True) -> str | None:
    """Why the norm `name`, whose output is part of the input of the norm `fed`, cannot be exact; `many`: more
    than one norm is placed so (a post-LN model)."""
    label = "norm:" + name
    users = [u for u in t.readers.get(name, []) + sorted(t.uses.get(label, ())) if not nested(u)]
    if not users:
        return None
    if fed == name:
        return (f"{name} is applied again to its own output (a norm of a norm's output, whose mean depends on the "
                f"input), and its first output is also read by {users[0]}, so it cannot be centred")
    if (why := _mixed(t, users[0], f"{name} writes")) is not None:
        return why
    if all(u.startswith("the model output") for u in users):
        return (f"{users[0]} is the unnormalised residual stream (written by {name}); only outputs read through "
                "a final norm can be kept exact")
    if many:
        return (f"{name} is post-LN: its output is added to the residual stream and also read by {users[0]}, "
                "so the stream carries a mean that depends on the input")
    return (f"{name}'s output is added to the residual stream and also read directly by {users[0]} (no norm of its "
            "own in between), so the stream carries a mean that depends on the input")


def _rms_norm(model: nn.Module, user: str) -> bool:
    """Whether `user` ("<module> (<class>)", or an operation, or a model output) is an RMSNorm module."""
    try:
        return norm_kind(model.get_submodule(user.partition(" (")[0])) == "rmsnorm"
    except AttributeError:
        return False


def _source_reason(model: nn.Module, t: Trace, norm: str, label: str, ranges, many: bool) -> str | None:
    kind, _, name = label.partition(":")
    if kind == "norm":
        return _post_ln(t, name, norm, many)
    if (user := _conflict(t, label, ranges)) is not None:
        if (why := _mixed(t, user, f"{name} writes into the input of {norm}")) is not None:
            return why
        if user.startswith("the model output"):
            return (f"{user} is the unnormalised residual stream (written by {name}); only outputs read through "
                    "a final norm can be kept exact")
        if _rms_norm(model, user):
            return (f"{name} writes the input of {norm} but its output is also read by {user}, an RMSNorm, which "
                    "is not invariant to the mean that centring removes")
        return f"{name} writes the input of {norm} but its output is also read unnormalised by {user}"
    if label in t.scales:   # folded into the one layer it scales, which is then centred
        inner = {lb for f in t.scales[label] for lb in f.labels}
        one = next(iter(inner)) if len(inner) == 1 and all(len(f.labels) == 1 for f in t.scales[label]) else ""
        param = "param:" + name if kind == "scale" else None
        if not one.startswith("layer:") or t.uses.get(one) or t.fed_norms.get(one) or \
                centrable(model.get_submodule(one[6:])) or param and (t.uses.get(param) or t.fed_norms.get(param)):
            return (f"{name} scales the input of {norm} but scales something other than one layer's output (or is "
                    "used elsewhere), so it cannot be folded into a layer and centred")
        return None
    if kind == "layer" and (why := centrable(model.get_submodule(name))):
        kind = type(model.get_submodule(name)).__name__
        return f"{name} ({kind}) writes the input of {norm} and cannot be centred: {why}"
    return None


def _bias_fate(model: nn.Module, t: Trace, s: NormSite, readers: list[str]) -> str:
    label = "norm:" + s.name
    if s.bias is None or not s.bias.detach().any():
        return "none"
    if t.fed_norms.get(label):
        return "stream"
    if readers and not t.uses.get(label) and all(is_linear(model.get_submodule(r)) and t.reads[r] == {label}
                                                 for r in readers):
        return "fold"
    return "after"


def derive(model: nn.Module, t: Trace, sites: list[NormSite]) -> Plan:
    """The plan for converting `sites` exactly, from the trace `t` of `model`."""
    norms: dict[str, NormPlan] = {}
    needs: dict[str, dict[tuple, str]] = {}   # label -> channel range -> a norm that needs it centred
    # post-LN: norms whose output is both in the stream and read, one feeding the next (not one such norm per
    # tower: LLaVA's image and video towers' pre-norms, read by the projector)
    placed = {s.name for s in sites if t.fed_norms.get("norm:" + s.name)
              and (t.readers.get(s.name) or t.uses.get("norm:" + s.name))}
    many = any(set(t.fed_norms["norm:" + n]) & (placed - {n}) for n in placed)
    for s in sites:
        p = norms[s.name] = NormPlan(s.name, s.width)
        calls = t.calls.get(s.name)
        if not calls:
            p.reason = f"{s.name} did not run on the sample inputs"
            continue
        sources: dict[str, frozenset] = {}
        for call in calls:
            if call.opaque and not p.reason:
                p.reason = f"the input of {s.name} is not a sum of layer outputs (it passes through {call.opaque})"
            p.shifted = p.shifted or bool(call.opaque)
            for label, ranges in call.sources.items():
                sources[label] = sources.get(label, frozenset()) | ranges
        p.sources, p.readers = sorted(sources), list(t.readers.get(s.name, []))
        for label, ranges in sources.items():
            for r in ranges:
                needs.setdefault(label, {}).setdefault(r, s.name)
        p.reason = p.reason or next((r for r in (_source_reason(model, t, s.name, lb, sources[lb], many)
                                                 for lb in p.sources) if r), None)
        if t.fed_norms.get("norm:" + s.name):
            p.reason = p.reason or next((r for fed in sorted(t.fed_norms["norm:" + s.name])
                                         if (r := _post_ln(t, s.name, fed, many))), None)
        p.bias = _bias_fate(model, t, s, p.readers)
    groups = {label: _grouping(t, label, needs[label], norms) for label in needs}
    for label, (group, ranges) in groups.items():   # output and input fixes centre whole rows only
        if _fixed(model, label) and (ranges or group != t.widths.get(label, group)):
            p = norms[next(iter(needs[label].values()))]
            p.reason = p.reason or (f"{label.partition(':')[2]} is normalised in groups of channels, which its "
                                    "output (or input) centring cannot do")
    reasons = _unrun(model, t, sites, needs)
    # a norm's output that another norm reads is centred too (BLOOM's embedding norm, PaddleOCR-VL's vision
    # post-norm read by the projector's norm)
    not_kept = {name: "a norm's output that another norm reads, returned centred (each row minus its mean)"
                if label.startswith("norm:") else "the residual stream, returned centred (each row minus its mean)"
                for label in needs for user in t.uses.get(label, {}) if (name := nested(user))}
    steps = _steps(model, t, norms, {s.name for s in sites}, groups)
    uncalled = [s.target for s in steps if s.op == "centre" and not s.target.startswith("param:")
                and s.target not in t.called]
    return Plan(norms, steps, reasons, dict(sorted(not_kept.items())), uncalled)


def _grouping(t: Trace, label: str, ranges: dict[tuple, str], norms: dict[str, NormPlan]) -> tuple[int, tuple]:
    """(group, ranges) of a source's centre step; a conflict sets the reason of a norm that reads it."""
    spans = sorted(ranges)
    for (a, b), (c, d) in zip(spans, spans[1:]):
        if c < b:   # overlapping but different: no centring satisfies both
            p = norms[ranges[(c, d)]]
            p.reason = p.reason or (f"{label.partition(':')[2]} is normalised in different channel groups by "
                                    f"{ranges[(a, b)]} and {ranges[(c, d)]}")
    width = t.widths.get(label, 0)
    size = spans[0][1] - spans[0][0]
    if spans == [(i, i + size) for i in range(0, width, size)]:
        return size, ()
    return 0, tuple(spans)


def _fixed(model: nn.Module, label: str) -> bool:
    """A source centred by a hook rather than by its weights: a norm, an entry, a tied embedding."""
    kind, _, name = label.partition(":")
    if kind in ("norm", "entry"):
        return True
    layer = model.get_submodule(name) if kind == "layer" else None
    return isinstance(layer, nn.Embedding) and (tied(model, layer.weight) or hasattr(layer, "normswap_centre"))


def _unrun(model: nn.Module, t: Trace, sites: list[NormSite], needs: dict) -> list[str]:
    """Parameters that never ran, are as wide as a normalised stream, and that the model's code can reach
    (`reach`: read at all, and not only behind an optional argument its parent never passes): the trace
    cannot tell what they write (a path only some inputs take: image tokens, masked
    positions)."""
    widths = {t.widths[label] for label in needs if label in t.widths}
    skip = {s.name for s in sites}
    found: list[str] = []
    unrun = [(name, param) for name, param in model.named_parameters()
             if name not in t.ran and name.rpartition(".")[0] not in skip and widths & set(param.shape)]
    names = read_names(model) if unrun else None
    for name, _ in unrun:
        owner = name.rpartition(".")[0]
        if dead(model, name, names) or unreachable(model, name):   # no input can run it
            continue
        module = model.get_submodule(owner)
        what = f"{owner} ({type(module).__name__})" if next(module.children(), None) is None and \
            len(list(module.parameters(recurse=False))) > 1 else name
        if what not in found:
            found.append(what)
    if not found:
        return []
    more = f" (and {len(found) - 3} more)" if len(found) > 3 else ""
    return [f"{', '.join(found[:3])}{more} did not run on the sample inputs, so the trace cannot tell whether "
            "it writes into a normalised stream (a path only some inputs take: pass inputs that run it, or use "
            "naive)"]


def _steps(model: nn.Module, t: Trace, norms: dict[str, NormPlan], sites: set[str],
           groups: dict[str, tuple[int, tuple]]) -> list[Step]:
    steps, seen = [], set()
    for p in norms.values():
        for label in p.sources:
            if label in seen:
                continue
            seen.add(label)
            kind, _, name = label.partition(":")
            group, ranges = groups.get(label, (p.width, ()))
            if kind == "norm":   # a norm writing the stream: centre its output (bias: see below)
                if name not in sites and not hasattr(model.get_submodule(name), "normswap_centre"):
                    steps.append(Step("fix", name, centre=True))
                continue
            if kind == "entry":   # an opaque sum entering a block: centred at the block's input
                if not getattr(model.get_submodule(name), "normswap_centre_input", False):
                    steps.append(Step("fix", name, centre=True, norm="input"))
                continue
            layer = model.get_submodule(name) if kind == "layer" else None
            if _fixed(model, label):
                if not hasattr(layer, "normswap_centre"):   # centred at lookup already (earlier pass)
                    steps.append(Step("fix", name, centre=True))
                continue
            if label in t.scales:
                inner = next(iter(t.scales[label][0].labels))[6:]
                target = "param:" + name if kind == "scale" else name
                steps += [Step("scale", target, norm=inner), Step("centre", inner, group=group, ranges=ranges)]
                continue
            if kind == "param":   # "param:<name>#-2": F.linear's weight, whose rows are the channels
                param, _, axis = label.partition("#")
                steps.append(Step("centre", param, group=group, ranges=ranges, axis=int(axis or -1)))
                continue
            steps.append(Step("centre", name, group=group, ranges=ranges))
    for p in norms.values():
        if p.bias == "fold":
            steps += [Step("fold", r, norm=p.name) for r in p.readers]
        elif p.bias in ("after", "stream"):
            steps.append(Step("fix", p.name, norm=p.name, centre=p.bias == "stream"))
        elif "norm:" + p.name in t.fed_norms:
            steps.append(Step("fix", p.name, centre=True))
    return steps
