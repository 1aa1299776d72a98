"""Which of a model's parameters its code can reach at all: a parameter that no sample input ran is a
writer the trace cannot vouch for, unless no code ever reads it (dead weights kept for checkpoint
compatibility: Wav2Vec2-Conformer's pos_conv_embed is built but never called).

A name is read if the source files that define the model's module classes (not transformers' generic base
classes, which read attributes by computed names) read it as an attribute
(`self.pos_conv_embed`, outside an assignment) or name it in a string (`getattr(self, "name")`). A file
that reads attributes of `self` by a computed name, or cannot be read, makes every name count as read.
"""
from __future__ import annotations

import ast
import inspect

from torch import nn

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
        for cls in type(module).__mro__:
            mod = cls.__module__
            if mod.startswith(("torch", "builtins")) or mod.startswith("transformers.") and \
                    not mod.startswith("transformers.models."):   # the library's generic bases, not the model's
                continue
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
