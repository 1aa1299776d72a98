"""Per-head rotations of attention values (QuaRot's R2), folded into weights: for an attention whose heads read
values V (a layer's output, width n·h) and whose mixed outputs O (the input of the layer writing them back, width
m·h) it computes O_i = A_i·V_(i) per head (A_i mixes tokens only), so V·K gives O·K with K = I ⊗ R (R an h x h
orthogonal matrix, the same for every head: grouped-query heads share it), and the layer reading O undoes it.
The values' layer's rows become Kᵀ·W (its bias b·K), the reading layer's columns W·K: outputs unchanged.

Which layers pair is found by behaviour, not by name: each linear layer that reads a rotated stream and whose
output is made of whole heads has its output multiplied by K in one forward (hooks, on the first sample batch);
a stream writer whose input then is its recorded input times K, and after which the model's output is what it
was (the hook undoes K there), is its pair. The head width h is the config's (head_dim, else hidden / heads).
"""
from __future__ import annotations

import torch
from torch import nn

from normswap.models.introspect import ALIASES, config_int, in_width, is_linear, out_width
from normswap.models.modes import eval_mode
from normswap.parity import main_output
from normswap.surgery.algebra import output_dim
from normswap.surgery.orthogonal import times
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


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool((a.double() - b.double()).abs().max() <= TOL * max(b.double().abs().max().item(), 1e-30))


def _blocks(r: torch.Tensor, width: int) -> torch.Tensor:
    return torch.block_diag(*[r] * (width // r.shape[0]))


@torch.no_grad()
def find_pairs(model: nn.Module, found: Streams, batch: dict, r: torch.Tensor) -> list[tuple[str, str]]:
    """The (values, output) layer pairs (see the module docstring) for the h x h rotation `r`."""
    with eval_mode(model):
        return _pairs(model, found, batch, r)


def _pairs(model: nn.Module, found: Streams, batch: dict, r: torch.Tensor) -> list[tuple[str, str]]:
    h = r.shape[0]
    layer = model.get_submodule
    values = sorted(v for v in {r_ for s in found.streams for r_ in s.readers}
                    if is_linear(layer(v)) and out_width(layer(v)) % h == 0)
    outputs = sorted(w.target.name for s in found.streams for w in s.writers if isinstance(w.target, Module)
                     and not (w.norm or w.entry) and is_linear(layer(w.target.name))
                     and in_width(layer(w.target.name)) % h == 0)
    recorded: dict[str, torch.Tensor] = {}

    def record(name):
        return lambda m, args: recorded.__setitem__(name, args[0].detach().clone())
    handles = [layer(o).register_forward_pre_hook(record(o)) for o in outputs]
    try:
        want = main_output(model(**batch))[1].detach().clone()
    finally:
        for handle in handles:
            handle.remove()
    pairs = [(v, o) for v in values if (o := _pair(model, v, outputs, recorded, want, batch, r)) is not None]
    return pairs


def _pair(model: nn.Module, v: str, outputs: list[str], recorded: dict, want: torch.Tensor, batch: dict,
          r: torch.Tensor) -> str | None:
    """The stream writer whose input is its recorded value times K once `v`'s output is multiplied by K, the
    model's output unchanged once that writer undoes it; None where there is none."""
    hit: list[str] = []

    def undo(name):
        def hook(m, args):
            k = _blocks(r, args[0].shape[-1]).to(args[0].device, args[0].dtype)
            if not hit and name in recorded and _close(args[0], recorded[name] @ k):
                hit.append(name)
                return (args[0] @ k.T, *args[1:])
        return hook
    layer = model.get_submodule
    k_v = _blocks(r, out_width(layer(v)))
    handles = [layer(v).register_forward_hook(lambda m, a, out: out @ k_v.to(out.device, out.dtype))]
    handles += [layer(o).register_forward_pre_hook(undo(o)) for o in outputs]
    try:
        got = main_output(model(**batch))[1]
    finally:
        for handle in handles:
            handle.remove()
    return hit[0] if hit and _close(got, want) else None


@torch.no_grad()
def rotate_heads(model: nn.Module, pairs: list[tuple[str, str]], r: torch.Tensor) -> None:
    """Fold the per-head rotation `r` into each pair's weights (see the module docstring), in float64."""
    for v, o in pairs:
        values, output = model.get_submodule(v), model.get_submodule(o)
        dim = output_dim(values)
        k = _blocks(r, out_width(values)).to(values.weight.device)
        for p in (values.weight, values.bias):
            if p is not None:
                p.copy_(times(p, dim if p is values.weight else 0, k).to(p.dtype))
        k = _blocks(r, in_width(output)).to(output.weight.device)
        output.weight.copy_(times(output.weight, 1 - output_dim(output), k).to(output.weight.dtype))
