"""Put an in-memory conversion back: the originals of only what its plan edits, kept before the edits, so that a
converted model that fails verification is the caller's model again (no copy of the model is made).

What a plan edits, per module it names (`steps`): its own parameters and buffers (values written in place, a
bias created), its class, hooks and `normswap_*` attributes (the output and input fixes); the norms swapped;
torch's fused-encoder flags (`norms.off_fast_path`); the model's normswap section. `Undo.restore` writes the kept values
back into the same tensor objects (references the caller holds, an optimizer's, stay valid), drops what was
created and puts every swapped norm back.
"""
from __future__ import annotations

from torch import nn

from normswap.folder.attached import clear_section, section, set_section
from normswap.norms import fast_path_flags
from normswap.surgery.steps import Centre, Fix, Fold, Scale, Step
from normswap.surgery.walk import NormSite, replace_module

HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs")


def edited(steps: list[Step]) -> set[str]:
    """The modules whose own tensors, hooks or attributes the steps change."""
    names: set[str] = set()
    for step in steps:
        if isinstance(step, Centre):
            names.add(step.target.module)
        elif isinstance(step, Fold):
            names.add(step.reader)
        elif isinstance(step, Scale):
            names |= {step.scale.module, step.into}
        elif isinstance(step, Fix):
            names.add(step.target)
    return names


class Undo:
    """The state of the modules a plan edits and of the norms it swaps, kept before any edit."""

    def __init__(self, model: nn.Module, steps: list[Step], sites: list[NormSite]):
        self.sites = list(sites)
        self.section = section(model)
        self.modules = {name: _kept(model.get_submodule(name)) for name in sorted(edited(steps))}
        self.flags = fast_path_flags(model)   # the swap turns torch's fused encoder path off

    def restore(self, model: nn.Module) -> None:
        for site in self.sites:
            replace_module(model, site.name, site.module)
        for name, kept in self.modules.items():
            _put_back(model.get_submodule(name), kept)
        for module, attr, value in self.flags:
            setattr(module, attr, value)
        if self.section is None:
            clear_section(model)
        else:
            set_section(model, self.section)


def _kept(module: nn.Module) -> dict:
    tensors = {k: None if t is None else (t, t.detach().clone()) for k, t in
               [*module._parameters.items(), *module._buffers.items()]}
    return {"class": type(module), "tensors": tensors, "params": dict(module._parameters),
            "buffers": dict(module._buffers),
            "hooks": {h: dict(getattr(module, h)) for h in HOOKS if hasattr(module, h)},
            "attrs": {k: v for k, v in vars(module).items() if k.startswith("normswap")}}


def _put_back(module: nn.Module, kept: dict) -> None:
    module.__class__ = kept["class"]
    for value in kept["tensors"].values():
        if value is not None:
            value[0].data.copy_(value[1])
    module._parameters.clear()
    module._parameters.update(kept["params"])
    module._buffers.clear()
    module._buffers.update(kept["buffers"])
    for h, hooks in kept["hooks"].items():
        getattr(module, h).clear()
        getattr(module, h).update(hooks)
    for k in [k for k in vars(module) if k.startswith("normswap")]:
        delattr(module, k)
    for k, v in kept["attrs"].items():
        setattr(module, k, v)

