"""The package's shape, measured: no import cycle (function-local imports and lazy facades counted), few
top-level modules, small files, the CLI in one package, no private names across modules, no module-level
state, and `import normswap.norms` / `normswap.ops` without transformers."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import normswap

PACKAGE = Path(normswap.__file__).parent
ROOT = PACKAGE.parent


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every .py file in the package."""
    out = {}
    for f in sorted(PACKAGE.rglob("*.py")):
        parts = list(f.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = f
    return out


MODULES = _modules()


def _target(name: str) -> str | None:
    """The package module `name` is, or lives in (normswap.a.b.attr -> normswap.a.b); None if not ours."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _edges(module: str, tree: ast.AST) -> set[str]:
    """Every normswap module `module` imports: at module level, inside functions, and lazily by name in a
    facade's table (strings "normswap.x" / "normswap.x:")."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {_target(a.name) for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                found.add(_target(f"{node.module}.{a.name}"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "." in node.value \
                and node.value.rstrip(":") in MODULES:
            found.add(node.value.rstrip(":"))
    return {m for m in found if m and m != module}


GRAPH = {m: _edges(m, ast.parse(f.read_text())) for m, f in MODULES.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path (first == last), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        state[m] = 2
        stack.pop()
        return None
    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_cycle_finder_finds_a_cycle_through_a_function_local_import():
    tree = ast.parse("def f():\n    from normswap.norms import RMSNorm\n")
    graph = {"normswap.ops": _edges("normswap.ops", tree), "normswap.norms": {"normswap.ops"}}
    assert _cycle(graph) == ["normswap.norms", "normswap.ops", "normswap.norms"]


def test_no_import_cycle():
    assert _cycle(GRAPH) is None


def test_few_top_level_modules_and_small_files():
    top = [f.name for f in PACKAGE.glob("*.py")]
    assert len(top) <= 12, sorted(top)
    long = {str(f.relative_to(ROOT)): n for f in MODULES.values() if (n := len(f.read_text().splitlines())) > 400}
    assert not long


def test_the_cli_lives_in_one_package():
    users = [m for m, f in MODULES.items() if not m.startswith("normswap.cli")
             and any(isinstance(n, (ast.Import, ast.ImportFrom)) and "click" in
                     ([a.name for a in n.names] if isinstance(n, ast.Import) else [n.module or ""])
                     for n in ast.walk(ast.parse(f.read_text())))]
    assert users == []
    # nothing but `python -m normswap` reaches into the CLI: the library never depends on it
    assert [m for m, deps in GRAPH.items() if not m.startswith(("normswap.cli", "normswap.__main__"))
            and any(d.startswith("normswap.cli") for d in deps)] == []


def test_no_private_name_crosses_a_module():
    bad = []
    for m, f in MODULES.items():
        tree = ast.parse(f.read_text())
        ours: set[str] = set()   # local names bound to normswap modules
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("normswap"):
                bad += [f"{m}: from {node.module} import {a.name}" for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
                ours |= {a.asname or a.name for a in node.names if f"{node.module}.{a.name}" in MODULES}
            elif isinstance(node, ast.Import):
                ours |= {a.asname or a.name.split(".")[0] for a in node.names if a.name.startswith("normswap")}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ours \
                    and node.attr.startswith("_") and not node.attr.startswith("__"):
                bad.append(f"{m}: {node.value.id}.{node.attr}")
    assert bad == []


def test_no_module_level_state_is_rebound():
    """`global` rebinds module state between calls; options travel as arguments instead."""
    rebinding = [m for m, f in MODULES.items() if any(isinstance(n, ast.Global) for n in ast.walk(ast.parse(
        f.read_text())))]
    assert rebinding == []


@pytest.mark.parametrize("module", ["normswap.norms", "normswap.ops", "normswap"])
def test_light_imports_do_not_import_transformers(module):
    code = (f"import sys, {module}; heavy = [m for m in ('transformers', 'onnx', 'click', 'accelerate') "
            "if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]", out.stderr


def test_the_facade_resolves_every_public_name():
    assert sorted(normswap.__all__) == sorted(dir(normswap)) or set(normswap.__all__) <= set(dir(normswap))
    for name in normswap.__all__:
        assert getattr(normswap, name) is not None, name
