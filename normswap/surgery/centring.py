"""Output fixes: centre a module's output over the last dim and/or add a bias after it (input fixes:
centre the first input of a block instead).

The exact conversion needs these where no weight edit can do the job (a tied embedding, BLOOM's
embedding norm, a headless model's final norm; see `exact`). A forward hook keeps the module, its
parameter names and any weight tying intact; the bias is a parameter `normswap_bias` on the module so it
is saved with the weights. `from_pretrained` re-applies fixes listed in config.normswap["output_fixes"].
"""
from __future__ import annotations

import torch
from torch import nn


def _centred(x: torch.Tensor) -> torch.Tensor:
    """x minus its mean over the last dim (the mean taken in fp32)."""
    return x - x.float().mean(-1, keepdim=True).to(x.dtype)


def fixed(out: torch.Tensor, centre: bool, bias: torch.Tensor | None) -> torch.Tensor:
    """What an output fix returns for `out`: centred if `centre`, plus `bias` if given."""
    if centre:
        out = _centred(out)
    return out if bias is None else out + bias


def _fix_output(module: nn.Module, args, out: torch.Tensor) -> torch.Tensor:
    return fixed(out, module.normswap_centre, getattr(module, "normswap_bias", None))


def add_output_fix(module: nn.Module, centre: bool, bias: torch.Tensor | None = None, width: int = 0) -> None:
    """Make `module` return centre(out) + bias. bias=None with width>0 creates a zero bias (for loading)."""
    if hasattr(module, "normswap_centre"):
        raise ValueError("module already has an output fix")
    if bias is None and width:
        bias = torch.zeros(width)
    if bias is not None:
        ref = next(module.parameters(), None)
        kw = dict(device=ref.device, dtype=ref.dtype) if ref is not None else {}
        module.normswap_bias = nn.Parameter(bias.detach().to(**kw).clone())
    module.normswap_centre = bool(centre)
    module.register_forward_hook(_fix_output)


def centre_input(module: nn.Module, args, kwargs):
    """A forward pre-hook (with kwargs) that centres the first tensor a module is called with."""
    if args:
        return (_centred(args[0]), *args[1:]), kwargs
    key = next(k for k, v in kwargs.items() if isinstance(v, torch.Tensor))
    return args, {**kwargs, key: _centred(kwargs[key])}


def add_input_fix(module: nn.Module) -> None:
    """Centre the first tensor `module` is called with (a stream entering a block after a non-linearity)."""
    if getattr(module, "normswap_centre_input", False):
        raise ValueError("module already has an input fix")
    module.normswap_centre_input = True
    module.register_forward_pre_hook(centre_input, with_kwargs=True)


def describe_fix(module: nn.Module) -> dict:
    """What config.normswap records for a fixed module."""
    bias = getattr(module, "normswap_bias", None)
    spec = {"centre": getattr(module, "normswap_centre", False), "bias": 0 if bias is None else int(bias.numel())}
    return {**spec, "input": True} if getattr(module, "normswap_centre_input", False) else spec


def apply_output_fixes(model: nn.Module, fixes: dict[str, dict]) -> None:
    """Re-create recorded output fixes (zero biases; the weights file fills them) and input fixes."""
    for name, spec in fixes.items():
        if spec.get("input"):
            add_input_fix(model.get_submodule(name))
        if spec["centre"] or spec["bias"]:
            add_output_fix(model.get_submodule(name), spec["centre"], width=spec["bias"])
