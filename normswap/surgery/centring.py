"""Output fixes: centre a module's output over the last dim, multiply it by a matrix (a rotation's) and/or add
a bias after it (input fixes: centre the first input of a block instead).

The exact conversion needs these where no weight edit can do the job (a tied embedding, BLOOM's
embedding norm, a headless model's final norm, Whisper's encoder stream; see `exact`). They are part of the
module's own forward (its class swapped for `fixes.fixed_class`, no hook), defined in `folder.portable`, the
module every converted folder ships, so that what the conversion installs and what loading re-applies (in
normswap and in plain transformers) is one piece of code.
"""
from __future__ import annotations

import contextlib

from torch import nn

from normswap.folder.portable import ONLINE
from normswap.folder.fixes import Fixed, add_input_fix, add_output_fix, centre_input, fix_input, fixed, fixed_class, \
    unfixed_class

__all__ = ["add_input_fix", "add_output_fix", "centre_input", "describe_fix", "fixed", "input_fixes_first"]


def describe_fix(module: nn.Module) -> dict:
    """What the section's `output_fixes` records for a module the fixes above were put on (the shipped file
    only applies them)."""
    bias, matrix = getattr(module, "normswap_bias", None), getattr(module, "normswap_matrix", None)
    spec = {"centre": getattr(module, "normswap_centre", False), "bias": 0 if bias is None else int(bias.numel())}
    spec.update({"matrix": int(matrix.shape[0])} if matrix is not None else {})   # a rotation's (format 3)
    signs, factor = (module._parameters.get(k) for k in ONLINE)
    spec.update({"online": int(signs.numel()), "online_factor": int(factor.shape[0])} if signs is not None else {})
    if not getattr(module, "normswap_centre_input", False):
        return spec
    m = getattr(module, "normswap_input_matrix", None)
    return {**spec, "input": True, **({"input_matrix": int(m.shape[0])} if m is not None else {})}


@contextlib.contextmanager
def input_fixes_first(model: nn.Module):
    """Within the block, each input fix runs as a forward pre-hook registered now (`fix_input`), ahead of the
    pre-hooks registered after it, instead of inside its module's forward: a trace's pre-hook on that block then
    reads the stream entering it as the block receives it, centred (an "entry"), as it did before any edit."""
    moved = [m for m in model.modules() if isinstance(m, Fixed) and m.normswap_fixes[1]]
    handles = []
    try:
        for m in moved:
            m.__class__ = fixed_class(unfixed_class(m), m.normswap_fixes[0], False)
            handles.append(m.register_forward_pre_hook(fix_input, with_kwargs=True))
        yield
    finally:
        for h in handles:
            h.remove()
        for m in moved:
            m.__class__ = fixed_class(unfixed_class(m), m.normswap_fixes[0], True)
