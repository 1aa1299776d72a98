"""Which of a model's parameters its code can reach at all: a parameter that no sample input ran is a
writer the trace cannot vouch for, unless no code ever reads it (dead weights kept for checkpoint
compatibility: Wav2Vec2-Conformer's pos_conv_embed is built but never called).

A name is read if the source files that define the model's module classes (not transformers' generic base
classes, which read attributes by computed names) read it as an attribute
(`self.pos_conv_embed`, outside an assignment) or name it in a string (`getattr(self, "name")`). A file
that reads attributes of `self` by a computed name, or cannot be read, makes every name count as read.

A parameter read is still unreachable when its owner reads it only under `if <arg> is not None:` for
optional forward arguments that the owner's parent never passes (`unreachable`): Dinov2's mask_token inside
Depth Anything's backbone; or when a module on its path is read only under `if self.<flag>:` for a flag that
is off and that no code sets after `__init__` (MONAI's `with_cross_attention`); or when a module reads it only in
its own `forward`, which its parent never calls (vit-pytorch's MAE runs its encoder's pieces by hand); or only in
methods its forward never runs (diffusers' PriorTransformer's `post_process_latents`). Anything less clear-cut
counts as reachable.
"""
from __future__ import annotations

import ast
import inspect

from torch import nn

from normswap.surgery.source import class_tree, own_classes
from normswap.surgery.uncalled import reads_only_off_forward

CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential, nn.ParameterList, nn.ParameterDict)


def _names(path: str) -> set[str] | None:
    """Attribute names a source file reads; None if it reads some by a computed name."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            found.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.add(node.value)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr" and len(node.args) > 1 \
                and getattr(node.args[0], "id", None) == "self" and not isinstance(node.args[1], ast.Constant):
            return None
    return found


def read_names(model: nn.Module) -> set[str] | None:
    """Every attribute name the model's own classes read (see the module docstring); None: all of them."""
    files = set()
    for module in model.modules():
        for cls in own_classes(module):
            try:
                files.add(inspect.getsourcefile(cls))
            except (TypeError, OSError):
                return None
    names: set[str] = set()
    for path in files:
        try:
            found = _names(path) if path else None
        except (OSError, SyntaxError, UnicodeDecodeError):
            found = None
        if found is None:
            return None
        names |= found
    return names


def dead(model: nn.Module, param: str, names: set[str] | None) -> bool:
    """True if the parameter `param` sits under an attribute its owner's code never reads."""
    if names is None:
        return False
    module = model
    for part in param.split(".")[:-1]:
        child = getattr(module, part)
        if not isinstance(module, CONTAINERS) and not type(module).__module__.startswith("torch") \
                and part not in names:
            return True
        module = child
    last = param.rpartition(".")[2]
    return not type(module).__module__.startswith("torch") and not isinstance(module, CONTAINERS) \
        and last not in names


def _is_self_attr(node: ast.AST, attr: str) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == attr and isinstance(node.value, ast.Name) \
        and node.value.id == "self"


def _not_none(test: ast.AST) -> set[str]:
    """Names that `test` requires not to be None (`x is not None`, alone or in an `and`)."""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        return set().union(*(_not_none(v) for v in test.values))
    if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.IsNot) and \
            isinstance(test.left, ast.Name) and isinstance(test.comparators[0], ast.Constant) and \
            test.comparators[0].value is None:
        return {test.left.id}
    return set()


def _optional(fn: ast.FunctionDef) -> dict[str, int]:
    """{name: position, self not counted} of fn's parameters that default to None and that fn never reassigns."""
    args, n = fn.args, len(fn.args.args) - len(fn.args.defaults)
    assigned = {a.id for a in ast.walk(fn) if isinstance(a, ast.Name) and isinstance(a.ctx, ast.Store)}
    return {a.arg: i - 1 for i, a in enumerate(args.args) if i >= n and a.arg not in assigned and
            isinstance(d := args.defaults[i - n], ast.Constant) and d.value is None}


def _gates(owner: nn.Module, attr: str) -> dict[str, int] | None:
    """{argument: position} of the optional forward arguments that every read of `self.<attr>` in the owner's
    code sits under an `if <argument> is not None:`; None if some read is not so gated (or read elsewhere)."""
    defining = next((c for c in own_classes(owner) if "forward" in vars(c)), None)
    if defining is None:
        return None
    gates: dict[str, int] | None = None
    for cls in own_classes(owner):
        tree = class_tree(cls)
        if tree is None:
            return None
        for item in tree.body:
            is_forward = cls is defining and isinstance(item, ast.FunctionDef) and item.name == "forward"
            reads = [n for n in ast.walk(item) if _is_self_attr(n, attr) and isinstance(n.ctx, ast.Load)]
            if not reads:
                continue
            if not is_forward:
                return None
            optional = _optional(item)
            guards: dict[int, set[str]] = {}
            for node in ast.walk(item):
                if isinstance(node, ast.If):
                    names = _not_none(node.test) & set(optional)
                    for inner in node.body:
                        for sub in ast.walk(inner):
                            guards.setdefault(id(sub), set()).update(names)
            found = set.intersection(*(guards.get(id(r), set()) for r in reads))
            if not found:
                return None
            gates = {a: optional[a] for a in found}
    return gates


def _passed(parent: nn.Module, child: str, gates: dict[str, int]) -> dict[str, int] | None:
    """How the parent's code hands `gates` to `self.<child>`: {} never; {name: position} only as its own
    optional forward arguments of those names, passed on unchanged from its forward; None any other way (a
    computed value, a splat, the child handed out or called elsewhere with them)."""
    classes = own_classes(parent)
    if not classes:
        return None
    out: dict[str, int] = {}
    for cls in classes:
        tree = class_tree(cls)
        if tree is None:
            return None
        parents = {id(c): p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
        forward = next((f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == "forward"), None)
        inside = {id(n) for n in ast.walk(forward)} if forward is not None else set()
        optional = _optional(forward) if forward is not None else {}
        for node in ast.walk(tree):
            if not _is_self_attr(node, child) or not isinstance(node.ctx, ast.Load):
                continue
            up = parents.get(id(node))
            if isinstance(up, ast.Attribute) and up.attr in ("forward", "__call__"):
                node, up = up, parents.get(id(up))
            elif isinstance(up, ast.Attribute):   # self.child.something: not a call of the child
                continue
            if not (isinstance(up, ast.Call) and up.func is node):
                return None
            if any(isinstance(a, ast.Starred) for a in up.args) or any(k.arg is None for k in up.keywords):
                return None
            for gate, i in gates.items():
                value = next((k.value for k in up.keywords if k.arg == gate), up.args[i] if len(up.args) > i else None)
                if value is None or isinstance(value, ast.Constant) and value.value is None:
                    continue
                if not (isinstance(value, ast.Name) and value.id in optional and id(up) in inside):
                    return None
                out[value.id] = optional[value.id]
    return out


def _self_flags(test: ast.AST) -> set[str]:
    """Attributes of self that `test` requires to be truthy (`self.flag`, `self.flag is not None`, alone or in an
    `and`)."""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        return set().union(*(_self_flags(v) for v in test.values))
    if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.IsNot) and \
            isinstance(test.comparators[0], ast.Constant) and test.comparators[0].value is None:
        test = test.left
    if isinstance(test, ast.Attribute) and isinstance(test.value, ast.Name) and test.value.id == "self":
        return {test.attr}
    return set()


def _stores(tree: ast.AST, flag: str, own: bool) -> bool:
    """Whether `tree` stores `<x>.flag` outside an `__init__`: through `self` only if `own` (the owner's own class:
    another class's `self` is another object), through any other name always."""
    inits = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == "__init__"
             for n in ast.walk(f)}
    return any(isinstance(n, ast.Attribute) and n.attr == flag and not isinstance(n.ctx, ast.Load)
               and id(n) not in inits and (own or not _is_self_attr(n, flag)) for n in ast.walk(tree))


def _flagged_off(owner: nn.Module, attr: str) -> bool:
    """True if every read of `self.<attr>` in the owner's own code sits under `if self.<flag>:` for a flag
    that is falsy now and that nothing sets outside an `__init__` (the owner's classes through `self`, any code of
    their files through another name; a constructor switch:
    MONAI's `with_cross_attention`): no input can run it."""
    classes = own_classes(owner)
    flags: set[str] | None = None
    for cls in classes:
        tree = class_tree(cls)
        if tree is None:
            return False
        reads = [n for n in ast.walk(tree) if _is_self_attr(n, attr) and isinstance(n.ctx, ast.Load)]
        if not reads:
            continue
        guards: dict[int, set[str]] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and (names := _self_flags(node.test)):
                for inner in node.body:
                    for sub in ast.walk(inner):
                        guards.setdefault(id(sub), set()).update(names)
        found = set.intersection(*(guards.get(id(r), set()) for r in reads))
        flags = found if flags is None else flags & found
    flags = (flags or set()) - set(vars(nn.Module()))   # `training`: torch's own code sets it (train(), eval())
    if not flags:
        return False
    try:
        files = [ast.parse(open(inspect.getsourcefile(c), encoding="utf-8").read()) for c in classes]
    except (TypeError, OSError, SyntaxError, UnicodeDecodeError):
        return False
    trees = [class_tree(c) for c in classes]
    return any(isinstance(getattr(owner, flag, True), (bool, int, type(None))) and not getattr(owner, flag, True)
               and not any(_stores(tree, flag, own=False) for tree in files)
               and not any(_stores(tree, flag, own=True) for tree in trees) for flag in flags)


def _only_in_forward(owner: nn.Module, attr: str) -> bool:
    """True if the owner's own code reads `self.<attr>` only inside its `forward` methods, and never runs its own
    forward (`self(...)`, `self.forward`, `self.__call__`) from elsewhere."""
    found = False
    for cls in own_classes(owner):
        tree = class_tree(cls)
        if tree is None:
            return False
        forwards = {id(n) for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == "forward"
                    for n in ast.walk(f)}
        for node in ast.walk(tree):
            if _is_self_attr(node, attr) and isinstance(node.ctx, ast.Load):
                if id(node) not in forwards:
                    return False
                found = True
            elif id(node) not in forwards and (_is_self_attr(node, "forward") or _is_self_attr(node, "__call__") or
                                               isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                                               and node.func.id == "self"):
                return False
    return found


def _never_called(parent: nn.Module, child: str) -> bool:
    """True if the parent's own code uses `self.<child>` only to reach its attributes (`self.child.proj`), never
    calling it (`self.child(...)`, `.forward`, `.__call__`) nor handing it out (vit-pytorch's MAE runs its
    encoder's pieces by hand)."""
    classes = own_classes(parent)
    if not classes:
        return False
    for cls in classes:
        tree = class_tree(cls)
        if tree is None:
            return False
        ups = {id(c): p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
        for node in ast.walk(tree):
            if _is_self_attr(node, child) and isinstance(node.ctx, ast.Load):
                up = ups.get(id(node))
                if not isinstance(up, ast.Attribute) or up.attr in ("forward", "__call__"):
                    return False
    return True


def uncalled_forward(model: nn.Module, name: str) -> bool:
    """True if a module on the path to `name` (a module or a parameter) reads the next step only in its own
    `forward`, and its parent (held once, by that parent) never calls it: that forward never runs (vit-pytorch's
    MAE: its encoder's class token and head, read only by the encoder's forward, which the MAE never calls)."""
    parts = name.split(".")
    for i in range(1, len(parts)):
        owner_name, parent_name = ".".join(parts[:i]), ".".join(parts[:i - 1])
        owner, parent = model.get_submodule(owner_name), model.get_submodule(parent_name)
        holders = sum(m is owner for _, m in model.named_modules(remove_duplicate=False))
        if holders == 1 and not isinstance(parent, CONTAINERS) and getattr(parent, parts[i - 1], None) is owner \
                and own_classes(owner) and _only_in_forward(owner, parts[i]) and _never_called(parent, parts[i - 1]):
            return True
    return False


def off_forward(model: nn.Module, name: str) -> bool:
    """True if a module on the path to `name` (a module or a parameter) reads the next step only in methods its
    call never runs (`uncalled.reads_only_off_forward`)."""
    parts = name.split(".")
    for i in range(len(parts)):
        owner_name = ".".join(parts[:i])
        if not isinstance(model.get_submodule(owner_name), CONTAINERS) and \
                reads_only_off_forward(model, owner_name, parts[i]):
            return True
    return False


def switched_off(model: nn.Module, name: str) -> bool:
    """True if a module on the path to `name` (a module or a parameter) reads the next one only under a
    constructor switch that is off (`_flagged_off`)."""
    parts = name.split(".")
    for i in range(len(parts)):
        owner = model.get_submodule(".".join(parts[:i]))
        if not isinstance(owner, CONTAINERS) and own_classes(owner) and _flagged_off(owner, parts[i]):
            return True
    return False


def never_runs(model: nn.Module, name: str) -> bool:
    """True if no input can run the module or parameter `name`: behind a constructor switch that is off
    (`switched_off`), read only by a forward no code calls (`uncalled_forward`), or only by methods the forward
    never runs (`off_forward`)."""
    return switched_off(model, name) or uncalled_forward(model, name) or off_forward(model, name)


def unreachable(model: nn.Module, param: str) -> bool:
    """True if the model's code provably never reads `param`: its owner reads it only under
    `if <arg> is not None:` for optional forward arguments that no caller up to the model passes (each
    module held once, by one parent, which passes such an argument on only from its own optional forward
    argument, and so on up): Dinov2's mask_token inside Depth Anything's backbone, which embeds pixels without
    `bool_masked_pos`, or under an image classifier's head, which calls Dinov2Model without it. So is one no
    input can run (`never_runs`)."""
    if never_runs(model, param):
        return True
    name, _, attr = param.rpartition(".")
    gates = _gates(model.get_submodule(name), attr) if name else None
    while gates:
        if not name:   # the model's own forward: the user may pass it
            return False
        parent_name, _, child = name.rpartition(".")
        module, parent = model.get_submodule(name), model.get_submodule(parent_name)
        holders = sum(m is module for _, m in model.named_modules(remove_duplicate=False))
        if holders != 1 or isinstance(parent, CONTAINERS) or getattr(parent, child, None) is not module:
            return False
        passed = _passed(parent, child, gates)
        if passed is None:
            return False
        if not passed:
            return True
        gates, name = passed, parent_name
    return False
