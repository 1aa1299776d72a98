"""What rebuilds a saved conversion: normswap runs it, and so does every converted folder, as its own code.

One source for both loaders. normswap imports this module to rebuild its folders (`rebuild.from_pretrained`,
streaming's verification), and `save_pretrained` copies this file verbatim into each folder as modeling_normswap.py,
followed by generated subclasses of the original transformers classes, which transformers runs with
trust_remote_code=True. So it imports only the standard library and torch (and transformers, lazily), never
normswap; a test fails if the shipped copy differs from this file.

- `validate`: config.json's `normswap` section (format, types, ranges, named modules); `checksum.py` hashes it
  and the weights files' headers, `fingerprint.py` checks the loaded model's behaviour.
- `rebuild`: on a freshly built original architecture, the norms (made by a factory: the pure-PyTorch `build_norm`
  below by default; normswap passes `normswap.norms.build_norm`, whose modules use its fast kernels for the same
  arithmetic, held equal by a test), the added biases, output fixes (centre, matrix, bias) and input fixes.
- `checksum.py`, `fingerprint.py` and `shipped.py` follow this file in modeling_normswap.py (from their lines
  "# ---- shipped from here"), the last the transformers side (`NormswapMixin`).
"""
from __future__ import annotations

import functools
import hashlib
import inspect
import json
import math
import warnings

import torch
from torch import nn

# 2: `base` and `checksum`; 3: fixes may multiply by matrices (a rotation's), which 2's readers would ignore;
# 4: weights as the "normswap" variant (`checksum.py`), a behavioural fingerprint (`fingerprint.py`). Format 1 was
# what older normswaps recorded in memory, before a save completed it: never a folder normswap wrote.
FORMAT, FORMATS = 4, (2, 3, 4)
MATRIX_FORMAT, MATRICES = 3, ("matrix", "input_matrix")
# an output fix's online rotation of its input (`add_online_rotation`): format 4's readers before it refuse the keys
ONLINE_FORMAT, ONLINE_KEYS = 4, ("online", "online_factor")
ONLINE = ("normswap_online_signs", "normswap_online_factor")   # its parameters on the module
NORM_TYPES = ("rmsnorm", "prmsnorm")
KINDS = {int: "an integer", float: "a number", bool: "true/false", str: "a string", dict: "an object", list: "a list"}


class InvalidConversion(ValueError):
    """A folder or section that would not rebuild the converted model; the message is one line."""


# ---- the norms ---------------------------------------------------------------------------------------------

def partial_width(d: int, p: float | None) -> int:
    """Features pRMSNorm reads: ceil(p * d), at least 1, where p * d within 1e-12 of an integer is that
    integer (p=0.07, d=100 gives 7, as the decimal says)."""
    if p is None:
        return d
    x, n = p * d, round(p * d)
    return max(1, min(d, n if abs(x - n) <= 1e-12 * x else math.ceil(x)))


def pow2_floor(m: torch.Tensor) -> torch.Tensor:
    """The largest power of two <= m, at least 1, without bit-casts (a user's torch.onnx.export and OpenVINO
    take no view(dtype)): log2 may round across a power of two, so one step each way makes it exact."""
    m = m.clamp(min=1.0)
    p = torch.pow(2.0, torch.floor(torch.log2(m)).clamp(max=127.0))   # 2^128 is not a float32
    p = torch.where(p > m, p * 0.5, p)
    return torch.where(p * 2.0 <= m, p * 2.0, p)


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight over the last dim; squares and mean in fp32.

    Each row is first divided by the power of two below its max |x| (never scaled up): exact, so the
    same values, but no fp32 overflow of the squares for |x| > ~1.8e19. Same arithmetic as normswap's."""

    def __init__(self, normalized_shape: int, eps: float = 1e-6, elementwise_affine: bool = True,
                 p: float | None = None):
        super().__init__()
        self.normalized_shape, self.eps, self.p = int(normalized_shape), float(eps), p
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(self.normalized_shape))
        else:
            self.register_parameter("weight", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        k = partial_width(int(x.shape[-1]), self.p)  # pRMSNorm: the first k features (int: a traced width)
        xk = xf if k == x.shape[-1] else xf[..., :k]
        inv = 1.0 / pow2_floor(xk.detach().abs().amax(-1, keepdim=True))
        xf, xk, eps = xf * inv, xk * inv, self.eps * inv * inv
        y = xf / torch.sqrt(xk.pow(2).mean(-1, keepdim=True) + eps)
        if self.weight is not None:
            y = y * self.weight.float()
        return y.to(x.dtype).contiguous()   # as LayerNorm's: callers .view() it (Idefics3's pixel shuffle)

    def extra_repr(self) -> str:
        p = "" if self.p is None else f", p={self.p}"
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}{p}"


class PartialRMSNorm(RMSNorm):
    """pRMSNorm: the RMS is estimated from the first ceil(p * d) features."""


def build_norm(spec: dict, like: nn.Module) -> nn.Module:
    """The norm a section's `norms` entry describes, on the device and in the dtype of `like`'s weight."""
    cls = PartialRMSNorm if spec["type"] == "prmsnorm" else RMSNorm
    new = cls(spec["width"], eps=spec["eps"], elementwise_affine=spec["affine"],
              p=spec["p"] if spec["type"] == "prmsnorm" else None)
    return new.to(ref.device, ref.dtype) if (ref := getattr(like, "weight", None)) is not None else new


# ---- the section -------------------------------------------------------------------------------------------

def _fail(where: str, msg: str):
    raise InvalidConversion(f"{where}: invalid 'normswap' section in config.json: {msg}")


def _get(where: str, d, key: str, types, ctx: str):
    if not isinstance(d, dict):
        _fail(where, f"{ctx} must be an object")
    if key not in d:
        _fail(where, f"{ctx} has no '{key}'")
    value = d[key]
    types = types if isinstance(types, tuple) else (types,)
    # bool is an int to Python; it is never a valid number or width here.
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        _fail(where, f"{ctx}.{key} = {value!r} is not {' or '.join(KINDS[t] for t in types)}")
    return value


def _check_norm(where: str, name: str, spec) -> None:
    ctx = f"norms[{name!r}]"
    kind = _get(where, spec, "type", str, ctx)
    if kind not in NORM_TYPES:
        _fail(where, f"{ctx}.type = {kind!r} is not one of {', '.join(NORM_TYPES)}")
    if _get(where, spec, "width", int, ctx) < 1:
        _fail(where, f"{ctx}.width must be >= 1")
    eps = _get(where, spec, "eps", (int, float), ctx)
    if not (math.isfinite(eps) and eps > 0):
        _fail(where, f"{ctx}.eps = {eps!r} must be finite and > 0")
    _get(where, spec, "affine", bool, ctx)
    if kind == "prmsnorm":
        p = _get(where, spec, "p", (int, float), ctx)
        if not (math.isfinite(p) and 0 < p <= 1):
            _fail(where, f"{ctx}.p = {p!r} must be in (0, 1]")


def _check_online(where: str, spec: dict, ctx: str) -> None:
    """An online rotation (`add_online_rotation`): its width n and factor side m, n = p·m with p a power of two."""
    n, m = (_get(where, spec, k, int, ctx) for k in ONLINE_KEYS)
    if m < 1 or n < m or n % m or (n // m) & (n // m - 1):
        _fail(where, f"{ctx}: online rotation of width {n} with a {m} x {m} factor: the width must be the factor's "
                     "side times a power of two")


def validate(section, where: str, model: nn.Module | None = None) -> dict:
    """Check `section` (format, types, ranges; with `model`, that every module it names exists)."""
    if not isinstance(section, dict):
        _fail(where, "it must be an object")
    fmt = section.get("format")
    if fmt == 1:
        raise InvalidConversion(
            f"{where}: written by transformers' own save_pretrained (or config.save_pretrained) from a model an older "
            "normswap converted in Python (its section is format 1, the record it kept in memory): it has no checksum "
            "and no fingerprint to check, and plain transformers loads it as the original architecture, which it is "
            "not; save that model again with this normswap's save, or convert the original again")
    if fmt not in FORMATS or isinstance(fmt, bool):
        raise InvalidConversion(f"{where}: normswap format {fmt!r} is not supported (this version reads formats "
                                f"{', '.join(map(str, FORMATS))}): a newer normswap wrote it?")
    if "checksum" not in section:
        raise InvalidConversion(
            f"{where}: the 'normswap' section has no checksum: this config.json was not written by a save of the "
            "converted model (model.save_pretrained or normswap.save_pretrained), e.g. by config.save_pretrained")
    base = _get(where, section, "base", dict, "section")
    for key in ("architecture", "model_type"):
        _get(where, base, key, str, "base")
    norms = _get(where, section, "norms", dict, "section")
    for name, spec in norms.items():
        _check_norm(where, name, spec)
    biases = _get(where, section, "added_biases", list, "section")
    if not all(isinstance(b, str) for b in biases):
        _fail(where, "added_biases must list module names")
    fixes = section.get("output_fixes", {})
    if not isinstance(fixes, dict):
        _fail(where, "output_fixes must be an object")
    for name, spec in fixes.items():
        ctx = f"output_fixes[{name!r}]"
        _get(where, spec, "centre", bool, ctx)   # first: spec is an object; then no key is ignored
        if unknown := [k for k in spec if k not in ("centre", "bias", "input") + MATRICES * (fmt >= MATRIX_FORMAT)
                       + ONLINE_KEYS * (fmt >= ONLINE_FORMAT)]:
            _fail(where, f"{ctx}.{unknown[0]} is not in format {fmt} (a newer normswap's?): the model would differ")
        if any(_get(where, spec, k, int, ctx) < 0 for k in ("bias", *MATRICES) if k in spec or k == "bias"):
            _fail(where, f"{ctx}: the bias and matrix widths must be >= 0")
        if "input" in spec:
            _get(where, spec, "input", bool, ctx)
        if "online" in spec or "online_factor" in spec:
            _check_online(where, spec, ctx)
    kept = section.get("not_preserved", {})
    if not isinstance(kept, dict) or not all(isinstance(x, str) and x.isprintable() for x in [*kept, *kept.values()]):
        _fail(where, "not_preserved must map output names to reasons (printed on loads: plain text)")
    renamed = section.get("renamed", {})
    if not isinstance(renamed, dict) or not all(isinstance(v, str) for v in renamed.values()):
        _fail(where, "renamed must map module names to names")
    sums = _get(where, section, "checksum", dict, "section")
    for key in ("section", "weights_header"):
        _get(where, sums, key, str, "checksum")
    if model is not None:
        known = dict(model.named_modules())
        for name, local in zip(module_names(section), module_names(local_names(section, model))):
            if local not in known:
                also = f" (nor '{renamed[name]}')" if name in renamed else ""
                _fail(where, f"names module '{name}'{also}, which the {type(model).__name__} model does not have")
    return section


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def section_hash(section: dict) -> str:
    """The hash of the section without its checksum (the checksum's `section`: `checksum.py`)."""
    body = {k: v for k, v in section.items() if k != "checksum"}
    return sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def check_section_hash(section: dict, where: str) -> None:
    """Refuse a section edited after it was saved."""
    if section["checksum"].get("section") != section_hash(section):
        raise InvalidConversion(f"{where}: the 'normswap' section of config.json was edited after normswap saved "
                                "it (checksum mismatch): refusing a model that may be wrong; convert the original "
                                "again")


def module_names(section: dict) -> list[str]:
    """Every module a section names: its norms, added biases and fixes, in that order."""
    return [*section.get("norms", {}), *section.get("added_biases", []), *section.get("output_fixes", {})]


def local_names(section: dict, model: nn.Module) -> dict:
    """The section with each module `model` lacks named as on disk (`renamed`: module prefix -> name on disk),
    where `model` has that one: transformers 4 and 5 call some modules differently (GPT-NeoX's head: embed_out
    in 4 and on disk, lm_head in 5)."""
    known, other = dict(model.named_modules()), section.get("renamed", {})
    def local(name):
        alts = [old + name[len(new):] for new, old in other.items() if name == new or name.startswith(new + ".")]
        return next((alt for alt in alts if name not in known and alt in known), name)
    return {**section, "norms": {local(k): v for k, v in section.get("norms", {}).items()},
            "added_biases": [local(b) for b in section.get("added_biases", [])],
            "output_fixes": {local(k): v for k, v in section.get("output_fixes", {}).items()}}


# ---- the structure: norms, added biases, output and input fixes --------------------------------------------

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
    key, m = first_input(module, args, kwargs), module._parameters.get("normswap_input_matrix")
    x = fixed(args[0] if key == 0 else kwargs[key], True, None, m)
    return ((x, *args[1:]), kwargs) if key == 0 else (args, {**kwargs, key: x})


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
    key = first_input(module, args, kwargs)
    x = online_rotated(args[0] if key == 0 else kwargs[key], p[ONLINE[0]], p[ONLINE[1]])
    return ((x, *args[1:]), kwargs) if key == 0 else (args, {**kwargs, key: x})


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


def ensure_bias(layer: nn.Module) -> tuple[nn.Parameter, bool]:
    """The bias of a Linear / GPT-2 Conv1D, created as zeros if absent; returns (bias, created)."""
    if getattr(layer, "bias", None) is not None:
        return layer.bias, False
    w = layer.weight
    out_features = w.shape[0] if isinstance(layer, nn.Linear) else w.shape[1]  # Conv1D stores (in, out)
    layer.bias = nn.Parameter(torch.zeros(out_features, device=w.device, dtype=w.dtype))
    return layer.bias, True


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
