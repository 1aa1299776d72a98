"""The exact-conversion plan: plain data naming modules and parameters, derived from one traced forward.

Per norm: its sources (what its input is a sum of), its readers (linear layers reading its output) and
what happens to its bias: "fold" into the readers, "after" (kept as a bias after the norm: a reader is
not linear, or the output is the model's), "stream" (the norm's output is itself a stream writer, as
BLOOM's embedding norm: its output is centred and its centred bias kept after), "none" (no bias).
`reason` says why a norm cannot be made exact (then the plan is refused as a whole).

The steps apply the plan one small independent edit at a time, each touching only the modules it names
through `model.get_submodule`, so a streaming applier can materialise just what a step needs:
- Step("centre", target, group): make the target's outputs zero-mean over groups of `group` channels
  along its output dim (a layer's weight and bias, or a parameter's last dim);
- Step("fold", target, norm): target.bias += W @ norm.bias;
- Step("scale", target, norm): fold the per-channel scale `target` (LayerScale) into the layer `norm`
  before it and set the scale to 1, so that layer can be centred;
- Step("fix", target, norm, centre): after the swap, centre target's output and/or add norm's bias
  after it (see `centring`); norm="input": centre target's first input instead (an "entry" source).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from normswap.models.introspect import is_linear
from normswap.surgery.trace import Trace
from normswap.surgery.walk import NormSite


@dataclass
class NormPlan:
    name: str
    width: int
    sources: list[str] = field(default_factory=list)
    readers: list[str] = field(default_factory=list)
    bias: str = "none"          # "fold" | "after" | "stream" | "none"
    reason: str | None = None   # why this norm cannot be made exact


@dataclass
class Step:
    op: str                # "centre" | "fold" | "scale" | "fix"
    target: str            # a module's (or, for "centre", a "param:"-prefixed parameter's) qualified name
    group: int = 0         # centre: group size along the output dim
    norm: str = ""         # fold/fix: the norm whose bias moves
    centre: bool = False   # fix: centre the output too


@dataclass
class Plan:
    norms: dict[str, NormPlan]
    steps: list[Step]

    @property
    def reason(self) -> str | None:
        reasons = [p.reason for p in self.norms.values() if p.reason]  # post-LN says the most: first
        return next((r for r in reasons if "post-LN" in r), reasons[0] if reasons else None)


def _centrable(layer: nn.Module) -> bool:
    return is_linear(layer) or isinstance(layer, (nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d))


def tied(model: nn.Module, param: nn.Parameter) -> bool:
    return sum(p is param for _, p in model.named_parameters(remove_duplicate=False)) > 1


def _uses(t: Trace, label: str) -> str:
    return ", ".join(sorted(t.uses[label])[:2])


def _post_ln(t: Trace, name: str) -> str | None:
    """Why the norm `name`, whose output is summed into the stream, cannot be exact (None: it can)."""
    label = "norm:" + name
    users = t.readers.get(name, []) + sorted(t.uses.get(label, ()))
    if not users:
        return None
    if users == ["the model output"]:
        return (f"the model output is the unnormalised residual stream (written by {name}); only outputs "
                "read through a final norm can be kept exact")
    return (f"{name} is post-LN: its output is added to the residual stream and also read by {users[0]}, "
            "so the stream carries a mean that depends on the input")


def _source_reason(model: nn.Module, t: Trace, norm: str, label: str) -> str | None:
    kind, _, name = label.partition(":")
    if kind == "norm":
        return _post_ln(t, name)
    if t.uses.get(label):
        return f"{name} writes the input of {norm} but its output is also read unnormalised by {_uses(t, label)}"
    if name in t.scales:   # LayerScale: folded into the one layer it scales, which is then centred
        labels, opaque = t.scales[name]
        inner = next(iter(labels)) if len(labels) == 1 and not opaque else ""
        if not inner.startswith("layer:") or t.uses.get(inner) or not _centrable(model.get_submodule(inner[6:])):
            return f"{name} scales something other than one layer's output, so it cannot be folded and centred"
        return None
    if kind == "layer" and not _centrable(model.get_submodule(name)):
        return f"{name} ({type(model.get_submodule(name)).__name__}) writes the input of {norm} and cannot be centred"
    return None


def derive(model: nn.Module, t: Trace, sites: list[NormSite]) -> Plan:
    """The plan for converting `sites` exactly, from the trace `t` of `model`."""
    norms: dict[str, NormPlan] = {}
    for s in sites:
        p = norms[s.name] = NormPlan(s.name, s.width)
        if s.name not in t.norm_inputs:
            p.reason = f"{s.name} did not run on the sample input"
            continue
        labels, opaque = t.norm_inputs[s.name]
        p.sources, p.readers = sorted(labels), list(t.readers.get(s.name, []))
        if opaque:
            p.reason = (f"the input of {s.name} is not a sum of layer outputs (it passes through "
                        f"{opaque})")
        p.reason = p.reason or next((r for r in (_source_reason(model, t, s.name, lb) for lb in p.sources) if r),
                                    None)
        label = "norm:" + s.name
        if t.fed_norms.get(label):
            p.reason = p.reason or _post_ln(t, s.name)
        b = s.bias
        if b is None or not b.detach().any():
            p.bias = "none"
        elif t.fed_norms.get(label):
            p.bias = "stream"
        elif p.readers and not t.uses.get(label) and all(is_linear(model.get_submodule(r)) for r in p.readers):
            p.bias = "fold"
        else:
            p.bias = "after"
    return Plan(norms, _steps(model, t, norms, {s.name for s in sites}))


def _steps(model: nn.Module, t: Trace, norms: dict[str, NormPlan], sites: set[str]) -> list[Step]:
    steps, seen = [], set()
    for p in norms.values():
        for label in p.sources:
            if label in seen:
                continue
            seen.add(label)
            kind, _, name = label.partition(":")
            if kind == "norm":   # a norm writing the stream: centre its output (bias: see below)
                if name not in sites and not hasattr(model.get_submodule(name), "normswap_centre"):
                    steps.append(Step("fix", name, centre=True))
                continue
            if kind == "entry":   # an opaque sum entering a block: centred at the block's input
                if not getattr(model.get_submodule(name), "normswap_centre_input", False):
                    steps.append(Step("fix", name, centre=True, norm="input"))
                continue
            layer = model.get_submodule(name) if kind == "layer" else None
            if isinstance(layer, nn.Embedding) and (tied(model, layer.weight) or hasattr(layer, "normswap_centre")):
                if not hasattr(layer, "normswap_centre"):   # centred at lookup already (earlier pass)
                    steps.append(Step("fix", name, centre=True))
                continue
            if name in t.scales:
                inner = next(iter(t.scales[name][0]))[6:]
                steps += [Step("scale", name, norm=inner), Step("centre", inner, group=p.width)]
                continue
            steps.append(Step("centre", label if kind == "param" else name, group=p.width))
    for p in norms.values():
        if p.bias == "fold":
            steps += [Step("fold", r, norm=p.name) for r in p.readers]
        elif p.bias in ("after", "stream"):
            steps.append(Step("fix", p.name, norm=p.name, centre=p.bias == "stream"))
        elif "norm:" + p.name in t.fed_norms:
            steps.append(Step("fix", p.name, centre=True))
    return steps
