"""The plan's vocabulary as small types: what a traced value is made of (`Label`), who read it (`User`), what
happens to a norm's bias (`BiasPlan`), why a norm cannot be made exact (`Refusal`, with its `Cause`) and the
exception that says so (`NotExact`: the one failure `auto` falls back to naive on). Decisions read their fields;
their text is for messages only.

`Label` and `Refusal` are also the text they render (a str): they sort, compare and print (in `inspect
--json`, in reports) exactly as the strings they replace did, so step order and every message stay as
they were; no code reads a decision back out of that text.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Literal, get_args

from normswap.errors import Choice, NormswapError

LabelKind = Literal["layer", "norm", "param", "scale", "entry"]
UserKind = Literal["module", "operation", "attention", "output", "reader"]


class Label(str):
    """A value a followed tensor is a linear combination of: a known layer's output ("layer"), a norm's
    output ("norm"), a parameter or persistent buffer used directly ("param", with `axis`: the dim of it that
    holds the channels when that is not the last), a layer output scaled by a per-channel parameter ("scale"),
    or an opaque value entering a block ("entry"). Its text: "<kind>:<name>", plus "#<axis>"."""

    __slots__ = ("kind", "name", "axis")
    KINDS = get_args(LabelKind)

    def __new__(cls, kind: LabelKind, name: str, axis: int | None = None) -> Label:
        if kind not in cls.KINDS:
            raise ValueError(f"not a label kind: {kind}")
        self = super().__new__(cls, f"{kind}:{name}" + ("" if axis is None else f"#{axis}"))
        for field, value in (("kind", kind), ("name", name), ("axis", axis)):
            object.__setattr__(self, field, value)
        return self

    def __setattr__(self, field, value):
        raise AttributeError("a Label is immutable")

    def __getnewargs__(self):   # copies and pickles are built by __new__ alone
        return self.kind, self.name, self.axis

    def __getstate__(self):
        return None

    @property
    def ref(self) -> str:
        """The label as messages name it: its name, with "#<axis>" for a parameter's other dim."""
        return self.name if self.axis is None else f"{self.name}#{self.axis}"

    def of(self, kind: LabelKind) -> Label:
        """The same name and axis as another kind (a scale's parameter, a parameter's scale)."""
        return Label(kind, self.name, self.axis)


@dataclass(frozen=True)
class User:
    """Who read a followed value: a known leaf ("module": its name and class), an operation ("operation": its
    name, `where` the module it ran in), nn.MultiheadAttention ("attention", `where`), the model's output
    ("output": `name` "" for the main one, else its dotted name) or a layer reading a norm ("reader")."""

    kind: UserKind
    name: str = ""
    cls: str = ""
    where: str = ""

    def __str__(self) -> str:
        at = f" in {self.where}" if self.where else ""
        if self.kind == "module":
            return f"{self.name} ({self.cls})"
        if self.kind == "operation":
            return f"operation '{self.name}'{at}"
        if self.kind == "attention":
            return f"nn.MultiheadAttention{at}"
        if self.kind == "output":
            return f"the model output '{self.name}'" if self.name else "the model output"
        return self.name

    def __lt__(self, other: User) -> bool:   # users sort as their text: the one a message names first
        return str(self) < str(other)

    @property
    def nested(self) -> str | None:
        """The name of a returned tensor that is part of a sub-model's output or a tuple (`hidden_states.2`,
        `vision_model_output.last_hidden_state`): the centred stream there is listed as not kept, not refused."""
        return self.name if self.kind == "output" and "." in self.name else None


class BiasPlan(Choice):
    """What the exact plan does with a norm's bias (see `plan`)."""

    FOLD = "fold"       # folded into the linear layers reading the norm
    AFTER = "after"     # kept as a bias after the norm (an output fix)
    STREAM = "stream"   # the norm writes the stream: its output centred, its centred bias kept after
    NONE = "none"       # no bias


class Cause(Enum):
    """What a refusal is about: the kind decisions read (`plan.keepable`, `Plan.reason`, `auto`'s fallback)."""

    UNRUN = "unrun"               # a norm, or a parameter wide enough to write the stream, did not run
    UNREACHABLE = "unreachable"   # a norm no input can run (a switch that is off, an uncalled forward): left as it is
    OPAQUE = "opaque"             # a norm's input is not a sum of layer outputs
    REAPPLIED = "reapplied"       # a norm applied again to its own output, which is read too
    MIXED = "mixed"               # the stream is mixed with a value no weight edit centres
    STREAM = "stream"             # the model returns the unnormalised residual stream
    POST_LN = "post-LN"           # norms whose outputs are both added to the stream and read
    READ = "read"                 # a source's output is read unnormalised (by a layer, an RMSNorm)
    SCALE = "scale"               # a per-channel scale that cannot be folded into one layer
    UNCENTRABLE = "uncentrable"   # a source no weight edit centres
    GROUPS = "groups"             # channel groups no centring satisfies
    PINNED = "pinned"             # kept as a LayerNorm because a kept norm sees its centring
    INPUTS = "inputs"             # no sample input to trace the model on
    FORWARD = "forward"           # the model's own forward failed on its sample inputs while traced
    UNVERIFIED = "unverified"     # the plan failed verification: rehearsed before the edits, or after them


class Refusal(str):
    """Why a norm (or the whole model) cannot be made exact: its `cause`, the `modules` it names, and its
    message text (which it is, as a str)."""

    __slots__ = ("cause", "modules")

    def __new__(cls, cause: Cause, text: str, modules: tuple[str, ...] = ()) -> Refusal:
        self = super().__new__(cls, text)
        object.__setattr__(self, "cause", cause)
        object.__setattr__(self, "modules", tuple(modules))
        return self

    def __setattr__(self, field, value):
        raise AttributeError("a Refusal is immutable")

    def __getnewargs__(self):
        return self.cause, str(self), self.modules

    def __getstate__(self):
        return None


class NotExact(NormswapError):
    """No exact form here, because of `refusal` (its `cause` says which kind): under `auto` the model is converted
    naively instead (`exact.auto_or_naive`); any other exception is a bug, never a fallback."""

    def __init__(self, refusal: Refusal):
        super().__init__(refusal)
        self.refusal = refusal

    @property
    def cause(self) -> Cause:
        return self.refusal.cause
