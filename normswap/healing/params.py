"""What `heal` trains: the norm parameters, every parameter, or LoRA adapters (with the norm gains), and at
which learning rate."""
from __future__ import annotations

import importlib.util

from torch import nn

from normswap.models.introspect import norm_kind

DEFAULT_LR = {"norms": 1e-2, "all": 3e-4, "lora": 5e-3}


def default_train(model: nn.Module) -> str:
    """heal's mode for train="auto", by what the conversion changed (measured on the demo model, 200 steps,
    benchmarks/RESULTS.md): "norms" where every norm sees all its features (the gains remove 93% of the naive
    swap's KL to the original); where a pRMSNorm estimates the RMS from a few, the gains remove only 69%, so
    "lora" (93%, 1.3% of the parameters), or "all" (94%) where peft, which LoRA needs, is not installed."""
    partial = any(norm_kind(m) == "rmsnorm" and getattr(m, "p", None) not in (None, 1.0) for m in model.modules())
    if not partial:
        return "norms"
    return "lora" if importlib.util.find_spec("peft") is not None else "all"


def norm_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """Parameters of norm modules, plus the biases a conversion method added (they hold folded norm biases)."""
    out = {}
    for mname, m in model.named_modules():
        if norm_kind(m) is not None:
            for pname, p in m.named_parameters(recurse=False):
                out[f"{mname}.{pname}" if mname else pname] = p
    for mname in (getattr(model.config, "normswap", None) or {}).get("added_biases", []):
        out[f"{mname}.bias"] = model.get_submodule(mname).bias
    return out


def to_train(student, train: str, norms: dict, adapters, lora_norms: bool, lr: float) -> tuple[dict, dict]:
    """(name -> parameter to train, name -> its learning rate). With LoRA the norm gains keep their own rate."""
    if train == "all":
        chosen = dict(student.named_parameters())
    elif train == "norms":
        chosen = dict(norms)
    else:
        names = {id(p): n for n, p in student.named_parameters()}  # LoRA renamed the wrapped layers' parameters
        chosen = {names[id(p)]: p for p in adapters.params}
        if lora_norms:
            chosen.update({names[id(p)]: p for p in norms.values()})
    gains = {id(p) for p in norms.values()} if train == "lora" else set()
    return chosen, {n: (DEFAULT_LR["norms"] if id(p) in gains else lr) for n, p in chosen.items()}


def optimizer_groups(model: nn.Module, lrs: dict[str, float]) -> list[dict]:
    """AdamW parameter groups of the trainable parameters, one per learning rate (names as in the student:
    the FSDP copy keeps them)."""
    by_rate: dict[float, list] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            by_rate.setdefault(lrs[name], []).append(p)
    return [{"params": ps, "lr": rate} for rate, ps in by_rate.items()]
