"""The walk over what a forward returns: every tensor by dotted name (dicts and ModelOutputs by key, tuples and
lists by index, caches by layer), the floating ones a comparison covers, and the main output."""
from __future__ import annotations

import re

import torch

# a tuple of per-layer residual-stream states: centred by an exact conversion, so never compared
STREAM = re.compile(r"(^|\.|_)hidden_states$")
STREAM_REASON = "per-layer residual stream, centred by the exact conversion by design"


def main_output(out) -> tuple[str, torch.Tensor]:
    """(name, tensor) of a model's main output: logits, else last_hidden_state, else the first tensor."""
    for key in ("logits", "last_hidden_state"):
        if isinstance(getattr(out, key, None), torch.Tensor):
            return key, getattr(out, key)
    kept, _ = floating_outputs(out)
    if kept:
        return next(iter(kept.items()))
    return "output", out[0]


def tensors(obj, name: str | None = "", caches: bool = False, left: dict | None = None):
    """(dotted name, tensor) for every tensor in `obj`, nested: dicts and ModelOutputs by key, tuples and lists
    by index; with `caches`, transformers caches by layer (`past_key_values.0.keys`); given `left` (a dict),
    tuples of intermediate hidden states are left out and named there (-> why). `name` None: no names."""
    if isinstance(obj, torch.Tensor):
        yield name, obj
    elif left is not None and name and STREAM.search(name) and isinstance(obj, (tuple, list)):
        left[name] = STREAM_REASON
    elif isinstance(obj, dict) or hasattr(obj, "to_tuple") and hasattr(obj, "keys"):
        for k in obj.keys():
            yield from tensors(obj[k], _key(name, k), caches, left)
    elif isinstance(obj, (tuple, list)):
        for i, x in enumerate(obj):
            yield from tensors(x, _key(name, i), caches, left)
    elif caches and isinstance(getattr(obj, "layers", None), list):   # a transformers Cache
        for i, layer in enumerate(obj.layers):
            for k in ("keys", "values"):
                yield from tensors(getattr(layer, k, None), f"{name}.{i}.{k}", caches, left)
    elif caches:
        for k in ("self_attention_cache", "cross_attention_cache"):   # EncoderDecoderCache
            if getattr(obj, k, None) is not None:
                yield from tensors(getattr(obj, k), f"{name}.{k}", caches, left)


def _key(name: str | None, k) -> str | None:
    return None if name is None else f"{name}.{k}" if name else str(k)


def tensors_in(obj) -> list[torch.Tensor]:
    """The tensors in obj, a tensor or a (nested) list, tuple or dict of them."""
    return [t for _, t in tensors(obj, None)]


def floating_outputs(out) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(every floating tensor a forward returned, by dotted name; the outputs left out -> why).

    ModelOutputs and dicts by key, tuples and lists by index, caches by layer (`past_key_values.0.keys`).
    Left out: tuples of intermediate hidden states (the residual stream an exact conversion centres)."""
    excluded: dict[str, str] = {}
    kept = {name or "output": v for name, v in tensors(out, caches=True, left=excluded) if v.is_floating_point()}
    return kept, excluded
