"""Online rotations (QuaRot's R4): a linear layer writing the stream whose input x no folded rotation reaches gets
W <- W·H (in float64, stored in the model's dtype) and x -> x·H at run time before it (`fixes.online_rotated`,
the one transform: a randomised fast Walsh-Hadamard transform times a small dense factor, or a dense random
orthogonal matrix), so that its input, which a quantizer reads, loses its outliers; its outputs are unchanged.

Which layers, by behaviour: a stream writer's input is made channel by channel from the outputs of layers reading
the stream (an activation of them, a gated product: Llama's down_proj, GPT-2's MLP c_proj) when permuting those
readers' output channels (one random permutation per width, every reader of the writer's input width at once)
permutes that input alike; one forward with the permutations (hooks, on the first sample batch), each writer's
input checked and put back as it was, so that what follows runs as before. An attention's output projection fails
(the heads' sums mix channels), as it should: R2 rotates it (`heads`), and layers R2 pairs are left to it.
"""
from __future__ import annotations

import torch
from torch import nn

from normswap.folder.portable import ONLINE
from normswap.folder.fixes import add_online_rotation, online_rotated
from normswap.models.introspect import in_width, is_linear
from normswap.models.modes import eval_mode
from normswap.surgery.algebra import output_dim
from normswap.surgery.heads import close, run
from normswap.surgery.orthogonal import online_factors
from normswap.surgery.steps import Module
from normswap.surgery.streams import Streams

PERMUTATION_SEED = 0   # draws the permutations of the test (any works: a channel-wise input follows every one)


def _writers(model: nn.Module, found: Streams) -> list[str]:
    layer = model.get_submodule
    return sorted({w.target.name for s in found.streams for w in s.writers if isinstance(w.target, Module)
                   and not (w.norm or w.entry) and is_linear(layer(w.target.name))})


@torch.no_grad()
def find_online(model: nn.Module, found: Streams, batch: dict, skip: set[str]) -> list[str]:
    """The stream writers (not in `skip`: R2's) whose input is a channel-wise function of stream readers' outputs
    (see the module docstring)."""
    layer = model.get_submodule
    writers = _writers(model, found)
    readers = sorted({r for s in found.streams for r in s.readers if is_linear(layer(r))})
    g = torch.Generator().manual_seed(PERMUTATION_SEED)
    perms = {n: torch.randperm(n, generator=g) for n in sorted({in_width(layer(w)) for w in writers})}
    recorded: dict[str, list[torch.Tensor]] = {w: [] for w in writers}
    hits: dict[str, bool] = {}

    def record(name):
        def hook(m, args):
            if args:
                recorded[name].append(args[0].detach().clone())
        return hook

    def permute(m, args, out):
        p = perms.get(out.shape[-1]) if isinstance(out, torch.Tensor) else None
        return out if p is None else out[..., p.to(out.device)]

    def check(name):
        calls = iter(recorded[name])

        def hook(m, args):
            before = next(calls, None)
            if not args or before is None:
                hits[name] = False
                return None
            moved = before[..., perms[before.shape[-1]].to(before.device)]
            hits[name] = hits.get(name, True) and close(args[0], moved) and not close(args[0], before)
            return (before, *args[1:])   # as it was: what follows runs as before
        return hook
    with eval_mode(model):
        run(model, batch, [layer(w).register_forward_pre_hook(record(w)) for w in writers])
        run(model, batch, [layer(r).register_forward_hook(permute) for r in readers] +
            [layer(w).register_forward_pre_hook(check(w)) for w in writers])
    return [w for w in writers if hits.get(w) and w not in skip]


def rotated_online(model: nn.Module, found: Streams) -> list[str]:
    """The stream writers rotated online already (their parameters say so; the permutation test cannot: the
    transform runs inside their forward, after the test's pre-hook reads their input)."""
    return [w for w in _writers(model, found) if ONLINE[0] in model.get_submodule(w)._parameters]


@torch.no_grad()
def rotate_online(model: nn.Module, names: list[str], method: str, seed: int) -> list[dict]:
    """Give each layer of `names` its online rotation (drawn in turn from one generator seeded `seed`): W <- W·H
    through the transform itself on W's input dim, in float64; its report entries (layer, width, q)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for name in names:
        layer = model.get_submodule(name)
        n = in_width(layer)
        signs, factor, what = online_factors(n, method, g)
        w, dim = layer.weight, 1 - output_dim(layer)   # the input dim: Linear (out, in), Conv1D (in, out)
        w.copy_(online_rotated(w.double().movedim(dim, -1), signs, factor).movedim(-1, dim).to(w.dtype))
        add_online_rotation(layer, signs, factor)
        out.append({"layer": name, "width": n, "q": what})
    return out
