"""Per-head rotations of attention values (QuaRot's R2), folded into weights: for an attention whose heads read
values V (a layer's output, width n·h) and whose mixed outputs O (the input of the layer writing them back, width
m·h) it computes O_i = A_i·V_(i) per head (A_i mixes tokens only), so V·K gives O·K with K = I ⊗ R (R an h x h
orthogonal matrix, the same for every head: grouped-query heads share it), and the layer reading O undoes it.
The values' layer's rows become Kᵀ·W (its bias b·K), the reading layer's columns W·K: outputs unchanged.

Which layers pair is found by behaviour, not by name: each linear layer that reads a rotated stream and whose
output is made of whole heads has its output multiplied by K in one forward (hooks, on the first sample batch);
the first stream writer whose input that changes is its pair if that input is its recorded input times K. The
head width h is the config's (head_dim, else hidden / heads). The rotation's verification (the model's outputs
unchanged) then also covers any other reader of the values.
"""
from __future__ import annotations

import torch
from torch import nn

from normswap.models.introspect import ALIASES, config_int, in_width, is_linear, out_width
from normswap.models.modes import eval_mode
from normswap.surgery.algebra import output_dim
from normswap.surgery.steps import Module
from normswap.surgery.streams import NotRotatable, Streams

TOL = 1e-4   # an input matches its recorded value times K: float32 rounding of the matmuls in between


def head_width(model: nn.Module) -> int:
    """The attention heads' width: the config's head_dim, else hidden size / heads; NotRotatable without one."""
    config = getattr(model, "config", None)
    text = getattr(config, "get_text_config", lambda: config)()
    h = getattr(text, "head_dim", None)
    if isinstance(h, int) and h > 0:
        return h
    hidden, heads = (config_int(text, k) for k in ("hidden", "heads"))
    if not (hidden and heads) or hidden % heads:
        raise NotRotatable(f"per-head rotations need the heads' width: the config names none (head_dim, or one of "
                           f"{ALIASES['hidden']} and {ALIASES['heads']})")
    return hidden // heads


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool((a.double() - b.double()).abs().max() <= TOL * max(b.double().abs().max().item(), 1e-30))


def per_head(x: torch.Tensor, r: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """x with its dim `dim` multiplied by K = I ⊗ r (each group of r's width times r), in x's dtype: K is never
    built (an LM head's width would make it huge)."""
    y = x.movedim(dim, -1)
    return (y.unflatten(-1, (-1, r.shape[0])) @ r.to(x.device, x.dtype)).flatten(-2).movedim(-1, dim)


class _Reached(Exception):
    """Stops a forward at the first stream writer whose input a rotated layer changed."""


@torch.no_grad()
def find_pairs(model: nn.Module, found: Streams, batch: dict, r: torch.Tensor) -> list[tuple[str, str]]:
    """The (values, output) layer pairs (see the module docstring) for the h x h rotation `r`."""
    h = r.shape[0]
    layer = model.get_submodule
    values = sorted(v for v in {r_ for s in found.streams for r_ in s.readers}
                    if is_linear(layer(v)) and out_width(layer(v)) % h == 0)
    outputs = sorted(w.target.name for s in found.streams for w in s.writers if isinstance(w.target, Module)
                     and not (w.norm or w.entry) and is_linear(layer(w.target.name))
                     and in_width(layer(w.target.name)) % h == 0)
    recorded: dict[str, torch.Tensor] = {}

    def record(name):
        return lambda m, args: recorded.setdefault(name, args[0].detach().clone())   # its first call's
    with eval_mode(model):
        run(model, batch, [layer(o).register_forward_pre_hook(record(o)) for o in outputs])
        pairs = [(v, o) for v in values if (o := _pair(model, v, outputs, recorded, batch, r)) is not None]
    return pairs


def run(model: nn.Module, batch: dict, handles: list) -> None:
    try:
        model(**batch)
    except _Reached:
        pass
    finally:
        for handle in handles:
            handle.remove()


def _pair(model: nn.Module, v: str, outputs: list[str], recorded: dict, batch: dict, r: torch.Tensor) -> str | None:
    """The first stream writer whose input `v`'s output, multiplied by K, changes, if that input is its recorded
    value times K; None otherwise. The forward stops there: whatever else reads `v`'s output, the verification
    after the edits (the model's outputs unchanged) has the last word."""
    hit: list[str] = []

    def check(name):
        def hook(m, args):
            if name in recorded and not close(args[0], recorded[name]):
                hit.extend([name] if close(args[0], per_head(recorded[name], r)) else [])
                raise _Reached
        return hook
    layer = model.get_submodule
    handles = [layer(v).register_forward_hook(lambda m, a, out: per_head(out, r))]
    run(model, batch, handles + [layer(o).register_forward_pre_hook(check(o)) for o in outputs])
    return hit[0] if hit else None


@torch.no_grad()
def rotate_heads(model: nn.Module, pairs: list[tuple[str, str]], r: torch.Tensor) -> None:
    """Fold the per-head rotation `r` into each pair's weights (see the module docstring), in float64."""
    r = r.double()
    for v, o in pairs:
        values, output = model.get_submodule(v), model.get_submodule(o)
        dim = output_dim(values)
        for p in (values.weight, values.bias):
            if p is not None:
                p.copy_(per_head(p.double(), r, dim if p is values.weight else 0).to(p.dtype))
        output.weight.copy_(per_head(output.weight.double(), r, 1 - output_dim(output)).to(output.weight.dtype))
