"""Flows: where the channels of the tensors the trace follows come from (see `rules` for the operations).

A `Flow` describes a followed tensor: the labels (layer outputs, parameters, norm outputs) it is a linear
combination of, and where their channels are. It is *pure* when every row along the hidden dim combines
rows of the labels with weights that do not depend on the channel. Its layout is *intact* (one dim, `hd`,
holds whole rows, channels in order) or *mapped*: integer `codes` say, per element, which channel of which
row of which part it is (q/k/v slices of a fused projection, per-head views, a concatenation along the
hidden dim). `norm_input` reads what a norm's rows are made of; `Trace` holds what the traced forwards showed.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch

from normswap.surgery.labels import Label, User

SHIFT = 40   # codes: (part + 1) << SHIFT | row * width + channel; 0: a zero element


@dataclass(eq=False, frozen=True)
class Flow:
    labels: frozenset                      # of `labels.Label`
    opaque: str | None = None              # why the tensor is no longer a pure combination
    hd: int | None = -1                    # intact: the hidden dim, as a negative index
    codes: torch.Tensor | None = None      # mapped: per element, see SHIFT
    parts: tuple = ()                      # mapped: (labels, width) per part
    plain: bool = True                     # elements moved only (a norm's bias still passes unchanged)
    carried: frozenset = frozenset()       # opaque: labels summed in whose per-row shift it carries unchanged

    @property
    def pure(self) -> bool:
        return self.opaque is None

    @property
    def zero(self) -> bool:
        return self.pure and not self.labels


ZERO = Flow(frozenset(), plain=False)


def opaque(labels: frozenset, why: str, carried: frozenset = frozenset()) -> Flow:
    return Flow(labels, why, None, carried=carried)


def codes_of(x: torch.Tensor, f: Flow, first: int) -> tuple[torch.Tensor, list]:
    """Integer codes of x's elements under flow f, its parts numbered from `first`; (codes, parts)."""
    if f.zero:
        return torch.zeros(x.shape, dtype=torch.long, device=x.device), []
    if f.codes is not None:
        c = f.codes.to(x.device)
        return torch.where(c != 0, c + (first << SHIFT), c), list(f.parts)
    hp = x.dim() + f.hd
    moved = [s for i, s in enumerate(x.shape) if i != hp] + [x.shape[hp]]
    base = torch.arange(x.numel(), device=x.device).view(moved).movedim(-1, hp)
    return base + ((first + 1) << SHIFT), [(f.labels, x.shape[hp])]


def decode(codes: torch.Tensor, parts) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(part, row, channel) per element (part -1 where the element is zero)."""
    part = (codes >> SHIFT) - 1
    widths = torch.tensor([w for _, w in parts] or [1], device=codes.device)
    w = widths[part.clamp(min=0)]
    rem = codes & ((1 << SHIFT) - 1)
    return part, rem // w, rem % w


def channels_read(f: Flow) -> dict[int, frozenset]:
    """For a mapped flow: part -> the channels of it that its elements hold (zero elements hold none)."""
    part, _, chan = decode(f.codes, f.parts)
    return {p: frozenset(chan[part == p].unique().tolist()) for p in range(len(f.parts))}


def canonical(codes: torch.Tensor, parts, plain: bool) -> Flow:
    """The flow of a rearranged tensor whose elements have `codes`: intact where a dim holds whole rows."""
    tags = (codes >> SHIFT).unique().tolist()   # part + 1; 0 where an element is zero
    present = [p - 1 for p in tags if p]
    if not present:
        return ZERO
    labels = frozenset().union(*(parts[p][0] for p in present))
    plain = plain and 0 not in tags
    widths = {parts[p][1] for p in present}
    w = next(iter(widths))
    if len(widths) == 1 and w in codes.shape:
        nz = codes != 0
        _, _, chan = decode(codes, parts)
        key = torch.where(nz, codes - chan, 0)   # (part, row): constant along a dim holding whole rows
        for j in range(codes.dim() - 1, -1, -1):
            if codes.shape[j] != w:
                continue
            pos = torch.arange(w, device=codes.device).view([w if d == j else 1 for d in range(codes.dim())])
            if bool(((chan == pos) | ~nz).all()) and bool((key == key.narrow(j, 0, 1)).all()) \
                    and bool((nz == nz.narrow(j, 0, 1)).all()):
                return Flow(labels, hd=j - codes.dim(), plain=plain)
    return Flow(labels, hd=None, codes=codes, parts=tuple(parts), plain=plain)


@dataclass
class NormInput:
    """One call of a norm: its input's sources with the channel ranges each norm row covers, or why not."""
    sources: dict[Label, frozenset]         # label -> {(start, stop)} ranges of its channels
    opaque: str | None = None


def norm_call(x: torch.Tensor | None, flow: Flow | None, widths: dict) -> NormInput:
    """One call of a norm on `x` (followed as `flow`): what it reads (`NormInput`); the widths of its sources
    noted in `widths`."""
    if flow is None:
        return NormInput({}, "a value the trace does not follow (not computed from the model's weights)")
    if not flow.pure:   # the labels it carries shift whole rows, which a LayerNorm ignores: not held back
        return NormInput({label: frozenset() for label in flow.labels - flow.carried}, flow.opaque)
    if flow.zero:
        return NormInput({})
    if flow.codes is None and flow.hd != -1:
        return NormInput({}, "normalisation over a dim other than the hidden one")
    if flow.codes is None:
        for label in flow.labels:
            widths.setdefault(label, x.shape[-1])
        return NormInput({label: frozenset({(0, x.shape[-1])}) for label in flow.labels})
    for labels, w in flow.parts:
        for label in labels:
            widths.setdefault(label, w)
    return norm_input(flow)


def norm_input(flow: Flow) -> NormInput:
    """Per label, the channel ranges a norm's rows cover when its input is a rearrangement (`flow.codes`).

    Centring a source over a group shifts its channels there by the group's mean; a LayerNorm ignores only a
    shift that is the same across its row. So each row must be channels of one source row of one part, in a
    contiguous range (in any order), with no zeros: a concatenation along the hidden dim (or a zero pad) of
    parts centred separately would shift them by different amounts."""
    codes = flow.codes.reshape(-1, flow.codes.shape[-1])
    part, row, chan = decode(codes, flow.parts)
    n = codes.shape[-1]
    live = (codes != 0).any(-1)
    codes, part, row, chan = codes[live], part[live], row[live], chan[live]
    if not len(codes):
        return NormInput({})
    labels_all = frozenset().union(*(labels for labels, _ in flow.parts))
    ordered = chan.sort(-1).values
    start = ordered[:, :1]
    why = None
    if not bool((part == part[:, :1]).all()):
        why = "a concatenation along the hidden dim"
    elif not bool((codes != 0).all()):
        why = "a zero pad along the hidden dim"
    elif not bool((row == row[:, :1]).all()):
        why = "a rearrangement that mixes channels of different positions"
    elif not bool((ordered - start == torch.arange(n, device=codes.device)).all()):
        why = "a rearrangement that gathers channels from scattered places of a layer's output"
    if why:   # centring would shift the parts of a row by different amounts: the norm does not ignore that
        return NormInput({label: frozenset() for label in labels_all},
                         f"{why}, whose parts centring would shift by different amounts")
    sources: dict[Label, frozenset] = {}
    for p, (labels, _) in enumerate(flow.parts):
        sel = part[:, 0] == p
        if bool(sel.any()):
            ranges = frozenset(zip(start[sel, 0].tolist(), (start[sel, 0] + n).tolist()))
            for label in labels:
                sources[label] = sources.get(label, frozenset()) | ranges
    return NormInput(sources)


def channel_dim(x: torch.Tensor, n: int, flow: Flow | None) -> int:
    """The dim of x (negative) a per-channel scale of `n` channels runs along: where its flow has them, else its
    last dim of that size."""
    if flow is not None and flow.hd is not None and flow.codes is None and x.shape[flow.hd] == n:
        return flow.hd
    return next((d - x.dim() for d in range(x.dim() - 1, -1, -1) if x.shape[d] == n), -1)


@dataclass
class Trace:
    """What the forwards showed, by `labels.Label` (what a value is made of) and `labels.User` (who read it)."""

    calls: dict[str, list[NormInput]] = field(default_factory=lambda: defaultdict(list))   # norm -> calls
    readers: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))       # norm -> layers
    reads: dict[str, set] = field(default_factory=lambda: defaultdict(set))   # layer -> its norm labels, OTHER
    uses: dict[Label, dict] = field(default_factory=lambda: defaultdict(dict))   # label -> user -> channels
    fed_norms: dict[Label, set[str]] = field(default_factory=lambda: defaultdict(set))     # label -> norms
    scales: dict[Label, list[Flow]] = field(default_factory=lambda: defaultdict(list))     # scale -> inputs
    widths: dict[Label, int] = field(default_factory=dict)                                 # label -> width
    ran: set[str] = field(default_factory=set)                                             # parameters
    called: set[str] = field(default_factory=set)                                          # hooked leaves
    poison: dict[User, str] = field(default_factory=dict)    # user -> the opaque value it mixed the stream with
    passes: dict[User, str] = field(default_factory=dict)    # a sum or move whose output is opaque -> why
    tolerant: dict[Label, set[int]] = field(default_factory=lambda: defaultdict(set))   # label -> widths of rows
    # a functional layer_norm read whole: invariant to centring those rows (F.layer_norm, MONAI's proj_out)


OTHER = "other"   # in Trace.reads: a layer read something other than one norm's output
