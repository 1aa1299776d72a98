"""Exact LayerNorm -> RMSNorm conversion for pre-LN transformers: methods "exact" and "auto".

Why it is exact. LN(x) = g*(x - mean x)/sqrt(var x + eps) + b. If every vector added to the residual
stream has zero mean over the hidden dim, every norm input has mean 0, so var x = mean(x^2) and
LN(x) = RMSNorm_g(x) + b with the same eps. Hence, driven by a per-architecture adapter:
1. centre the stream writers: token/position embedding rows (or an input projection) and the attention
   and MLP output projections along their output dim, biases included (Conv1D stores (in, out));
2. fold each norm bias into the layers reading that norm, c' = c + W b, creating a zero bias where there
   is none (listed in added_biases); the final norm's bias goes into the head (or OPT's project_out).
Arithmetic in float64, results stored in the model's dtype.

Tied embeddings. If lm_head.weight is E, centring E's rows changes the logits by -m_v * sum(y_t)
(m_v: mean of row v, y_t: final norm output): it depends on the vocabulary entry, so it is not a
softmax-invariant per-position shift, and sum(y_t) is not zero for a general gain. So a tied E is left
as is and its *output* is centred at lookup instead (an output fix, see `centring`): the head keeps E,
the tie and the parameter count; the cost is one mean subtraction per input token. Untied embeddings
are centred in place. Inputs passed as `inputs_embeds` must come from `get_input_embeddings()`.

BLOOM's word_embeddings_layernorm sits between the embedding and the stream: its input is centred as
above, but its output g*x_hat + b *is* the stream's first writer and has no zero mean for any gain, so
its output is centred and its bias kept as centred(b) after it (same parameter count as the LayerNorm).
A headless model's final norm keeps its bias after it the same way, without centring.

What changes: hidden states inside the model are the centred originals; logits (a headless model's last
hidden state) are unchanged. Post-LN models (BERT...) have no exact form and are refused.

Verification: no copy of the model is made. Before any weight is edited, the model's main outputs on
sample inputs are recorded in fp32 (`parity.reference_outputs`); a source whose outputs are NaN/inf is
refused then, untouched. Once `convert` has swapped the norms, the converted model runs on the same
inputs and a max relative error above TOLERANCE, or any non-finite output, raises NormswapError:
1e-4 for fp32 models; fp16/bf16 models are cast to fp32 in place for both runs and cast back (a
lossless round trip; peak memory is then the fp32 model), and since their rewritten weights are rounded
when stored (measured up to ~7e-4 / ~5e-3) the tolerance is 2e-3 / 2e-2.
When verification fails the in-memory model stays converted (centred, biases folded, norms swapped,
config.normswap filled): discard it or reload; the CLI saves only after success.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from normswap.errors import NormswapError
from normswap.norms import PartialRMSNorm
from normswap.parity import Reference, compare_to, reference_outputs
from normswap.surgery.adapters import NotExact, adapter_for
from normswap.surgery.centring import add_output_fix, describe_fix
from normswap.surgery.methods import MethodResult, naive, register_method
from normswap.surgery.walk import NormSite, ensure_bias

TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@dataclass
class Plan:
    consumers: dict[str, list[str]]   # norm -> layers reading it ([]: nothing, keep its bias after it)
    writers: list[str]                # block layers writing the stream
    embeddings: list[str]             # entry writers (or the embed norm's inputs)
    embed_norm: str | None


def _is_linear(layer: nn.Module) -> bool:
    return isinstance(layer, nn.Linear) or type(layer).__name__ == "Conv1D"  # transformers' (in, out) layer


def _heads(model: nn.Module, backbone: nn.Module) -> list[str]:
    """Linear heads reading the backbone's output; [] for a headless model."""
    if backbone is model:
        return []
    others = [(n, m) for n, m in model.named_children() if m is not backbone]
    unknown = [n for n, m in others if not isinstance(m, (nn.Linear, nn.Dropout))]
    if unknown:
        raise NotExact(f"head '{unknown[0]}' ({type(model.get_submodule(unknown[0])).__name__}) is not a Linear")
    return [n for n, m in others if isinstance(m, nn.Linear)]


def plan(model: nn.Module, sites: list[NormSite]) -> Plan:
    """Resolve the model's adapter to module names; NotExact if it does not apply."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "base_model"):
        raise NotExact("not a Hugging Face model (no config)")
    arch = adapter_for(config)
    backbone = model.base_model
    prefix = "" if backbone is model else model.base_model_prefix + "."
    names = dict(model.named_modules())

    def find(path: str) -> str:
        if path not in names:
            raise NotExact(f"the {config.model_type} adapter expects a module '{path}' that this model lacks")
        return path

    consumers: dict[str, list[str]] = {}
    writers: list[str] = []
    for i in range(len(model.get_submodule(find(prefix + arch.blocks)))):
        block = f"{prefix}{arch.blocks}.{i}."
        consumers.update({block + n: [find(block + u) for u in users]
                          for n, users in arch.norms.items() if block + n in names})
        writers += [find(block + w) for w in arch.writers]
    consumers[find(prefix + arch.final_norm)] = ([find(prefix + c) for c in arch.final_consumers]
                                                 or _heads(model, backbone))
    embed_norm = find(prefix + arch.embed_norm) if arch.embed_norm else None
    if embed_norm:
        consumers[embed_norm] = []
    for s in sites:
        if s.name not in consumers:
            raise NotExact(f"the {config.model_type} adapter does not cover the norm {s.name}")
    embeddings = [find(prefix + e) for e in arch.embeddings]
    # Check every layer before touching any, so a refusal leaves the model as it was.
    for name in writers + embeddings + [u for users in consumers.values() for u in users]:
        if not (_is_linear(names[name]) or name in embeddings and isinstance(names[name], nn.Embedding)):
            raise NotExact(f"{name} is a {type(names[name]).__name__}, not a Linear/Conv1D layer")
    return Plan(consumers, writers, embeddings, embed_norm)


def exact_support(model: nn.Module, sites: list[NormSite]) -> str | None:
    """None if the exact method applies to `sites` of `model`, else the reason it does not."""
    try:
        plan(model, sites)
    except NotExact as e:
        return str(e)
    return None


def _update(param: torch.Tensor, value: torch.Tensor) -> None:
    param.copy_(value.to(param.dtype))


# fp64 working copies are made a slice at a time: a whole fp64 vocabulary matrix would be twice the
# size of the fp32 one and set the peak memory of the whole conversion. 64 MB slices: above glibc's
# largest mmap threshold (32 MB), so each is returned to the OS when freed; measured, 32 MB slices were
# kept on the heap and the process grew by ~250 MB anyway.
_CHUNK = 1 << 23   # elements per fp64 slice (64 MB)


def _slices(w: torch.Tensor, dim: int):
    """Views of w along `dim`, each of about _CHUNK elements (every slice keeps the other dim whole)."""
    step = max(1, _CHUNK // max(1, w.shape[1 - dim]))
    return w.split(step, dim)


def _centre_writer(layer: nn.Module) -> None:
    """Make every output of `layer` zero-mean: Linear (out, in) along dim 0; Conv1D (in, out) and
    Embedding (rows) along dim 1."""
    dim = 0 if isinstance(layer, nn.Linear) else 1
    for part in _slices(layer.weight, 1 - dim):   # whole along `dim`: each mean sees all its values
        d = part.double()
        _update(part, d - d.mean(dim, keepdim=True))
    if isinstance(layer, nn.Embedding):
        return
    if getattr(layer, "bias", None) is not None:
        _update(layer.bias, layer.bias.double() - layer.bias.double().mean())


def _fold(layer: nn.Module, b: torch.Tensor) -> bool:
    """bias += W b for a consumer of a norm whose bias is b; True if the bias had to be created."""
    if isinstance(layer, nn.Linear):   # (out, in): row blocks of W b
        shift = torch.cat([part.double() @ b for part in _slices(layer.weight, 0)])
    else:                              # Conv1D (in, out): b W summed over row blocks
        n = max(1, _CHUNK // layer.weight.shape[1])
        shift = sum(b[i:i + n] @ layer.weight[i:i + n].double() for i in range(0, layer.weight.shape[0], n))
    bias, created = ensure_bias(layer)
    _update(bias, bias.double() + shift)
    return created


def _tied(model: nn.Module, param: nn.Parameter) -> bool:
    return sum(p is param for _, p in model.named_parameters(remove_duplicate=False)) > 1


class ExactResult(MethodResult):
    """A MethodResult whose `after_swap(model, report)` finishes and verifies the swapped model."""

    def __init__(self, reference: Reference, fixes: dict, **kw):
        super().__init__("exact", **kw)
        self.reference, self.fixes = reference, fixes

    def after_swap(self, model: nn.Module, report) -> None:
        for name, (centre, bias) in self.fixes.items():
            add_output_fix(model.get_submodule(name), centre, bias)
        model.config.normswap["output_fixes"] = {**model.config.normswap.get("output_fixes", {}),
                                                 **{n: describe_fix(model.get_submodule(n)) for n in self.fixes}}
        partial = any(isinstance(model.get_submodule(r.name), PartialRMSNorm) for r in report.converted)
        if partial:
            report.warnings.append("pRMSNorm estimates the RMS from a subset of features: biases are folded "
                                   "exactly but the result is approximate (verification not enforced)")
        report.verification = verify(self.reference, model, enforce=not partial)
        self.reference = None  # free the recorded outputs


@contextmanager
def _fp32_eval(model: nn.Module):
    """Run `model` with its fp16/bf16 tensors in fp32 and in eval mode, in place; restore dtypes and mode.

    fp16/bf16 -> fp32 -> fp16/bf16 is exact, so the model comes back bit-identical without a copy."""
    half = [t for t in [*model.parameters(), *model.buffers()] if t.dtype in (torch.float16, torch.bfloat16)]
    dtypes, training = [t.dtype for t in half], model.training
    try:
        for t in half:
            t.data = t.data.float()
        yield model.eval()
    finally:
        for t, dtype in zip(half, dtypes):
            t.data = t.data.to(dtype)
        model.train(training)


def _reference(model: nn.Module) -> Reference:
    """The unedited model's fp32 outputs; a source that gives NaN/inf cannot be called exact."""
    with _fp32_eval(model):
        ref = reference_outputs(model)
    if ref.nonfinite:
        raise NormswapError(f"the source model gives {ref.nonfinite} non-finite (NaN/inf) {ref.output} values on "
                            "sample inputs: it is broken, so no conversion of it can be verified as exact")
    return ref


def verify(reference: Reference, model: nn.Module, enforce: bool = True) -> dict:
    """Compare the converted model's outputs with the `reference` recorded before editing, in fp32 and
    eval mode (only the rounding of the rewritten weights counts); NormswapError beyond TOLERANCE (when
    `enforce`) and on any non-finite output (always)."""
    dtype = next(model.parameters()).dtype
    with _fp32_eval(model):
        parity = compare_to(reference, model)
    tol = TOLERANCE.get(dtype, 1e-4)
    if parity.nonfinite:
        raise NormswapError(f"exact conversion failed verification: the converted model gives {parity.nonfinite} "
                            f"non-finite (NaN/inf) {parity.output} values; nothing was saved")
    if enforce and not parity.max_rel <= tol:  # also catches NaN
        raise NormswapError(f"exact conversion failed verification: max relative {parity.output} error "
                            f"{parity.max_rel:.2e} > {tol:g} ({str(dtype)[6:]}); nothing was saved")
    return {**parity.to_dict(), "dtype": str(dtype)[6:], "tolerance": tol, "enforced": enforce}


@torch.no_grad()
def convert_exact(model: nn.Module, sites: list[NormSite], p: Plan) -> ExactResult:
    reference = _reference(model)   # before any edit: outputs, not a copy
    fixes: dict[str, tuple[bool, torch.Tensor | None]] = {}
    for name in p.embeddings:
        layer = model.get_submodule(name)
        if isinstance(layer, nn.Embedding) and _tied(model, layer.weight):
            if not hasattr(layer, "normswap_centre"):  # not centred by an earlier (filtered) conversion
                fixes[name] = (True, None)   # see module docstring: centre at lookup, keep the tie
        else:
            _centre_writer(layer)
    for name in p.writers:
        _centre_writer(model.get_submodule(name))
    if p.embed_norm:
        fixes[p.embed_norm] = (True, None)  # its output enters the stream: centre it even if kept as LN
    bias: dict[str, str] = {}
    added: list[str] = []
    for s in sites:
        b = None if s.bias is None else s.bias.detach().double()
        if b is None or not b.any():
            bias[s.name] = "none"
            continue
        bias[s.name] = "folded"
        if p.consumers[s.name]:
            added += [u for u in p.consumers[s.name] if _fold(model.get_submodule(u), b)]
        else:
            centre = s.name == p.embed_norm
            fixes[s.name] = (centre, b - b.mean() if centre else b)
    return ExactResult(reference, fixes, bias=bias, added_biases=added)


@register_method("exact")
def exact(model: nn.Module, sites: list[NormSite]) -> MethodResult:
    """Function-preserving: centre the residual writers, fold norm biases, verify after the swap."""
    try:
        p = plan(model, sites)
    except NotExact as e:
        raise NormswapError(f"cannot convert exactly: {e}; alternatives: --method naive (drops the biases; "
                            "heal by fine-tuning) or --method auto") from None
    return convert_exact(model, sites, p)


@register_method("auto")
def auto(model: nn.Module, sites: list[NormSite]) -> MethodResult:
    """exact where an adapter applies, otherwise naive with a warning."""
    try:
        p = plan(model, sites)
    except NotExact as e:
        result = naive(model, sites)
        result.warnings.append(f"no exact conversion: {e}; fell back to naive, which drops LayerNorm biases "
                               "and changes outputs: measure the change and heal (fine-tune)")
        return result
    return convert_exact(model, sites, p)
