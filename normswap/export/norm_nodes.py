"""The norms an export must show as fused nodes: which norms a model's forward calls (by class, or by what a
module computes), and the check of those against the norm nodes in onnxruntime's optimised graph."""
from __future__ import annotations

import torch
from torch import nn

from normswap.errors import NormswapError
from normswap.export import fuse, translate
from normswap.models.introspect import is_rms_norm
from normswap.surgery.probe import computes_rms_norm


def check_fused(report, n: dict[str, int], repeats: dict[str, int] | None = None) -> None:
    """One fused node per norm: `n` norms ("lowered": normswap's own, exported as one node; "rmsnorm": those and
    every other RMSNorm, by class or by what it computes, which onnxscript or onnxruntime may fuse or leave op by
    op; "layernorm"), less the `repeats` of another's computation (`norm_calls`), vs the nodes in the optimised
    graph: every lowered norm fused, no more fused RMS nodes than RMSNorms, one LayerNormalization per LayerNorm."""
    repeats = repeats or {}
    want = {k: n.get(k, 0) - repeats.get(k, 0) for k in ("lowered", "rmsnorm", "layernorm")}
    rms_nodes = sum(report.fused.get(k, 0) for k in fuse.RMS_OPS)
    ln_nodes = sum(report.fused.get(k, 0) for k in fuse.LN_OPS)
    if not want["lowered"] <= rms_nodes <= want["rmsnorm"] or ln_nodes != want["layernorm"]:
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


def _norm_kinds(model: nn.Module) -> dict[nn.Module, str]:
    return {m: kind for m in model.modules() if (kind := _norm_kind(m)) is not None}


@torch.no_grad()
def norm_calls(model: nn.Module, batch: dict) -> tuple[dict[str, int], dict[str, int]]:
    """({kind: calls}, {kind: repeats}) of the norms `model(**batch)` calls, kinds "lowered" (normswap's own: one
    fused RMS node each), "rmsnorm" (those and any other RMSNorm: fused or left op by op) and "layernorm" (a norm
    called twice is two nodes; one never called, none). A repeat computes what
    an earlier call computed: the same input tensor, the same kind, eps and weight values (a parallel block's two
    norms once a rotation set both gains to 1); the exporter's common-subexpression elimination keeps one node."""
    counts, repeats = {"lowered": 0, "rmsnorm": 0, "layernorm": 0}, {"lowered": 0, "rmsnorm": 0, "layernorm": 0}
    seen, inputs = set(), []   # inputs held until the forward ends: no later tensor reuses an address seen

    def counter(kind: str):
        kinds = ("lowered", "rmsnorm") if kind == "lowered" else (kind,)   # a lowered norm is an RMSNorm too

        def hook(module, args, _):
            for k in kinds:
                counts[k] += 1
            x, w = (args[0] if args else None), getattr(module, "weight", None)
            if not isinstance(x, torch.Tensor):
                return
            key = (kind, x.data_ptr(), tuple(x.shape), x.stride(), x.dtype, getattr(module, "eps", None),
                   getattr(module, "variance_epsilon", None),
                   None if w is None else (w.dtype, w.detach().cpu().numpy().tobytes()))
            for k in kinds:
                repeats[k] += key in seen
            seen.add(key)
            inputs.append(x)
        return hook
    handles = [m.register_forward_hook(counter(kind)) for m, kind in _norm_kinds(model).items()]
    try:
        model(**batch)
    finally:
        for h in handles:
            h.remove()
    return counts, repeats
