"""The package's shape, measured: no import cycle (function-local imports and lazy facades counted), imports
only down the layers, few top-level modules, small files and functions, the CLI in one package, no private
names across modules, no module-level state (rebound or mutated in place), and `import normswap.norms` /
`normswap.ops` without transformers."""
from __future__ import annotations

import ast
import subprocess
import sys
import warnings
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
    facade's table (strings "normswap.x", "normswap.x:" / "normswap.x:attr")."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {_target(a.name) for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                found.add(_target(f"{node.module}.{a.name}"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "." in node.value \
                and node.value.partition(":")[0] in MODULES:
            found.add(node.value.partition(":")[0])
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


# Bottom to top; a module may import its own layer or any below it. The root facade (`normswap`) names every
# layer lazily for users and is exempt as an importer; imported from inside the package, it counts as the top.
LAYERS = {
    "errors": 0, "facade": 0, "choices": 0, "progress": 0, "owned": 0, "signals": 0, "ops": 0, "norms": 0,
    "io": 1, "folder": 1,
    "models": 2, "textdata": 2,
    "parity": 3,
    "surgery": 4, "checkpoint": 4, "evaluation": 4,
    "healing": 5, "export": 5,
    "pipeline": 6,
    "cli": 7, "__main__": 7,
}
TOP = max(LAYERS.values()) + 1


def _layer(module: str) -> int | None:
    """normswap.<part>... -> its layer; TOP for the root facade; None for a part LAYERS does not name."""
    parts = module.split(".")
    return TOP if len(parts) == 1 else LAYERS.get(parts[1])


def _upward(graph: dict[str, set[str]]) -> list[str]:
    """Every import that points up a layer (or into a part no layer names), as "a -> b (La -> Lb)"."""
    bad = []
    for m, deps in sorted(graph.items()):
        if m == "normswap":
            continue
        for d in sorted(deps):
            mine, theirs = _layer(m), _layer(d)
            if mine is None or theirs is None or theirs > mine:
                bad.append(f"{m} -> {d} (L{mine} -> L{theirs})")
    return bad


def test_layer_check_finds_an_import_up_a_layer():
    tree = ast.parse("def f():\n    from normswap.pipeline import convert_checkpoint\n")
    graph = {"normswap.models.load": _edges("normswap.models.load", tree),
             "normswap.pipeline": {"normswap.models", "normswap.pipeline.options"},   # down, and the same layer
             "normswap": {"normswap.cli"}, "normswap.cli.app": {"normswap"}, "normswap.stray": set()}
    assert _upward(graph) == ["normswap.cli.app -> normswap (L7 -> L8)",
                              "normswap.models.load -> normswap.pipeline (L2 -> L6)"]
    assert _upward({"normswap.stray": {"normswap.errors"}}) == ["normswap.stray -> normswap.errors (LNone -> L0)"]


def test_imports_only_point_down_the_layers():
    assert _upward(GRAPH) == []


KERNELS = {"normswap.ops.triton_kernels"}   # Triton kernels are written out long, for the compiler
MAX_FUNCTION_LINES = 80


def _long_functions(module: str, tree: ast.AST) -> list[str]:
    """Every function or method (nested ones too) over MAX_FUNCTION_LINES lines, def line to last line."""
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return [f"{module}.{n.name}: {size} lines" for n in functions
            if (size := n.end_lineno - n.lineno + 1) > MAX_FUNCTION_LINES]


def test_function_length_check_finds_a_long_function():
    def function(name: str, lines: int) -> str:   # the def line and `lines - 1` more
        return f"def {name}():\n" + "".join(f"    x{i} = {i}\n" for i in range(lines - 1))
    tree = ast.parse(function("longest_allowed", MAX_FUNCTION_LINES) + function("too_long", MAX_FUNCTION_LINES + 1))
    assert _long_functions("normswap.x", tree) == [f"normswap.x.too_long: {MAX_FUNCTION_LINES + 1} lines"]


def test_no_function_over_80_lines_outside_the_kernels():
    assert [line for m, f in MODULES.items() if m not in KERNELS
            for line in _long_functions(m, ast.parse(f.read_text()))] == []


CONTAINERS = {"list", "dict", "set", "defaultdict", "OrderedDict", "deque", "Counter"}
MUTATORS = {"append", "extend", "add", "update", "insert", "remove", "pop", "clear", "setdefault", "discard",
            "popitem", "sort", "reverse", "appendleft", "extendleft", "popleft", "difference_update",
            "intersection_update", "symmetric_difference_update"}


def _is_container(value: ast.AST | None) -> bool:
    if isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)):
        return True
    func = value.func if isinstance(value, ast.Call) else None
    return (isinstance(func, ast.Name) and func.id in CONTAINERS) or \
        (isinstance(func, ast.Attribute) and func.attr in CONTAINERS)


def _module_containers(tree: ast.Module) -> set[str]:
    """Names bound at module level (also under if/try) to a list, dict or set literal or constructor."""
    names, todo = set(), list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.If, ast.Try)):
            todo += node.body + node.orelse + getattr(node, "finalbody", []) + \
                [s for h in getattr(node, "handlers", []) for s in h.body]
        elif isinstance(node, ast.Assign) and _is_container(node.value):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and _is_container(node.value):
            names.add(node.target.id)
    return names


def _local_names(fn: ast.AST) -> set[str]:
    """Names a function binds itself (arguments and assignments, not `global` ones): they hide module names."""
    a = fn.args
    names = {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg] if x}
    for node in ast.walk(fn):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names - {n for node in ast.walk(fn) if isinstance(node, ast.Global) for n in node.names}


def _mutations(module: str, tree: ast.Module) -> list[str]:
    """Every place a module-level container (or an item of it) is changed in place: a mutating method call,
    `NAME[k] = ...`, `NAME[k] += ...`, `NAME += ...` or `del NAME[k]`, at module level or inside any function."""
    found: list[str] = []

    def named(node: ast.AST, state: set[str]) -> str | None:
        while isinstance(node, ast.Subscript):   # NAME[k][j]: still NAME's state
            node = node.value
        return node.id if isinstance(node, ast.Name) and node.id in state else None

    def visit(node: ast.AST, state: set[str]) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            state = state - _local_names(node)
        name = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
            name = named(node.func.value, state)
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            for t in targets:
                if isinstance(t, ast.Subscript):
                    name = name or named(t.value, state)
                elif isinstance(node, ast.AugAssign):
                    name = name or named(t, state)
        if name:
            found.append(f"{module}:{node.lineno} {name}")
        for child in ast.iter_child_nodes(node):
            visit(child, state)
    visit(tree, _module_containers(tree))
    return found


def test_mutation_check_finds_module_containers_changed_in_place():
    tree = ast.parse(
        "import collections\n"
        "_eager = [object(), None]\n"
        "CACHE: dict = {}\n"
        "SEEN = collections.defaultdict(list)\n"
        "NAMES = ('a', 'b')\n"                  # a tuple cannot change
        "try:\n    HOOKS = set()\nexcept ImportError:\n    HOOKS = set()\n"
        "def decide(raw):\n"
        "    _eager[:] = [raw, None]\n"
        "    CACHE.setdefault(raw, 1)\n"
        "    SEEN['x'].append(raw)\n"           # an item of it: the module's state all the same
        "    del CACHE[raw]\n"
        "    HOOKS.add(raw)\n"
        "def shadowed(CACHE, NAMES):\n"
        "    CACHE.update(NAMES)\n"             # a parameter, not the module's dict
        "    HOOKS = set()\n    HOOKS.add(1)\n"
        "    return [n for n in NAMES]\n"
        "SEEN['y'] = 1\n")
    assert _mutations("normswap.x", tree) == ["normswap.x:11 _eager", "normswap.x:12 CACHE", "normswap.x:13 SEEN",
                                              "normswap.x:14 CACHE", "normswap.x:15 HOOKS", "normswap.x:21 SEEN"]


def test_no_module_level_container_is_mutated_in_place():
    assert [line for m, f in MODULES.items() for line in _mutations(m, ast.parse(f.read_text()))] == []


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
    assert sorted(normswap.__all__) == sorted(dir(normswap)) and len(normswap.__all__) <= 20
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # the new names never warn
        for name in normswap.__all__:
            assert getattr(normswap, name) is not None, name
    for name in normswap.DEPRECATED:   # the old ones still resolve, for one release, warning
        assert name not in normswap.__all__
        with pytest.warns(DeprecationWarning, match=f"normswap.{name} is deprecated"):
            assert getattr(normswap, name) is not None, name
