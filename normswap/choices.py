"""How callers state what they want: the package's choices as types (`Literal`s, whose values are today's strings),
checked in one line (`choice`), and the one rule for an options object versus keywords (`options_from`).

Every verb takes either an options object or keywords that build one (the options class holds the defaults,
once); both at once is refused unless they agree, so neither silently wins.
"""
from __future__ import annotations

import dataclasses
from typing import Literal, get_args

from normswap.errors import NormswapError

Rotation = Literal["hadamard", "random"]             # the orthogonal matrix `rotate` applies
LoadDtype = Literal["float32", "float16", "bfloat16"]   # also fp32, fp16, bf16, a torch.dtype
GraphDtype = Literal["fp32", "fp16", "bf16"]         # an ONNX graph's; also float16, a torch.dtype
ExportTarget = Literal["ort", "onnx23"]              # onnxruntime's fused norms, or opset 23's RMSNormalization
Quantize = Literal["int8"]
Train = Literal["auto", "norms", "all", "lora"]      # what `heal` trains
Objective = Literal["kd", "lm"]                      # distillation from a teacher, or the causal-LM loss


def listed(values) -> str:
    """"a, b or c"."""
    values = [str(v) for v in values]
    return values[0] if len(values) == 1 else f"{', '.join(values[:-1])} or {values[-1]}"


def choice(value, kind, what: str) -> str:
    """`value` if it is one of the `Literal` `kind`'s values, else a one-line error naming them."""
    allowed = get_args(kind)
    if not isinstance(value, str) or value not in allowed:
        raise NormswapError(f"unknown {what} {value!r}: choose {listed(allowed)}")
    return value


def field_paths(cls) -> dict[str, tuple[str, ...]]:
    """Keyword -> the field it sets: `cls`'s own fields, then those of the options nested in it (`load.dtype` as
    `dtype`) where no shallower field has the name."""
    paths: dict[str, tuple[str, ...]] = {}
    level = [((), cls)]
    while level:
        deeper = []
        for prefix, c in level:
            for f in dataclasses.fields(c):
                paths.setdefault(f.name, prefix + (f.name,))
                if dataclasses.is_dataclass(f.default):
                    deeper.append((prefix + (f.name,), type(f.default)))
        level = deeper
    return paths


def _get(options, path: tuple[str, ...]):
    for name in path:
        options = getattr(options, name)
    return options


def _replaced(options, changes: dict[tuple[str, ...], object]):
    """`options` with each field at a path set (nested options rebuilt, so each checks itself)."""
    here = {p[0]: v for p, v in changes.items() if len(p) == 1}
    for name in {p[0] for p in changes if len(p) > 1}:
        here[name] = _replaced(getattr(options, name), {p[1:]: v for p, v in changes.items()
                                                        if len(p) > 1 and p[0] == name})
    return dataclasses.replace(options, **here)


def _same(a, b) -> bool:
    try:
        return a is b or bool(a == b)
    except (RuntimeError, TypeError, ValueError):   # tensors: equal only if the same object
        return False


def changed(options, keep=()) -> str | None:
    """The first field of `options` outside `keep` that differs from its class's default, else None."""
    default = type(options)()
    return next((f.name for f in dataclasses.fields(options) if f.name not in keep
                 and not _same(getattr(options, f.name), getattr(default, f.name))), None)


def options_from(cls, options, keywords: dict):
    """The options a verb runs with: `options` (a `cls`), or one built from `keywords` (field names of `cls` or of
    the options nested in it); given both, every keyword must agree with `options`, or a one-line error."""
    if options is not None and not isinstance(options, cls):
        raise NormswapError(f"`options` must be a {cls.__name__}, got {type(options).__name__}")
    paths = field_paths(cls)
    unknown = [k for k in keywords if k not in paths]
    if unknown:
        raise TypeError(f"unexpected keyword {unknown[0]!r}: not a field of {cls.__name__} (or of the options in it)")
    for k in keywords:   # `load=LoadOptions(...)` with `dtype=...`: which one is meant?
        outer = next((o for o in keywords if paths[k][:len(paths[o])] == paths[o] != paths[k]), None)
        if outer is not None:
            raise NormswapError(f"give `{outer}` or `{k}`, not both: `{k}` is a field of `{outer}`")
    base = options if options is not None else cls()
    built = _replaced(base, {paths[k]: v for k, v in keywords.items()}) if keywords else base
    if options is None:
        return built
    differ = next((k for k in keywords if not _same(_get(built, paths[k]), _get(options, paths[k]))), None)
    if differ is not None:
        raise NormswapError(f"give `options` or keywords, not both: `{differ}={keywords[differ]!r}` but `options` has "
                            f"`{'.'.join(paths[differ])}={_get(options, paths[differ])!r}`")
    return options
