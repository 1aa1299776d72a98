"""What rebuilds a saved conversion: normswap runs it, and so does every converted folder, as its own code.

One source for both loaders. normswap imports this module to rebuild its folders (`rebuild.from_pretrained`,
streaming's verification), and `save_pretrained` copies this file verbatim into each folder as modeling_normswap.py,
followed by generated subclasses of the original transformers classes, which transformers runs with
trust_remote_code=True. So it imports only the standard library and torch (and transformers, lazily), never
normswap; a test fails if the shipped copy differs from this file.

- `validate`: config.json's `normswap` section (format, types, ranges, named modules); `checksum.py` hashes it
  and the weights files' headers, `fingerprint.py` checks the loaded model's behaviour.
- the norms (`build_norm`: pure PyTorch; normswap passes `normswap.norms.build_norm`, whose modules use its fast
  kernels for the same arithmetic, held equal by a test) and `ensure_bias`.
- `fixes.py`, `checksum.py`, `fingerprint.py` and `shipped.py` follow this file in modeling_normswap.py (from their
  lines "# ---- shipped from here"): `fixes.rebuild` applies a section (the norms, added biases, output and input
  fixes in the modules' own forward, online rotations), the last is the transformers side (`NormswapMixin`).
"""
from __future__ import annotations

import hashlib
import json
import math

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


# ---- the structure's one weight edit: a bias created where a section adds one ----------------------------

def ensure_bias(layer: nn.Module) -> tuple[nn.Parameter, bool]:
    """The bias of a Linear / GPT-2 Conv1D, created as zeros if absent; returns (bias, created)."""
    if getattr(layer, "bias", None) is not None:
        return layer.bias, False
    w = layer.weight
    out_features = w.shape[0] if isinstance(layer, nn.Linear) else w.shape[1]  # Conv1D stores (in, out)
    layer.bias = nn.Parameter(torch.zeros(out_features, device=w.device, dtype=w.dtype))
    return layer.bias, True
