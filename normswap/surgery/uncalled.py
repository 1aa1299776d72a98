"""Methods a module's forward never runs: a parameter its owner reads only there (diffusers' PriorTransformer's
clip_mean, read only by `post_process_latents`) is not on the forward's path, and the conversion edits none of it."""
from __future__ import annotations

import ast
import inspect

from torch import nn

from normswap.surgery.source import class_tree, named, own_classes, source_trees


SELF_SAFE = {"type", "isinstance", "super", "id"}   # calls that take `self` and run none of its methods


def _handed_self(node: ast.AST, up: ast.AST | None, cls: type) -> object:
    """For a bare `self` given to other code (not `self.x`, `type(self)`, `getattr(self, "x")`): the function of
    the class's module it is passed to (ModelMixin's `get_parameter_dtype(self)`), or None when that is not one
    (a method, a callable from elsewhere: it could run any method). False: not such a use."""
    if not (isinstance(node, ast.Name) and node.id == "self") or isinstance(up, ast.Attribute):
        return False
    call = isinstance(up, ast.Call) and isinstance(up.func, ast.Name)
    if call and (up.func.id in SELF_SAFE or up.func.id in ("getattr", "hasattr") and len(up.args) > 1
                 and isinstance(up.args[1], ast.Constant)):
        return False
    fn = getattr(inspect.getmodule(cls), "__dict__", {}).get(up.func.id) if call else None
    return fn if inspect.isfunction(fn) else None


def _unreached(classes: list[type]) -> tuple[dict[str, list], list] | None:
    """The methods of `classes` that neither a call nor the constructor runs: not `forward`, not a special method
    (`__call__`, `__init__`, `__getattr__`: Python runs them unnamed), not named through `self` (or `super()`) by
    the class bodies or by a method that runs, transitively: (name -> definitions, the functions that running
    code hands `self` to); None if a class cannot be read or running code hands `self` to something else."""
    methods: dict[str, list] = {}
    todo: list[tuple[ast.AST, type]] = []
    for cls in classes:
        tree = class_tree(cls)
        if tree is None:
            return None
        for item in tree.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                methods.setdefault(item.name, []).append((item, cls))
            else:
                todo.append((item, cls))
    seen = {n for n in methods if n == "forward" or n.startswith("__") and n.endswith("__")}
    todo += [f for n in seen for f in methods[n]]
    helpers = []
    while todo:
        item, cls = todo.pop()
        ups = {id(c): p for p in ast.walk(item) for c in ast.iter_child_nodes(p)}
        for node in ast.walk(item):
            if (fn := _handed_self(node, ups.get(id(node)), cls)) is None:
                return None
            if fn is not False:
                helpers.append(fn)
            name = named(node, own=True)
            if name in methods and name not in seen:
                seen.add(name)
                todo += methods[name]
    return {n: [f for f, _ in fns] for n, fns in methods.items() if n not in seen}, helpers


def _named_count(trees: list[ast.AST], names: set[str]) -> int:
    return sum(named(node) in names for tree in trees for node in ast.walk(tree))


def reads_only_off_forward(model: nn.Module, owner_name: str, attr: str) -> bool:
    """True if the owner's own code reads `<attr>` only in methods that neither its call nor its constructor runs
    (`_unreached`: diffusers' PriorTransformer reads clip_mean only in `post_process_latents`, which its forward
    never calls), and neither another module class of the model (a parent calling them) nor a function that
    running code hands `self` to names those methods. A user may still call such a method: what it reads did not
    run in the forward, so the plan edits none of it."""
    owner = model.get_submodule(owner_name)
    classes = own_classes(owner)
    found = _unreached(classes) if classes else None
    if found is None:
        return False
    unreached, helpers = found
    readers = {n for n, fns in unreached.items() if _named_count(fns, {attr})}
    if not readers or _named_count(source_trees(classes) or [], {attr}) != \
            _named_count([f for n in readers for f in unreached[n]], {attr}):
        return False
    others = {c for module in model.modules() for c in own_classes(module)} - set(classes)
    trees = source_trees([*others, *set(helpers)])
    return trees is not None and not _named_count(trees, readers)
