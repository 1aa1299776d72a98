"""The structure a section records, applied: norms, added biases, and the fixes a conversion or a rotation puts
in a module's own forward (output fixes: centre, matrix, bias; input fixes: centre, matrix; online rotations of
a layer's input). `rebuild` turns a freshly built original architecture into the converted one.

Shipped after `portable.py` in every folder's modeling_normswap.py, from the line SHIPPED_FROM on: standard
library and torch only; normswap runs the same functions (`rebuild.from_pretrained`, `restore`, the lazy
conversion's verification, and the conversion itself installs its fixes with them).
"""
from __future__ import annotations

from normswap.folder.portable import ONLINE, build_norm, check_section_hash, ensure_bias, local_names, validate

# ---- shipped from here: the fixes and the rebuild -------------------------------------------------------------
import functools  # noqa: E402  (the shipped file concatenates modules: each brings its own imports)
import inspect  # noqa: E402
import warnings  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

def centred(x: torch.Tensor) -> torch.Tensor:
    """x minus its mean over the last dim (the mean taken in fp32, or fp64 for fp64)."""
    if x.dtype in (torch.float32, torch.float64):   # two ops, no casts: an output fix runs per token in decode
        return torch.sub(x, x.sum(-1, keepdim=True), alpha=1.0 / x.shape[-1])
    return x - x.mean(-1, keepdim=True, dtype=torch.float32).to(x.dtype)


def fixed(out: torch.Tensor, centre: bool, bias: torch.Tensor | None, matrix: torch.Tensor | None = None):
    """What an output fix returns for `out`: centred if `centre`, times `matrix` if given, plus `bias` if given."""
    out = centred(out) if centre else out
    out = out if matrix is None else out @ matrix.to(out.dtype)
    return out if bias is None else out + bias


def _fix_output(module: nn.Module, out: torch.Tensor) -> torch.Tensor:
    p = module._parameters   # not getattr(m, name, None): an absent name raises an AttributeError per call
    return fixed(out, module.normswap_centre, p.get("normswap_bias"), p.get("normswap_matrix"))


class Fixed:
    """What every class `fixed_class` makes derives from first: a module whose own forward applies its fixes."""

    normswap_base: type                      # the module's own class
    normswap_fixes: tuple[bool, bool] = (False, False)   # (output, input)

    def __reduce_ex__(self, protocol):   # pickle and deepcopy: the class is made again, not looked up by its name
        return fixed_instance, (self.normswap_base, *self.normswap_fixes), self.__getstate__()


def fixed_instance(base: type, output: bool, input: bool) -> nn.Module:
    """An empty instance of `fixed_class(base, output, input)` (unpickling fills its state)."""
    cls = fixed_class(base, output, input)
    return cls.__new__(cls)


@functools.cache   # one class per module class and kind of fix: the fixed modules of a model share it
def fixed_class(base: type, output: bool, input: bool) -> type:
    """`base` with the fixes in its forward (`fixed_call`). No hook: the hot path is one Python call more than the
    original's (hooks send every call of the module through torch's slower path). Same name, so that
    transformers' checks by class name (`_no_split_modules`) and by `isinstance` still hold."""
    def forward(self, *args, **kwargs):
        return fixed_call(self, base.forward, args, kwargs)

    forward.__signature__ = inspect.signature(base.forward)   # as the original's (`first_input` reads it)
    return type(base.__name__, (Fixed, base), {"forward": forward, "__module__": base.__module__,
                                               "__qualname__": base.__qualname__, "normswap_base": base,
                                               "normswap_fixes": (output, input)})


def fixed_call(module: nn.Module, inner, args: tuple, kwargs: dict):
    """inner(module, *args, **kwargs) (the module's own class's forward, or one export puts in its place) between
    the module's fixes: its first input fixed (`fix_input`) before, its output fixed (`fixed`, reading its
    `normswap_*` attributes at each call) after."""
    output, input = module.normswap_fixes
    if input:
        args, kwargs = fix_input(module, args, kwargs)
    out = inner(module, *args, **kwargs)
    return _fix_output(module, out) if output else out


def unfixed_class(module: nn.Module) -> type:
    """The module's class without its fixes (its own where it has none)."""
    return module.normswap_base if isinstance(module, Fixed) else type(module)


def _add_fix(module: nn.Module, output: bool = False, input: bool = False) -> None:
    """Swap `module`'s class for its fixed class, with this fix added to those it has (its parameters, their names
    and any tying stay: the instance is the same)."""
    has = module.normswap_fixes if isinstance(module, Fixed) else (False, False)
    module.__class__ = fixed_class(unfixed_class(module), has[0] or output, has[1] or input)


def add_output_fix(module: nn.Module, centre: bool, bias: torch.Tensor | None = None, width: int = 0,
                   matrix: torch.Tensor | None = None, side: int = 0) -> None:
    """Make `module` return centre(out) @ matrix + bias (in its own forward: `fixed_class`). bias=None with width>0
    creates a zero bias `normswap_bias`, matrix=None with side>0 a zero side x side `normswap_matrix` (for loading:
    the weights fill them)."""
    if hasattr(module, "normswap_centre"):
        raise ValueError("module already has an output fix")
    _own(module, "normswap_bias", torch.zeros(width) if bias is None and width else bias)
    _own(module, "normswap_matrix", torch.zeros(side, side) if matrix is None and side else matrix)
    module.normswap_centre = bool(centre)
    _add_fix(module, output=True)


def first_input(module: nn.Module, args, kwargs) -> str | int | None:
    """Where the first tensor `module` is called with is: 0 (its first positional argument), else its first
    tensor keyword argument in its forward's order (however the caller ordered them); None if none."""
    if args:
        return 0
    order = list(inspect.signature(module.forward).parameters)
    keys = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
    return min(keys, key=lambda k: order.index(k) if k in order else len(order), default=None)


def _own(module: nn.Module, attr: str, value: torch.Tensor | None) -> None:
    """`value` (unless None) as the module's parameter `attr`, in its first parameter's dtype and device."""
    ref = next(module.parameters(), value)
    if value is not None:
        setattr(module, attr, nn.Parameter(value.detach().to(ref.device, ref.dtype).clone()))


def centre_input(module: nn.Module, args, kwargs):
    """(args, kwargs) with the first tensor a module is called with (`first_input`) centred, then multiplied by the
    module's `normswap_input_matrix` where it has one (a rotation's); also a forward pre-hook (with kwargs)."""
    m = module._parameters.get("normswap_input_matrix")
    return _on_first_input(module, args, kwargs, lambda x: fixed(x, True, None, m))


def _on_first_input(module: nn.Module, args, kwargs, f):
    """(args, kwargs) with the first tensor `module` is called with (`first_input`) replaced by f(it)."""
    key = first_input(module, args, kwargs)
    if key == 0:
        return (f(args[0]), *args[1:]), kwargs
    return args, {**kwargs, key: f(kwargs[key])}


def add_input_fix(module: nn.Module, side: int = 0) -> None:
    """Centre the first tensor `module` is called with (a stream entering a block after a non-linearity), in its own
    forward (`fixed_class`); side>0 creates a zero side x side `normswap_input_matrix` to multiply it by (for
    loading: the weights fill it)."""
    if getattr(module, "normswap_centre_input", False):
        raise ValueError("module already has an input fix")
    _own(module, "normswap_input_matrix", torch.zeros(side, side) if side else None)
    module.normswap_centre_input = True
    _add_fix(module, input=True)


def online_rotated(x: torch.Tensor, signs: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """x·H over the last dim (width n), H = diag(signs)·(S ⊗ F)·c: S Sylvester's Hadamard matrix of order p = n / m,
    applied as a fast Walsh-Hadamard transform (log2 p butterflies of adds), F the m x m `factor` (±1 entries: a
    Hadamard matrix, stored exactly in any dtype; or an orthogonal one, p = 1), c = 1 / sqrt(p·|F's first row|²).
    In fp32 (fp64 for fp64), returned in x's dtype. Folding W <- W·H runs this on W's rows, in fp64."""
    m, n = factor.shape[0], x.shape[-1]
    p = n // m
    y = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
    f = factor.to(y.dtype)
    y = (y * signs.to(y.dtype)).reshape(-1, p, m)
    h = 1
    while h < p:   # butterflies: pairs of rows h apart -> (a + b, a - b)
        y = y.reshape(-1, p // (2 * h), 2, h, m)
        y = torch.stack((y[:, :, 0] + y[:, :, 1], y[:, :, 0] - y[:, :, 1]), 2)
        h *= 2
    y = (y.reshape(-1, p, m) @ f) * torch.rsqrt(f[0].pow(2).sum() * p)
    return y.reshape(x.shape).to(x.dtype)


def fix_input(module: nn.Module, args, kwargs):
    """(args, kwargs) with the first tensor a module is called with (`first_input`) centred where it has an input fix
    (`centre_input`), then rotated online where it has an online rotation (`online_rotated`: its weight holds W·H,
    so it computes what it did); also a forward pre-hook (with kwargs)."""
    if module.__dict__.get("normswap_centre_input", False):   # not getattr: an absent name raises per call
        args, kwargs = centre_input(module, args, kwargs)
    if ONLINE[0] not in (p := module._parameters):
        return args, kwargs
    return _on_first_input(module, args, kwargs, lambda x: online_rotated(x, p[ONLINE[0]], p[ONLINE[1]]))


def add_online_rotation(module: nn.Module, signs: torch.Tensor | None = None, factor: torch.Tensor | None = None,
                        width: int = 0, side: int = 0) -> None:
    """Rotate `module`'s input online by H in its own forward (`fix_input`), its `signs` and `factor` the parameters
    `normswap_online_signs` and `normswap_online_factor` (None: zeros of `width` and `side` x `side`, for loading:
    the weights fill them)."""
    if any(name in module._parameters for name in ONLINE):
        raise ValueError("module already has an online rotation")
    _own(module, ONLINE[0], torch.zeros(width) if signs is None else signs)
    _own(module, ONLINE[1], torch.zeros(side, side) if factor is None else factor)
    _add_fix(module, input=True)


def apply_structure(model: nn.Module, section: dict, make_norm=build_norm) -> None:
    """The module changes a section records, on the original architecture (new tensors are placeholders the
    weights fill): each norm replaced by make_norm(spec, old module), biases added, then the fixes (which may
    sit on a norm)."""
    section = local_names(section, model)
    for name, spec in section.get("norms", {}).items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, make_norm(spec, model.get_submodule(name)))
    for name in section.get("added_biases", []):
        ensure_bias(model.get_submodule(name))
    for name, spec in section.get("output_fixes", {}).items():
        if spec.get("input"):
            add_input_fix(model.get_submodule(name), spec.get("input_matrix", 0))
        if spec["centre"] or spec["bias"] or spec.get("matrix"):
            add_output_fix(model.get_submodule(name), spec["centre"], width=spec["bias"], side=spec.get("matrix", 0))
        if spec.get("online"):
            add_online_rotation(model.get_submodule(name), width=spec["online"], side=spec["online_factor"])


def rebuild(model: nn.Module, section, where: str, make_norm=build_norm, quiet: bool = False) -> None:
    """Turn a freshly built original architecture into the converted one: the section validated against the
    model, its checksum checked (the weights' once loaded), applied; warns of outputs not preserved unless `quiet`."""
    validate(section, where, model)
    check_section_hash(section, where)
    apply_structure(model, section, make_norm)
    if section.get("not_preserved") and not quiet:   # said on every load, in normswap and in plain transformers alike
        warnings.warn(f"{where}: this RMSNorm conversion keeps the original's outputs except "
                      + "; ".join(f"{k} ({why})" for k, why in section["not_preserved"].items()), stacklevel=2)
