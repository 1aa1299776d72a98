"""`inspect_checkpoint`: what `normswap inspect` runs, for Python callers too: the norms in SRC and what
`convert` would do with each, from one traced forward (no edit made)."""
from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from normswap.models.load import load_model
from normswap.pipeline.device import resolve_device
from normswap.pipeline.options import InspectOptions
from normswap.surgery.exact import plan
from normswap.surgery.report import BIAS_FATE, plan_lines
from normswap.surgery.walk import find_norms
from normswap.folder.shipped import original_class


@dataclass
class InspectResult:
    model: str                            # the model's class name
    norms: list[dict]                     # one row per norm: to convert, already RMSNorm, skipped
    exact_unavailable: str | None         # why no exact conversion is possible, else None
    to_convert: int = 0
    rms: int = 0
    skipped: int = 0
    plans: dict = field(default_factory=dict)   # name -> the plan.NormPlan of each norm to convert

    def to_dict(self) -> dict:
        return {"model": self.model, "norms": self.norms, "exact_unavailable": self.exact_unavailable}

    def to_text(self) -> str:
        lines = [f"{self.model}: {self.to_convert} LayerNorm to convert, {self.rms} RMSNorm, {self.skipped} skipped"]
        if self.to_convert and self.exact_unavailable:
            lines.append(f"  no exact conversion: {self.exact_unavailable}")
        for r in self.norms:
            extra = f" width={r['width']} eps={r['eps']:g} |bias|={r['bias_norm']:.4g}" if "width" in r else ""
            lines.append(f"  {r['name'] or '(root)'}  {r['type']}{extra}  -> {r['action']}")
            if "plan" in r:
                lines += plan_lines(self.plans[r["name"]])
        return "\n".join(lines)

    __str__ = to_text


def inspect_checkpoint(src: str, options: InspectOptions | None = None) -> InspectResult:
    """The norms of the model at `src` (folder, Hub id or "normswap-demo") and what `convert` would do with
    each: converted (and how its bias fares), kept (already RMSNorm) or skipped (why)."""
    o = options or InspectOptions()
    device = resolve_device(o.device)
    model, _ = load_model(src, options=o.load)
    model.to(device)
    return inspect_model(model)


def inspect_model(model: nn.Module) -> InspectResult:
    """`inspect_checkpoint` of a model in memory (where it is; no edit made)."""
    sites, skipped, rms = find_norms(model)
    traced = plan(model, sites) if sites else None   # one traced forward: sources, readers, bias fate
    found, why_not = (traced.norms, traced.reason) if traced else ({}, None)

    def fate(s):
        return " (naive drops the bias)" if why_not else f" ({BIAS_FATE[found[s.name].bias]})"
    rows = [{"name": s.name, "type": type(s.module).__name__, "width": s.width, "eps": s.eps,
             "bias_norm": round(s.bias_norm, 6), "exact": why_not is None,
             "action": "to RMSNorm" + (fate(s) if s.bias_norm > 0 else ""),
             "plan": {k: v for k, v in vars(found[s.name]).items() if k not in ("name", "width")}} for s in sites]
    rows += [{"name": n, "type": type(model.get_submodule(n)).__name__, "action": "already RMSNorm: kept"}
             for n in rms]
    rows += [{"name": s.name, "type": s.cls, "action": f"skipped: {s.reason}"} for s in skipped]
    return InspectResult(original_class(model).__name__, rows, why_not, len(sites), len(rms), len(skipped), dict(found))
