"""ConversionReport: what `convert` did, as a table for people and JSON for tools."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from normswap.errors import printable
from normswap.norms import NormType
from normswap.surgery.labels import BiasPlan
from normswap.surgery.methods import BiasFate, Method
from normswap.surgery.walk import Skipped


@dataclass
class NormRecord:
    name: str
    replaced: str          # class name of the LayerNorm that was replaced
    width: int
    eps: float
    to: NormType
    method: str            # a Method ("naive" | "exact"), or "approximate" (pRMSNorm: the exact folding, then pRMSNorm)
    bias: BiasFate
    bias_norm: float       # L2 norm of the LayerNorm bias


@dataclass
class ConversionReport:
    to: NormType
    method: Method
    p: float | None = None
    converted: list[NormRecord] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    already_rms: list[str] = field(default_factory=list)
    added_biases: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    verification: dict | None = None                        # filled by methods that verify themselves
    not_preserved: dict[str, str] = field(default_factory=dict)  # outputs an exact conversion changes -> why
    unverified: dict[str, str] = field(default_factory=dict)  # of those, returned ones by name (not compared)

    @property
    def num_converted(self) -> int:
        return len(self.converted)

    def to_dict(self) -> dict:
        return {**asdict(self), "skipped": [s.to_dict() for s in self.skipped]}

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), **kw)

    def to_table(self, warnings: bool = True) -> str:
        rows = [("module", "replaced", "width", "eps", "to", "method", "bias", "|bias|")]
        rows += [(r.name, r.replaced, str(r.width), f"{r.eps:g}", r.to, r.method, r.bias, f"{r.bias_norm:.4g}")
                 for r in self.converted]
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        dropped = sum(r.bias == BiasFate.DROPPED for r in self.converted)
        p = f" (p={self.p})" if self.p is not None else ""
        summary = (f"converted {self.num_converted} LayerNorm -> {self.to}{p} with method '{self.method}'"
                   f"; biases dropped: {dropped}; already RMSNorm: {len(self.already_rms)}"
                   f"; skipped: {len(self.skipped)}")
        if self.added_biases:
            summary += f"; biases added to {len(self.added_biases)} layers"
        out = lines + [summary] if self.converted else [summary]
        out += [f"skipped {s.name} ({s.cls}): {s.reason}" for s in self.skipped]
        out += [f"not preserved: {n}: {why}" for n, why in self.not_preserved.items()]
        out += [f"warning: {w}" for w in self.warnings] if warnings else []
        return "\n".join(map(printable, out))   # names from a file: one line each, no terminal escapes

    __str__ = to_table


BIAS_FATE = {BiasPlan.FOLD: "exact: bias folded", BiasPlan.AFTER: "exact: bias kept after the norm",
             BiasPlan.STREAM: "exact: output centred, bias kept after", BiasPlan.NONE: "exact"}


def _short(names: list[str], n: int = 3) -> str:
    return ", ".join(names[:n]) + (f" +{len(names) - n} more" if len(names) > n else "") if names else "-"


def plan_lines(norm_plan) -> list[str]:
    """What the trace found for one norm (a plan.NormPlan), as indented lines for `inspect`."""
    lines = [f"    sources: {_short(norm_plan.sources)}", f"    readers: {_short(norm_plan.readers)}"]
    if norm_plan.reason:
        lines.append(f"    not exact: {norm_plan.reason}")
    return lines
