"""A model's own code, read: its classes (not torch's, not transformers' generic bases), their syntax trees and
the names a node reads. What `reach` and `uncalled` decide from."""
from __future__ import annotations

import ast
import inspect
import textwrap

from torch import nn

from normswap.folder.fixes import unfixed_class


def own_classes(module: nn.Module) -> list[type]:
    """The module's classes that are the model's own code (not torch's, not transformers' generic bases, not the
    class a conversion's fixes swapped in)."""
    return [c for c in unfixed_class(module).__mro__ if not c.__module__.startswith(("torch", "builtins")) and
            not (c.__module__.startswith("transformers.") and not c.__module__.startswith("transformers.models."))]


def class_tree(cls: type) -> ast.ClassDef | None:
    try:
        node = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    except (TypeError, OSError, SyntaxError, IndexError):
        return None
    return node if isinstance(node, ast.ClassDef) else None


def named(node: ast.AST, own: bool = False) -> str | None:
    """The name `node` reads: an attribute (`x.m`; with `own`, only `self.m` and `super().m`) or a string
    (`getattr(self, "m")`)."""
    if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
        base = node.value
        mine = isinstance(base, ast.Name) and base.id == "self" or isinstance(base, ast.Call) and \
            isinstance(base.func, ast.Name) and base.func.id == "super"
        return node.attr if mine or not own else None
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def source_trees(objs) -> list[ast.AST] | None:
    try:
        return [ast.parse(textwrap.dedent(inspect.getsource(o))) for o in objs]
    except (TypeError, OSError, SyntaxError):
        return None
