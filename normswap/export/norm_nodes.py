"""The norms an export must show as fused nodes: which norms a model's forward calls (by class, or by what a
module computes), and the check of those against the norm nodes in onnxruntime's optimised graph."""
from __future__ import annotations

import torch
from torch import nn

from normswap.errors import NormswapError
from normswap.export import fuse, translate, wrap
from normswap.models.introspect import is_rms_norm
from normswap.surgery.probe import computes_rms_norm


def check_fused(report, n: dict[str, int], repeats: dict[str, int] | None = None,
                constant: dict[str, int] | None = None) -> None:
    """One fused node per norm: `n` norms ("lowered": normswap's own, exported as one node; "rmsnorm": those and
    every other RMSNorm, by class or by what it computes, which onnxscript or onnxruntime may fuse or leave op by
    op; "layernorm"), less the `repeats` of another's computation (`norm_calls`), vs the nodes in the optimised
    graph: every lowered norm fused, no more fused RMS nodes than RMSNorms, one LayerNormalization per LayerNorm;
    a norm of a `constant` input (`constant_calls`) may be folded away."""
    repeats, constant = repeats or {}, constant or {}
    want = {k: n.get(k, 0) - repeats.get(k, 0) for k in KINDS}
    rms_nodes = sum(report.fused.get(k, 0) for k in fuse.RMS_OPS)
    ln_nodes = sum(report.fused.get(k, 0) for k in fuse.LN_OPS)
    if not want["lowered"] - constant.get("lowered", 0) <= rms_nodes <= want["rmsnorm"] or \
            not want["layernorm"] - constant.get("layernorm", 0) <= ln_nodes <= want["layernorm"]:
        shared = f" ({sum(repeats.values())} of them computing what another does)" if any(repeats.values()) else ""
        rms = (f"{n['rmsnorm']} RMSNorm" if n.get("lowered", 0) == n["rmsnorm"] else
               f"{n['rmsnorm']} RMSNorm ({n.get('lowered', 0)} of them normswap's)")
        raise NormswapError(f"fused norm nodes do not match the model: {rms} vs {rms_nodes} "
                            f"fused RMS nodes, {n['layernorm']} LayerNorm vs {ln_nodes} LayerNormalization nodes"
                            + shared)


def _norm_kind(module: nn.Module) -> str | None:
    """"lowered" (a norm export lowers to one node), "rmsnorm" (another RMSNorm: by its class, or a leaf module
    whose 1-D parameters compute one, whatever its name), "layernorm", or None."""
    if translate.fusable(module):
        return "lowered"
    if is_rms_norm(module):
        return "rmsnorm"
    if isinstance(module, nn.LayerNorm):
        return "layernorm"
    own = list(module.parameters(recurse=False))
    if next(module.children(), None) is None and own and all(p.dim() == 1 for p in own) \
            and len({p.shape[0] for p in own}) == 1 and computes_rms_norm(module, own[0].shape[0]):
        return "rmsnorm"
    return None


def norm_kinds(model: nn.Module) -> dict[nn.Module, str]:
    """Every norm of `model` and its kind (`_norm_kind`: some found by calling a copy of the module)."""
    return {m: kind for m in model.modules() if (kind := _norm_kind(m)) is not None}


KINDS = ("lowered", "rmsnorm", "layernorm")


def _kinds(kind: str) -> tuple[str, ...]:
    return ("lowered", "rmsnorm") if kind == "lowered" else (kind,)   # a lowered norm is an RMSNorm too


@torch.no_grad()
def _calls(model: nn.Module, batch: dict, kinds: dict[nn.Module, str]) -> list[tuple[str, nn.Module, object]]:
    """(kind, module, first argument) of each norm call of `model(**batch)` among `kinds`, in order."""
    calls = []
    handles = [m.register_forward_hook(lambda mod, args, _, kind=kind: calls.append((kind, mod, args[0] if args
                                                                                     else None)))
               for m, kind in kinds.items()]
    try:
        model(**batch)
    finally:
        for h in handles:
            h.remove()
    return calls


def norm_calls(model: nn.Module, batch: dict, kinds: dict[nn.Module, str] | None = None) \
        -> tuple[dict[str, int], dict[str, int]]:
    """({kind: calls}, {kind: repeats}) of the norms `model(**batch)` calls, kinds "lowered" (normswap's own: one
    fused RMS node each), "rmsnorm" (those and any other RMSNorm: fused or left op by op) and "layernorm" (a norm
    called twice is two nodes; one never called, none). A repeat computes what
    an earlier call computed: the same input tensor, the same kind, eps and weight values (a parallel block's two
    norms once a rotation set both gains to 1); the exporter's common-subexpression elimination keeps one node.
    `kinds`: `norm_kinds(model)`, where the caller has it already."""
    counts, repeats = dict.fromkeys(KINDS, 0), dict.fromkeys(KINDS, 0)
    seen = set()   # the calls' inputs are held in the list until the end: no later tensor reuses an address seen
    for kind, module, x in _calls(model, batch, norm_kinds(model) if kinds is None else kinds):
        for k in _kinds(kind):
            counts[k] += 1
        if not isinstance(x, torch.Tensor):
            continue
        w = getattr(module, "weight", None)
        key = (kind, x.data_ptr(), tuple(x.shape), x.stride(), x.dtype, getattr(module, "eps", None),
               getattr(module, "variance_epsilon", None),
               None if w is None else (w.dtype, w.detach().cpu().numpy().tobytes()))
        for k in _kinds(kind):
            repeats[k] += key in seen
        seen.add(key)
    return counts, repeats


def constant_calls(model: nn.Module, batch: dict, kinds: dict[nn.Module, str] | None = None) -> dict[str, int]:
    """{kind: calls} of the norms whose input is the same whatever the batch's floating values (a norm of learnt
    latents or queries): onnxruntime folds such a norm into a constant where the graph's shapes allow it. `kinds`:
    as for `norm_calls`."""
    kinds = norm_kinds(model) if kinds is None else kinds
    g = torch.Generator().manual_seed(0)
    other = wrap.substitute(batch, iter([torch.randn(t.shape, generator=g).to(t) if t.is_floating_point() else t
                                         for _, t in wrap.flat_inputs(batch)]))
    constant = dict.fromkeys(KINDS, 0)
    for (kind, _, x), (_, _, y) in zip(_calls(model, batch, kinds), _calls(model, other, kinds)):
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.shape == y.shape and torch.equal(x, y):
            for k in _kinds(kind):
                constant[k] += 1
    return constant
