"""Lazy package facades (PEP 562): a package's public names, imported from their modules on first use, so
that importing one module (`normswap.norms`, `normswap.ops`) never imports the rest (or transformers)."""
from __future__ import annotations

import importlib


def lazy(package: str, names: dict[str, str]):
    """(__getattr__, __dir__) for `package`, whose attribute `name` is `names[name]`'s attribute of that name
    (a module path ending in ":" names the module itself: {"io": "normswap.models:"})."""
    def __getattr__(name: str):
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        where = names[name]
        return importlib.import_module(where[:-1]) if where.endswith(":") else \
            getattr(importlib.import_module(where), name)

    def __dir__() -> list[str]:
        return sorted(names)
    return __getattr__, __dir__
