"""`rotate`: rotate the residual streams of an exactly converted model by an orthogonal Q, keeping its outputs
(SliceGPT's and QuaRot's computational invariance), so that activation outliers spread over the channels and
the model quantizes better.

With h the stream (a row) and h' = hQ: each norm's gain g is folded into the linear layers reading it and set
to 1; every writer's output is multiplied by Q (Linear W <- QᵀW, b <- Qᵀb; GPT-2's Conv1D, embeddings and
parameters added to the stream along their channels); every reader's input by Q (W <- W·diag(g)·Q). Then
RMSNorm(h') = RMSNorm(h)Q and every reader computes what it did. Two kinds of norm get an output fix
multiplying by a d x d matrix M instead (listed as `unrotated`): a norm whose output is read other than by
linear layers (returned: GPT2Model's ln_f, mBART's encoder final norm; read by an attention module) keeps it
unrotated, M = Qᵀ·diag(g) (its linear readers, mBART's cross-attention, are left as they are); a norm writing
the stream (BLOOM's and mBART's embedding norms) keeps its input (the embeddings) unrotated, M = diag(g)·Q and
its kept bias b becomes bQ. Its centring, if any, goes into M too and its gain is set to 1. An opaque value
entering the stream (Whisper's encoder: after a GELU) is multiplied by Q in the input fix that centres it
(listed too). What the streams are, and what is refused, comes from the trace the exact plan uses
(`streams`). A tied LM head reads the final norm while its embedding writes the stream: it is untied (the
report lists it; the folder then stores both). A tied embedding centred at lookup by the conversion's output
fix gets the centring moved into its (untied) weights. Arithmetic in float64, stored in the model's dtype;
the rotated model is verified against its outputs before the edits, on the sample (and example) inputs, as
`convert` verifies; a failure leaves the model edited (discard it).

A model that is RMSNorm already (Llama, Qwen, Mistral, Gemma's 1 + w, Phi-3...) rotates the same way: its norms
are found by what they compute (`streams.check_norms`), whatever library defines them, and their gains are set to
ones where they are stored (a Gemma norm's w to 0). Such a model needs no output fix, so it stays an instance of
its own class: saved, it is its original architecture with other weights (`models.save`).

With `online`, the layers writing the stream from a channel-wise input (Llama's down_proj, GPT-2's MLP c_proj) also
get an online rotation of that input (QuaRot's R4, `online`): run-time code, so the model gets a section (as a
conversion's) recording it, and is saved with the shipped modeling file, no longer as its own architecture.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from normswap.errors import NormswapError, first_line
from normswap.models.adopt import adopt
from normswap.models.inputs.examples import NoInputs, check_examples, model_inputs
from normswap.folder.attached import has_config, section, set_section
from normswap.folder.section import new_section
from normswap.models.wrapped import unwrapped
from normswap.surgery import verification
from normswap.surgery.algebra import centre_outputs, fold_bias, named_tensor, output_dim
from normswap.surgery.centring import add_output_fix, describe_fix
from normswap.surgery.convert import probe_of
from normswap.surgery.heads import find_pairs, head_width, rotate_heads
from normswap.surgery.online import find_online, rotate_online, rotated_online
from normswap.surgery.orthogonal import METHODS, rotation, times
from normswap.surgery.steps import Param
from normswap.surgery.streams import NotRotatable, Gain, Stream, Streams, Writer, check_norms, find_streams
from normswap.surgery.trace import ForwardFailed, trace
from normswap.surgery.trainable import kept_trainable

__all__ = ["NotRotatable", "RotationReport", "rotate"]


@dataclass
class RotationReport:
    method: str
    seed: int
    streams: list[dict] = field(default_factory=list)   # {width, q, norms, writers, readers}
    untied: list[str] = field(default_factory=list)     # parameters given their own copy (a tied LM head, ...)
    added_biases: list[str] = field(default_factory=list)   # readers given a bias (a norm's kept bias folded)
    unrotated: dict[str, str] = field(default_factory=dict)   # norm -> what stays unrotated (a d x d matmul)
    not_preserved: dict[str, str] = field(default_factory=dict)
    inner: list[str] = field(default_factory=list)   # per-head norms inside blocks (Qwen3's q/k norms), left as is
    heads: dict | None = None   # the per-head rotation (R2): {width, q, pairs: [values layer, output layer]}
    online: list[dict] = field(default_factory=list)   # online rotations of inputs (R4): {layer, width, q} each
    verification: dict | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), **kw)

    def to_table(self) -> str:
        lines = [f"rotated {len(self.streams)} stream(s) ({self.method}, seed {self.seed}):"]
        lines += [f"  width {s['width']}: {s['q']}; {len(s['norms'])} norms, {len(s['writers'])} writers, "
                  f"{len(s['readers'])} readers" for s in self.streams]
        if self.heads:
            lines.append(f"  per head (width {self.heads['width']}, {self.heads['q']}): values and output of "
                         f"{len(self.heads['pairs'])} attention(s) ({self.heads['pairs'][0][0]}, ...)")
        if self.online:
            lines += [f"  online, before {len(group)} layer(s) ({group[0]}, ...): x -> x·H of width {width}, {q}"
                      for (width, q), group in _grouped(self.online).items()]
        lines += [f"  untied {name} (a tie the config no longer makes: the LM head reads the rotated stream)"
                  for name in self.untied]
        lines += [f"  bias added to {name} (a norm's kept bias folded into it)" for name in self.added_biases]
        lines += [f"  unrotated: {name} ({why})" for name, why in self.unrotated.items()]
        lines += [f"  not preserved: {k} ({why})" for k, why in self.not_preserved.items()]
        if self.inner:
            lines.append(f"  left as they are: {len(self.inner)} per-head norms inside blocks ({self.inner[0]}, ...): "
                         "no rotation of a stream reaches them")
        if self.verification:
            lines.append(f"  parity vs before: max relative error {self.verification['max_rel']:.3e} "
                         f"(tolerance {self.verification['tolerance']:g})")
        return "\n".join(lines)


def _grouped(online: list[dict]) -> dict[tuple, list[str]]:
    groups: dict[tuple, list[str]] = {}
    for o in online:
        groups.setdefault((o["width"], o["q"]), []).append(o["layer"])
    return groups


def rotate(model: nn.Module, method: str = "hadamard", seed: int = 0, example_inputs=None,
           heads: bool = False, online: bool = False) -> RotationReport:
    """Rotate every residual stream of an exactly converted `model` in place (see the module docstring).

    method: "hadamard" (a randomised Hadamard matrix, or a random orthogonal one where the width has no known
    Hadamard matrix) or "random" (a random orthogonal matrix); `seed` draws the signs or the matrix (stream i
    uses seed + i). example_inputs: as `convert` takes them (needed for a model without a config). heads: also
    rotate each attention head's values and the layer reading them back (QuaRot's R2, `heads`). online: also
    rotate at run time the input of each layer writing the stream from a channel-wise input (QuaRot's R4, `online`:
    drawn from seed + the number of streams). Refuses, naming the part, what cannot be rotated exactly (`streams`),
    before any edit.
    """
    if not isinstance(model, nn.Module):
        raise NormswapError(f"`model` must be a torch.nn.Module, not {type(model).__name__}")
    model = unwrapped(model)   # as `convert`: inside nn.DataParallel and torch.compile
    if method not in METHODS:
        raise NormswapError(f"unknown rotation method '{method}': choose hadamard or random")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise NormswapError(f"`seed` must be an int, not {type(seed).__name__}")
    for flag, value in (("heads", heads), ("online", online)):
        if not isinstance(value, bool):
            raise NormswapError(f"`{flag}` must be a bool, not {type(value).__name__}")
    check_examples(example_inputs)
    gains = check_norms(model)
    try:
        inputs = model_inputs(model, example_inputs)
    except NoInputs as e:
        raise NotRotatable(f"no sample input to trace it ({first_line(e, strip=True)})") from None
    try:
        t = trace(model, inputs, set(gains), rotating=True)
    except ForwardFailed as e:   # the model's forward failed: say so instead of a traceback
        raise NotRotatable(f"tracing failed: {e}") from None
    found = find_streams(model, t, gains)
    _check_fixes(model, found)
    pairs, per_head = _head_pairs(model, found, inputs[0], method, seed) if heads else ([], None)
    at_run_time = _online_layers(model, found, inputs[0], pairs) if online else []
    if pairs:
        found.not_preserved["cache"] = ("the attention's cache: its values (and keys, where one layer makes queries, "
                                        "keys and values: GPT-2's c_attn) stored rotated per head, read back so: "
                                        "generation unchanged")
    reference = verification.reference(model, found.not_preserved, example_inputs)
    report = RotationReport(method, seed, not_preserved=dict(found.not_preserved), inner=found.inner)
    if hasattr(getattr(model, "config", None), "output_hidden_states"):
        report.not_preserved["hidden_states"] = ("output_hidden_states=True: the residual stream inside the model, "
                                                 "returned rotated" + (" (and centred)" if section(model) else ""))
    with kept_trainable(model):   # new matrices and biases train where what they are added to did
        if per_head is not None:
            rotate_heads(model, pairs, per_head[0])
            report.heads = {"width": per_head[0].shape[0], "q": per_head[1], "pairs": [list(p) for p in pairs]}
        report.untied = _untie(model, found)
        report.added_biases = [r for s in found.streams for r in _fold_kept_biases(model, s)]
        for i, s in enumerate(found.streams):
            q, what = rotation(s.width, method, seed + i)
            _rotate_stream(model, s, q, found)
            report.streams.append({"width": s.width, "q": what, "norms": s.norms,
                                   "writers": [str(w.target) for w in s.writers], "readers": sorted(s.readers)})
            report.unrotated.update(_unrotated(s))
        report.online = rotate_online(model, at_run_time, method, seed + len(found.streams))
    if report.online and section(model) is None:   # run-time code now: a section, as a conversion's, ships it
        set_section(model, new_section(model, probe_of(inputs[0])))
    _record(model, report, found)
    report.verification = _verify(reference, model)
    if report.online:
        adopt(model)   # its own save_pretrained writes the folder with the shipped code, as a converted model's
    return report


def _online_layers(model: nn.Module, found: Streams, batch: dict, pairs: list[tuple[str, str]]) -> list[str]:
    """The layers to rotate online (`online.find_online`; R2's are its); NotRotatable where none."""
    done = rotated_online(model, found)
    layers = find_online(model, found, batch, {o for _, o in pairs} | set(done))
    if not layers and done:
        raise NotRotatable(f"{done[0]} is rotated online already: no layer left to rotate online")
    if not layers:
        raise NotRotatable("no layer to rotate online: none writes the stream from a channel-wise function of "
                           "layers reading it (an MLP's down projection)")
    return layers


def _head_pairs(model: nn.Module, found: Streams, batch: dict, method: str, seed: int):
    """(the attention value/output pairs, (R, what it is)) for the per-head rotation; NotRotatable where none."""
    r, what = rotation(head_width(model), method, seed)
    pairs = find_pairs(model, found, batch, r)
    if not pairs:
        raise NotRotatable(f"no attention found to rotate per head (heads of width {r.shape[0]}): no layer reading a "
                           "stream whose output, rotated per head, reaches a stream writer's input rotated alike")
    return pairs, (r, what)


def _check_fixes(model: nn.Module, found: Streams) -> None:
    """A model normswap has not converted (no section: saved as its own architecture) has no place for an output
    fix's matrix: NotRotatable naming the first norm that would need one."""
    if section(model) is not None:
        return
    for s in found.streams:
        needs = [*(f"{n}'s output is read by {who}" for n, who in s.kept.items()),
                 *(f"{w.target.name} writes the stream" for w in s.writers if w.norm or w.entry)]
        if needs:
            raise NotRotatable(f"{needs[0]}: its rotation needs a {s.width} x {s.width} matrix after it, which only a "
                               "model normswap converted stores (its own architecture has no place for it)")


def _verify(reference, model: nn.Module) -> dict:
    try:
        return verification.verify(reference, model)
    except verification.VerificationFailed as e:
        raise verification.VerificationFailed(str(e).replace("exact conversion", "rotation", 1) +
                                              "; the model in memory is rotated: discard it") from None


def _weights(model: nn.Module, name: str) -> list[nn.Parameter]:
    layer = model.get_submodule(name)
    return [p for p in (getattr(layer, "weight", None), getattr(layer, "bias", None)) if p is not None]


def _untie(model: nn.Module, found: Streams) -> list[str]:
    """Give each reader's weight its own copy where another module shares it (a tied LM head); the names."""
    counts: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        counts[id(p)] = counts.get(id(p), 0) + 1
    untied = []
    for s in found.streams:
        for r in sorted(s.readers):
            layer = model.get_submodule(r)
            if counts.get(id(layer.weight), 1) > 1:
                layer.weight = nn.Parameter(layer.weight.detach().clone(), requires_grad=layer.weight.requires_grad)
                untied.append(f"{r}.weight")
    switched = False
    if untied and has_config(model):
        for config in (model.config, getattr(model.config, "get_text_config", lambda: None)()):
            if getattr(config, "tie_word_embeddings", False):
                config.tie_word_embeddings, switched = False, True
    # transformers ties more than the head by that flag (mBART's encoder and decoder embeddings to `shared`): off,
    # loading would leave those names missing, so each gets its own copy (stored once more in the folder)
    return untied + (_untie_shared(model) if switched else [])


def _untie_shared(model: nn.Module) -> list[str]:
    """A copy of each parameter for every module but the first that shares it (a module reached under two names
    stays one); their names."""
    first: dict[int, str] = {}
    names = []
    for name, module in model.named_modules():
        for key, p in list(module.named_parameters(recurse=False)):
            if first.setdefault(id(p), name) != name:
                setattr(module, key, nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad))
                names.append(f"{name}.{key}" if name else key)
    return names


@torch.no_grad()
def _rotate_writer(model: nn.Module, w: Writer, q: torch.Tensor, done: set[int]) -> None:
    if isinstance(w.target, Param):
        p, axis = named_tensor(model, w.target.name), w.target.axis
        if id(p) not in done:
            done.add(id(p))
            p.copy_(times(p, p.dim() + axis if axis < 0 else axis, q.to(p.device)).to(p.dtype))
        return
    layer = model.get_submodule(w.target.name)
    if w.centre:   # the conversion's output fix (a tied embedding centred at lookup), moved into the weights
        centre_outputs(model, w.target, 0)
        layer.normswap_centre = False
    dim = output_dim(layer)
    for p in _weights(model, w.target.name):
        if id(p) not in done:
            done.add(id(p))
            p.copy_(times(p, dim if p is layer.weight else 0, q.to(p.device)).to(p.dtype))


@torch.no_grad()
def _fold_kept_biases(model: nn.Module, s: Stream) -> list[str]:
    """A bias kept after a norm (its output is also returned) folded into its readers, c <- c + W b, and
    dropped: the returned stream is rotated anyway (not preserved). The readers given a bias."""
    added = []
    for n in s.biased:
        norm = model.get_submodule(n)
        b = norm.normswap_bias.detach().double()
        added += [r for r, of in sorted(s.readers.items()) if of == n and fold_bias(model.get_submodule(r), b)]
        del norm.normswap_bias   # the output fix adds nothing more (it reads the attribute at each call)
    return added


def _unrotated(s: Stream) -> dict[str, str]:
    """What the stream's matrix fixes keep unrotated, per norm or block (the report's `unrotated`)."""
    d = f"a {s.width} x {s.width} matmul"
    out = {n: f"its output stays unrotated, read by {who}: {d} after it" for n, who in s.kept.items()}
    out.update({w.target.name: f"its input stays unrotated, its output writes the stream: {d} after it"
                for w in s.writers if w.norm})
    return {**out, **{w.target.name: f"the opaque value entering the stream at its input stays unrotated: {d} in its "
                                 "input fix" for w in s.writers if w.entry}}


@torch.no_grad()
def _matrix_fix(model: nn.Module, name: str, g: Gain, r_in: torch.Tensor | None = None,
                r_out: torch.Tensor | None = None) -> None:
    """Norm `name` returns what it did (times r_out): its gain, centring and matrix M0 (a rotation before) moved
    into an output fix's matrix M = r_inᵀ·diag(g)·C·M0·r_out (r_in: the rotation of what it reads, r_out: of what
    it writes; None: none), its kept bias b into b·r_out, its gain set to 1."""
    norm = model.get_submodule(name)
    m = torch.diag(g.value)
    if getattr(norm, "normswap_centre", False):
        m = m - m.mean(1, keepdim=True)   # diag(g)·C, C = I - 11ᵀ/d: centring is linear
    before = getattr(norm, "normswap_matrix", None)
    m = m if before is None else m @ before.detach().double().cpu()
    m = m if r_in is None else r_in.cpu().T @ m
    m = m if r_out is None else m @ r_out.cpu()
    bias, weight = getattr(norm, "normswap_bias", None), getattr(norm, "weight", None)
    ref = next(p for p in (weight, bias, *model.parameters()) if p is not None and p.is_floating_point())
    m = m.to(ref.device, ref.dtype)
    if not hasattr(norm, "normswap_centre"):
        add_output_fix(norm, False, matrix=m)
    else:   # the conversion's fix: its forward reads these attributes at each call
        norm.normswap_centre = False
        norm.normswap_matrix = nn.Parameter(m)
        if bias is not None and r_out is not None:
            bias.copy_((bias.double() @ r_out.to(bias.device)).to(bias.dtype))
    g.to_ones(norm)


@torch.no_grad()
def _rotate_stream(model: nn.Module, s: Stream, q: torch.Tensor, found: Streams) -> None:
    for n in s.kept:   # before its gain is set to 1 below
        _matrix_fix(model, n, found.gains[n], r_in=q)
    done: set[int] = set()   # a tensor shared by two writers (or two readers) is edited once
    for w in s.writers:
        if w.norm:
            _matrix_fix(model, w.target.name, found.gains[w.target.name], r_out=q)
        elif w.entry:   # its input fix centres the value entering the stream, then multiplies it by M <- M·Q
            block = model.get_submodule(w.target.name)
            m = getattr(block, "normswap_input_matrix", None)
            m = q if m is None else m.detach().double().cpu() @ q
            ref = next(p for p in model.parameters() if p.is_floating_point())
            block.normswap_input_matrix = nn.Parameter(m.to(ref.device, ref.dtype))
        else:
            _rotate_writer(model, w, q, done)
    done = set()   # a layer both reading a norm and writing the stream gets both edits
    for r, norm in sorted(s.readers.items()):
        layer = model.get_submodule(r)
        if id(layer.weight) in done:
            continue
        done.add(id(layer.weight))
        g = found.gains[norm].value.to(layer.weight.device)
        dim = 1 - output_dim(layer)   # the input dim: Linear (out, in), Conv1D (in, out)
        w = layer.weight.double().movedim(dim, -1) * g
        layer.weight.copy_((w @ q.to(w.device)).movedim(-1, dim).to(layer.weight.dtype))
    for n in s.norms:
        found.gains[n].to_ones(model.get_submodule(n))


def _record(model: nn.Module, report: RotationReport, found: Streams) -> None:
    """The section says the model is rotated (and no longer centres what the rotation moved into weights). A
    model without one (RMSNorm already) stays its own architecture: its config's `normswap_rotations`, which
    transformers keeps as an attribute and computes nothing from, says what was done."""
    entry = {"method": report.method, "seed": report.seed, "widths": [s["width"] for s in report.streams],
             "untied": report.untied, "unrotated": sorted(report.unrotated),
             **({"heads": report.heads["width"]} if report.heads else {}),
             **({"online": [o["layer"] for o in report.online]} if report.online else {})}
    record = section(model)
    if record is None:
        if has_config(model):
            model.config.normswap_rotations = [*getattr(model.config, "normswap_rotations", []), entry]
        return
    moved = {w.target.name for s in found.streams for w in s.writers if w.centre} | \
        {n for s in found.streams for n in s.biased}   # now in the weights
    fixes = {n: spec for n, spec in record.get("output_fixes", {}).items() if n not in moved}
    fixes.update({n: describe_fix(model.get_submodule(n)) for n in [*report.unrotated,
                                                                   *(o["layer"] for o in report.online)]})
    rotations = record.get("rotations", []) + [entry]
    new = {**record, "output_fixes": fixes, "rotations": rotations,
           "added_biases": sorted({*record.get("added_biases", []), *report.added_biases})}
    if report.not_preserved:
        new["not_preserved"] = {**record.get("not_preserved", {}), **report.not_preserved}
    set_section(model, new)

