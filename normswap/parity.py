"""How far a converted model is from the original: max |Δ|, relative error, KL on sample inputs, over
every floating output the forward returns (logits, hidden states, encoder states, pooled outputs,
embeddings, caches, nested tuples), each judged on its own scale.

Not compared, and named in the report: tuples of intermediate hidden states (`hidden_states`,
`encoder_hidden_states`, ... returned when asked for). They are the residual stream itself, which an exact
conversion centres by design; every output read through a norm or a layer is compared.
"""
from __future__ import annotations

import math
import re
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from functools import partial

import torch
from torch import nn

from normswap.errors import NormswapError, first_line
from normswap.io.spill import Spill, Spilled
from normswap.models.inputs.examples import Example, model_inputs
from normswap.folder.shipped import original_class

# a tuple of per-layer residual-stream states: centred by an exact conversion, so never compared
STREAM = re.compile(r"(^|\.|_)hidden_states$")
STREAM_REASON = "per-layer residual stream, centred by the exact conversion by design"
CHUNK = 8   # rows compared in fp64 at a time
SPAN = 1 << 15   # elements a block holds at least: a cache's narrow rows (64 wide) are not compared 8 at a time


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


@dataclass
class Reference:
    """A model's outputs on sample inputs, kept instead of a copy of the model (see `reference_outputs`)."""
    inputs: list[dict]
    outputs: list[dict]  # per batch: name -> tensor (or `Spilled`: on disk), every compared output
    output: str          # name of the main output
    excluded: dict = field(default_factory=dict)   # name -> why it is not compared

    @property
    def nonfinite(self) -> int:
        n = 0
        for out in self.outputs:
            for o in out.values():
                with reading(o) as (values, _):
                    n += int((~values.isfinite()).sum())
        return n


@contextmanager
def reading(v: torch.Tensor | Spilled):
    """(values, drop) of a recorded output: the tensor itself, or one kept on disk mapped back, whose
    `drop()` gives back the pages read so far (`Spilled.mapped`)."""
    if isinstance(v, Spilled):
        with v.mapped() as pair:
            yield pair
    else:
        yield v, _nothing


def _nothing() -> None:
    pass


def main_output(out) -> tuple[str, torch.Tensor]:
    """(name, tensor) of a model's main output: logits, else last_hidden_state, else the first tensor."""
    for key in ("logits", "last_hidden_state"):
        if isinstance(getattr(out, key, None), torch.Tensor):
            return key, getattr(out, key)
    kept, _ = floating_outputs(out)
    if kept:
        return next(iter(kept.items()))
    return "output", out[0]


def tensors(obj, name: str | None = "", caches: bool = False, left: dict | None = None):
    """(dotted name, tensor) for every tensor in `obj`, nested: dicts and ModelOutputs by key, tuples and lists
    by index; with `caches`, transformers caches by layer (`past_key_values.0.keys`); given `left` (a dict),
    tuples of intermediate hidden states are left out and named there (-> why). `name` None: no names."""
    if isinstance(obj, torch.Tensor):
        yield name, obj
    elif left is not None and name and STREAM.search(name) and isinstance(obj, (tuple, list)):
        left[name] = STREAM_REASON
    elif isinstance(obj, dict) or hasattr(obj, "to_tuple") and hasattr(obj, "keys"):
        for k in obj.keys():
            yield from tensors(obj[k], _key(name, k), caches, left)
    elif isinstance(obj, (tuple, list)):
        for i, x in enumerate(obj):
            yield from tensors(x, _key(name, i), caches, left)
    elif caches and isinstance(getattr(obj, "layers", None), list):   # a transformers Cache
        for i, layer in enumerate(obj.layers):
            for k in ("keys", "values"):
                yield from tensors(getattr(layer, k, None), f"{name}.{i}.{k}", caches, left)
    elif caches:
        for k in ("self_attention_cache", "cross_attention_cache"):   # EncoderDecoderCache
            if getattr(obj, k, None) is not None:
                yield from tensors(getattr(obj, k), f"{name}.{k}", caches, left)


def _key(name: str | None, k) -> str | None:
    return None if name is None else f"{name}.{k}" if name else str(k)


def tensors_in(obj) -> list[torch.Tensor]:
    """The tensors in obj, a tensor or a (nested) list, tuple or dict of them."""
    return [t for _, t in tensors(obj, None)]


def floating_outputs(out) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(every floating tensor a forward returned, by dotted name; the outputs left out -> why).

    ModelOutputs and dicts by key, tuples and lists by index, caches by layer (`past_key_values.0.keys`).
    Left out: tuples of intermediate hidden states (the residual stream an exact conversion centres)."""
    excluded: dict[str, str] = {}
    kept = {name or "output": v for name, v in tensors(out, caches=True, left=excluded) if v.is_floating_point()}
    return kept, excluded


def run(model: nn.Module, batch: dict, seed: int):
    """model(**batch) with the RNG seeded: random draws inside a forward repeat in the comparison run."""
    device = next((v.device for v in batch.values() if isinstance(v, torch.Tensor)), torch.device("cpu"))
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        return model(**batch)


@torch.no_grad()
def reference_outputs(model: nn.Module, inputs: list[dict] | None = None, skip: dict | None = None,
                      spill: Spill | None = None) -> Reference:
    """Run `model` on `inputs` (default: `model_inputs`, its sample inputs) and keep every floating output,
    detached, but those `skip` names (name -> why; "a.b" covers "a.b.c" too), which go to `excluded` with their reason.
    With `spill`, the outputs are written there as they are produced and none stays in memory (streaming: the
    converted model then runs with none of them resident).

    Take it before editing the weights; `compare_to` later needs only this, not a copy of the model.
    """
    inputs = inputs if inputs is not None else model_inputs(model)
    ref = Reference([], [], "output")
    for i, batch in enumerate(inputs):
        _record(ref, model, i, batch, skip, spill)   # its outputs freed before the next batch runs
    return ref


def _record(ref: Reference, model: nn.Module, i: int, batch: dict, skip: dict | None, spill: Spill | None) -> None:
    """Run batch `i` (row by row where the batch fails: `by_rows`) and add what it gives to `ref`."""
    try:
        runs = by_rows(partial(run, model, seed=i), batch)
    except Exception as e:
        raise unrunnable(model, e, batch) from None
    mine = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers()) if not t.is_meta}
    while runs:
        x, result = runs.pop(0)
        ref.output = main_output(result)[0]
        kept, left = floating_outputs(result)
        del result
        ref.excluded.update(left)
        for k in [k for k in kept if skipped(k, skip)]:
            ref.excluded[k] = skipped(k, skip)
            del kept[k]
        ref.inputs.append(x)
        ref.outputs.append({k: spill.put(v) if spill is not None else _owned(v, mine) for k, v in kept.items()})


def _owned(v: torch.Tensor, mine: set[int]) -> torch.Tensor:
    """v detached, copied only where it is a view or a model's own tensor (`mine`: their storages' addresses,
    which an in-place edit would change): copying every output held two of each (a big vocabulary's logits)."""
    storage = v.untyped_storage()
    view = v._base is not None or storage.nbytes() != v.numel() * v.element_size()
    return v.detach().clone() if view or storage.data_ptr() in mine else v.detach()


def unrunnable(model: nn.Module, e: Exception, batch: dict | None = None) -> NormswapError:
    """The one-line refusal for a model that fails on an input `batch`: nothing can be compared, so no conversion
    of it can be checked. A batch of the user's `example_inputs` is named as theirs; others normswap built."""
    if isinstance(e, NormswapError):
        return e
    line = first_line(e, strip=True)
    if isinstance(batch, Example):
        return NormswapError(f"{original_class(model).__name__} fails on your `example_inputs` batch {batch.index} "
                             f"({type(e).__name__}: {line}): give batches the model runs on")
    return NormswapError(f"{original_class(model).__name__} fails on the sample inputs normswap built for it "
                         f"({type(e).__name__}: {line}), so no conversion of it can be checked (inputs of this "
                         "kind are not supported yet)")


def by_rows(fn, batch: dict) -> list[tuple[dict, object]]:
    """[(batch, fn(batch))]; where fn fails on a batch of several rows, [(row, fn(row))] for each row alone
    (some heads take one row at a time: GPT-2 classifiers without a pad token). The batch's own error is
    raised where it is one row already or a row fails too."""
    try:
        return [(batch, fn(batch))]
    except Exception as e:
        rows = batch_rows(batch)
        if rows is None:
            raise
        try:
            return [(row, fn(row)) for row in rows]
        except Exception:
            raise e from None


def batch_rows(batch: dict) -> list[dict] | None:
    """A batch of several rows as one-row batches; None if it is one row already."""
    sizes = {v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor) and v.dim()}
    if len(sizes) != 1 or (n := sizes.pop()) < 2:
        return None
    return [{k: v[i:i + 1] if isinstance(v, torch.Tensor) and v.dim() else v for k, v in batch.items()}
            for i in range(n)]


def mask_for(name: str, batch: dict, out: torch.Tensor) -> torch.Tensor | None:
    """The positions of `out` that hold real tokens, where its first two dims are the mask's (batch,
    length): an encoder-decoder's encoder outputs follow the attention mask, its decoder outputs the
    decoder mask. Outputs of other lengths (image tokens prepended: GIT, ViLT) are compared everywhere."""
    decoder = "decoder_input_ids" in batch and not name.startswith("encoder_")
    mask = batch.get("decoder_attention_mask" if decoder else "attention_mask")
    if mask is None or out.dim() < 3 or tuple(out.shape[:2]) != tuple(mask.shape):
        return None
    return mask.bool().to(out.device)


@torch.no_grad()
def compare_to(reference: Reference, model: nn.Module, skip: dict | None = None) -> Parity:
    """Run `model` on the reference's inputs; compare every recorded output, on the unpadded positions.

    Each output gets its own max |Δ| and relative error; the Parity's max_abs / max_rel are the worst
    output's. An output missing or of another shape counts as an infinite error. Non-finite outputs are
    counted on either side (Python's max would hide a NaN), never compared. Outputs `skip` names (name ->
    why) are not compared and are listed in the Parity's `excluded`.
    """
    tally = Tally(reference.output == "logits")
    for i, (batch, ref) in enumerate(zip(reference.inputs, reference.outputs)):
        got, _ = floating_outputs(run(model, batch, i))
        for name, a in ref.items():
            b = got.pop(name, None)   # each freed once compared: not all of a long row's outputs at once
            if not skipped(name, skip):
                with reading(a) as (values, drop):
                    tally.add(name, batch, values, b, drop)
            del b
    outputs = {n: {"max_abs": d.item(), "max_rel": rel(d.item(), r.item())} for n, (d, r) in tally.stats.items()}
    kl = nonnegative(torch.cat(tally.kls).mean().item()) if tally.kls else None
    if tally.bad_ref or tally.bad:
        kl = float("nan")
        outputs = {n: {"max_abs": float("nan"), "max_rel": float("nan")} for n in outputs}
    worst = max(outputs, key=lambda n: order(outputs[n]["max_rel"]), default=reference.output)
    w = outputs.get(worst, {"max_abs": 0.0, "max_rel": 0.0})
    excluded = {**reference.excluded, **{n: skipped(n, skip) for o in reference.outputs for n in o
                                         if skipped(n, skip)}}
    return Parity(w["max_abs"], w["max_rel"], kl, reference.output, tally.bad_ref, tally.bad, worst, outputs,
                  excluded)


class Tally:
    """What `compare_to` keeps as it goes: per output [max |Δ|, max |reference|] (fp64 scalars), the
    per-token KL of the main logits (`kl`: they are the main output), non-finite counts on either side."""

    def __init__(self, kl: bool):
        self.kl = kl
        self.stats: dict[str, list[torch.Tensor]] = {}
        self.kls: list[torch.Tensor] = []
        self.bad_ref = self.bad = 0

    def add(self, name: str, batch: dict, a: torch.Tensor, b: torch.Tensor | None, drop=_nothing) -> None:
        """Compare output `name` of `batch`: `a` the reference's, `b` the model's (None: missing); `drop()`
        after each block (`reading`: a spilled reference's pages are not all resident at once)."""
        st = self.stats.setdefault(name, [torch.zeros((), dtype=torch.float64)] * 2)
        if b is None or b.shape != a.shape:
            st[0] = torch.tensor(math.inf, dtype=torch.float64)
            return
        for x, y in blocks(a, b.to(a.device), mask_for(name, batch, a)):
            self.bad_ref += int((~x.isfinite()).sum())
            self.bad += int((~y.isfinite()).sum())
            st[0] = torch.maximum(st[0], (x - y).abs().max().cpu())   # torch.maximum propagates NaN
            st[1] = torch.maximum(st[1], x.abs().max().cpu())
            if self.kl and name == "logits":
                self.kls.append(token_kl(x.log_softmax(-1), y.log_softmax(-1)).flatten())
            drop()


def blocks(a: torch.Tensor, b: torch.Tensor, keep: torch.Tensor | None):
    """(a, b), same shape, as fp64 blocks of CHUNK rows of their last dim (more where rows are narrow: SPAN
    elements; or one position's rows), in order; where `keep` masks their first two dims (`mask_for`), the
    kept positions only, taken block by block. No fp64 or masked copy of a whole output: fp64 logits (and
    their softmax temporaries) would be several times a big vocabulary's largest weight, and masked copies
    of both sides' logits of a 512-token row are 0.2 GB on GPT-2-medium. An empty output (a cache or router
    slot of width 0) gives none: equal if shaped alike."""
    if not a.numel():
        return
    rows = max(CHUNK, SPAN // a.shape[-1]) if a.dim() else 1
    if keep is None:
        rows_a = a.reshape(-1, a.shape[-1]) if a.dim() > 1 else a.reshape(1, -1)
        pairs = zip(rows_a.split(rows), b.reshape(rows_a.shape).split(rows))
    else:
        flat_a, flat_b = a.flatten(0, 1), b.flatten(0, 1)
        per = max(1, rows // (flat_a[0].numel() // a.shape[-1]))   # positions per block
        where = keep.flatten().nonzero().squeeze(1)
        pairs = ((flat_a[i].reshape(-1, a.shape[-1]), flat_b[i].reshape(-1, a.shape[-1])) for i in where.split(per))
    for x, y in pairs:
        if x.numel():
            yield x.double(), y.double()


def rel(d: float, r: float) -> float:
    return d / max(r, 1e-30) if math.isfinite(d) else d


def order(v: float) -> float:
    return math.inf if v != v else v   # NaN sorts worst


def token_kl(ref_logp: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """KL(reference || model) per position, from log-probabilities over the last dim."""
    return (ref_logp.exp() * (ref_logp - logp)).sum(-1)


def nonnegative(kl: float) -> float:
    """A mean KL as reported: KL is never negative, so a mean below 0 (-1e-9 where the two models agree) is
    rounding, and is 0 (NaN stays NaN)."""
    return 0.0 if kl < 0 else kl


def compare(reference: nn.Module, model: nn.Module, inputs: list[dict] | None = None,
            skip: dict | None = None, spill: Spill | None = None) -> Parity:
    """Run both models on the same inputs (default: `model_inputs(reference)`) and compare (but `skip`);
    the reference's outputs kept in `spill`, if given (`reference_outputs`)."""
    return compare_to(reference_outputs(reference, inputs, skip, spill), model)


def skipped(name: str, skip: dict | None) -> str | None:
    """Why output `name` is not compared, if `skip` (name -> why) names it or an output holding it."""
    for k, why in (skip or {}).items():
        if name == k or name.startswith(k + "."):
            return why
    return None
