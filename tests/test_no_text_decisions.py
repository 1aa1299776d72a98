"""No decision in the package reads a message's text (issue 47): refusals carry a `Cause`, skipped modules a
`Skip`, plan steps typed targets. Measured on the source, as tests/test_layout.py measures the layers:

- an exception's text (`str(e)`, `e.args`, `first_line(e)` of a name bound by `except ... as e`) or a message
  (a name `error`, `message`, `msg`, `reason`, `why`; an attribute or key `reason` / `message`) compared
  (`==`, `in`...) or matched (`startswith`, `re.search`...);
- a value coded by a prefix: `x.startswith("p:")` then `x[6:]` (a fixed cut) in the same function.

Where a library says what it means only in its text, one named function reads it and returns a typed value:
those are listed in READERS, and nothing else may do so."""
from __future__ import annotations

import ast
from pathlib import Path

import normswap

PACKAGE = Path(normswap.__file__).parent

MESSAGES = {"error", "message", "msg", "reason", "why"}
MATCHERS = {"startswith", "endswith", "search", "match", "fullmatch", "findall", "finditer", "find", "rfind"}
READERS = {
    "normswap.models.inputs.media.read_complaint",   # transformers' counts of features and tiles
    "normswap.models.load.asks_for_remote_code",     # transformers' "trust_remote_code" refusal
    "normswap.cli.app.out_of_memory",                # torch's CPU allocator: a plain RuntimeError
}


def _functions(tree: ast.AST, prefix: str):
    """(qualified name, node) of every function, methods and nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield f"{prefix}.{node.name}", node
            yield from _functions(node, f"{prefix}.{node.name}")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}.{node.name}")


def _texty(node: ast.AST, caught: set[str]) -> bool:
    """Whether `node` is a message's text: an exception's, or a value named as one."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("str", "repr", "first_line"):
        return bool(node.args) and isinstance(node.args[0], ast.Name) and node.args[0].id in caught
    if isinstance(node, ast.Attribute):
        return node.attr in ("reason", "message") or node.attr == "args" and isinstance(node.value, ast.Name) \
            and node.value.id in caught
    if isinstance(node, ast.Subscript):
        key = node.slice
        return isinstance(key, ast.Constant) and key.value in ("reason", "message") or _texty(node.value, caught)
    return isinstance(node, ast.Name) and node.id in MESSAGES


def _none_check(node: ast.Compare) -> bool:
    return all(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops) and \
        any(isinstance(c, ast.Constant) and c.value is None for c in node.comparators)


def text_decisions(name: str, tree: ast.AST) -> list[str]:
    """Every place in the module `name` where a decision reads a message's text (see the module docstring)."""
    found = []
    for qualified, fn in _functions(tree, name):
        if qualified in READERS:
            continue
        body = [n for stmt in fn.body for n in ast.walk(stmt)]
        caught = {n.name for n in body if isinstance(n, ast.ExceptHandler) and n.name}
        prefixed = set()
        for node in body:
            if isinstance(node, ast.Compare) and not _none_check(node) and \
                    any(_texty(x, caught) for x in [node.left, *node.comparators]):
                found.append(f"{qualified}:{node.lineno}: compares a message")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MATCHERS:
                if any(_texty(x, caught) for x in [node.func.value, *node.args]):
                    found.append(f"{qualified}:{node.lineno}: matches a message")
                if node.func.attr == "startswith" and isinstance(node.func.value, ast.Name):
                    prefixed.add(node.func.value.id)
        for node in body:   # a prefix tested, then cut off: a value coded in a string
            if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id in prefixed \
                    and isinstance(node.slice, ast.Slice) and isinstance(node.slice.lower, ast.Constant) \
                    and node.slice.upper is None:
                found.append(f"{qualified}:{node.lineno}: slices off a prefix it tested")
    return found


def test_the_check_finds_text_decisions():
    code = '''
def load(src):
    try:
        open(src)
    except OSError as e:
        if "trust_remote_code" in str(e):
            return 1
        if first_line(e).startswith("cannot"):
            return 2
    return [s for s in report.skipped if s["reason"] == NONFINITE]

def step(target, error):
    if target.startswith("param:"):
        return target[6:]
    return MISMATCH.search(error)

def fine(p, e):
    return p.reason is None or e.cause is Cause.POST_LN
'''
    assert [f.partition(": ")[0] for f in text_decisions("m", ast.parse(code))] == \
        ["m.load:6", "m.load:8", "m.load:10", "m.step:15", "m.step:14"]


def test_no_decision_reads_a_message():
    modules = {".".join(f.relative_to(PACKAGE.parent).with_suffix("").parts): f for f in sorted(PACKAGE.rglob("*.py"))}
    assert [f for m, path in modules.items() for f in text_decisions(m, ast.parse(path.read_text()))] == []
