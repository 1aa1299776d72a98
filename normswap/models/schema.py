"""The `normswap` section of a saved config.json: its schema, checked on load, and its checksum.

A folder is rebuilt from this section (which norms, which added biases, which output fixes), so a
wrong value gives a wrong model without any error: every field is checked before anything is built,
and a checksum written at save (over the section and the weights file's header) detects hand edits.
"""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

from torch import nn

from normswap.checkpoint.safetensors import INDEX, WEIGHTS, raw_header
from normswap.errors import NormswapError

FORMAT = 2  # 2: adds `base` and `checksum`; format 1 folders (no checksum) cannot be trusted
NORM_TYPES = ("rmsnorm", "prmsnorm")


def _fail(where: str, msg: str):
    raise NormswapError(f"{where}: invalid 'normswap' section in config.json: {msg}")


def _get(where: str, d: dict, key: str, types, ctx: str):
    if not isinstance(d, dict):
        _fail(where, f"{ctx} must be an object")
    if key not in d:
        _fail(where, f"{ctx} has no '{key}'")
    value = d[key]
    # bool is an int to Python; it is never a valid number or width here.
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in _tuple(types)):
        _fail(where, f"{ctx}.{key} = {value!r} is not {_tname(types)}")
    return value


def _tuple(types):
    return types if isinstance(types, tuple) else (types,)


def _tname(types) -> str:
    return " or ".join({int: "an integer", float: "a number", bool: "true/false", str: "a string",
                        dict: "an object", list: "a list"}[t] for t in _tuple(types))


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


def validate(section, where: str, model: nn.Module | None = None) -> dict:
    """Check `section` (types, ranges, format; with `model`, that every named module exists)."""
    if not isinstance(section, dict):
        _fail(where, "it must be an object")
    fmt = section.get("format")
    if fmt != FORMAT:
        raise NormswapError(f"{where}: normswap format {fmt!r} is not supported (this version reads format "
                            f"{FORMAT}){'; convert the original model again' if fmt == 1 else ''}")
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
        _get(where, spec, "centre", bool, f"output_fixes[{name!r}]")
        if _get(where, spec, "bias", int, f"output_fixes[{name!r}]") < 0:
            _fail(where, f"output_fixes[{name!r}].bias must be >= 0")
    sums = _get(where, section, "checksum", dict, "section")
    for key in ("section", "weights_header"):
        _get(where, sums, key, str, "checksum")
    if model is not None:
        known = dict(model.named_modules())
        for name in [*norms, *biases, *fixes]:
            if name not in known:
                _fail(where, f"names module '{name}', which the {type(model).__name__} model does not have")
    return section


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _weights_headers(folder: Path) -> bytes:
    """The headers of a checkpoint's safetensors files (one file, or every shard of its index, by name)."""
    folder = Path(folder)
    if (folder / INDEX).exists():
        try:
            files = sorted(set(json.loads((folder / INDEX).read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise NormswapError(f"{folder / INDEX} is not a safetensors index (no weight_map)") from None
    else:
        files = [WEIGHTS]
    for name in files:
        if not (folder / name).is_file():
            raise NormswapError(f"{folder}: shard {name} listed in {INDEX} is missing" if name != WEIGHTS
                                else f"{folder} has no {WEIGHTS}")
    # A single file hashes as its header alone (format-2 folders written before sharding stay valid).
    if files == [WEIGHTS]:
        return raw_header(folder / WEIGHTS)
    return b"".join(name.encode() + b"\0" + raw_header(folder / name) for name in files)


def checksum(section: dict, folder: Path) -> dict:
    """Hashes of the section (without its checksum) and of the weights' headers (names, shapes, offsets)."""
    body = {k: v for k, v in section.items() if k != "checksum"}
    return {"section": _sha(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()),
            "weights_header": _sha(_weights_headers(folder))}


def verify_checksum(section: dict, folder: Path, where: str, header: bool = True) -> None:
    """Refuse a section edited after save; with `header`, also weights other than the ones saved."""
    expected, actual = section["checksum"], checksum(section, folder)
    if expected["section"] != actual["section"]:
        raise NormswapError(f"{where}: the 'normswap' section of config.json was edited after normswap saved it "
                            "(checksum mismatch): refusing a model that may be wrong; convert the original again")
    if header and expected["weights_header"] != actual["weights_header"]:
        raise NormswapError(f"{where}: the weights are not the ones normswap saved with this config (their "
                            "tensor names, shapes or sizes differ: checksum mismatch)")
