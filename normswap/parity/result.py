"""The parity report: how far a model is from a reference on each compared output, the worst of them
named, and how it reads (a line, a JSON-safe dict)."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from normswap.parity.outputs import STREAM_REASON


@dataclass
class Parity:
    max_abs: float       # max |Δ| of the worst output (NaN when either side is non-finite)
    max_rel: float       # its max |Δ| / max |reference|: the largest relative error over all compared outputs
    kl: float | None     # mean KL(reference || converted) per token of the logits, for models with logits
    output: str          # the main output (logits, else last_hidden_state, else the first)
    ref_nonfinite: int = 0   # NaN/inf values in the reference's outputs
    nonfinite: int = 0       # NaN/inf values in the compared model's outputs
    worst: str = ""          # the output with the largest relative error
    outputs: dict = field(default_factory=dict)    # name -> {"max_abs", "max_rel"} for every compared output
    excluded: dict = field(default_factory=dict)   # name -> why it was not compared

    @property
    def finite(self) -> bool:
        return not (self.ref_nonfinite or self.nonfinite)

    @property
    def compared(self) -> list[str]:
        return list(self.outputs)

    def to_dict(self) -> dict:  # NaN -> None: the CLI's --json must stay valid JSON
        return json_safe({**asdict(self), "compared": self.compared})

    def scope(self) -> str:
        return scope(self.output, self.worst, self.compared, self.excluded)

    def __str__(self) -> str:
        if not self.finite:
            return (f"parity vs original ({self.scope()}): NON-FINITE outputs: {self.nonfinite} NaN/inf in the "
                    f"converted model, {self.ref_nonfinite} in the original; no comparison possible")
        kl = f", KL {self.kl:.3e}" if self.kl is not None else ""
        return f"parity vs original ({self.scope()}): max |Δ| {self.max_abs:.3e}, rel {self.max_rel:.3e}{kl}"


def scope(output: str, worst: str, compared: list[str], excluded: dict) -> str:
    """Which outputs a comparison covers: "logits", or "logits, worst of 5 outputs: logits,
    past_key_values[4]", and what it left out and why."""
    s = worst or output
    if len(compared) > 1:
        s += f", worst of {len(compared)} outputs: {grouped(compared)}"
    if excluded:
        s += f"; not compared: {grouped(excluded)} ({STREAM_REASON})"
    return s


def json_safe(v):
    """`v` with every non-finite float (NaN, inf) in it as None, tuples as lists: json.dumps writes valid JSON."""
    if isinstance(v, dict):
        return {k: json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [json_safe(x) for x in v]
    return None if isinstance(v, float) and not math.isfinite(v) else v


def grouped(names) -> str:
    """Output names, those under one key counted: "logits, past_key_values[8]"."""
    groups: dict[str, int] = {}
    for n in names:
        groups[n.split(".")[0]] = groups.get(n.split(".")[0], 0) + 1
    return ", ".join(k if c == 1 and k in names else f"{k}[{c}]" for k, c in groups.items())
