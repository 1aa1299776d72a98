"""Lazy package facades (PEP 562): a package's public names, imported from their modules on first use, so
that importing one module (`normswap.norms`, `normswap.ops`) never imports the rest (or transformers)."""
from __future__ import annotations

import importlib
import warnings


def resolve(where: str, name: str):
    """What a table's entry names: "pkg.mod" its attribute `name`, "pkg.mod:attr" its attribute `attr`,
    "pkg.mod:" the module itself."""
    module, _, attr = where.partition(":")
    found = importlib.import_module(module)
    if where.endswith(":"):
        return found
    return getattr(found, attr or name)


def lazy(package: str, names: dict[str, str], deprecated: dict[str, tuple[str, str]] | None = None):
    """(__getattr__, __dir__) for `package`, whose attribute `name` is what `names[name]` names (`resolve`).

    deprecated: old name -> (where, what to use instead): still importable, each use warning
    (DeprecationWarning) with the replacement; `dir()` lists only `names`."""
    old = dict(deprecated or {})

    def __getattr__(name: str):
        if name in names:
            return resolve(names[name], name)
        if name in old:
            where, instead = old[name]
            warnings.warn(f"{package}.{name} is deprecated and goes in the next release: use {instead}",
                          DeprecationWarning, stacklevel=2)
            return resolve(where, name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(names)
    return __getattr__, __dir__
