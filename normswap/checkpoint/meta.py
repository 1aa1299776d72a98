"""The model of a checkpoint folder built on the meta device (no weights read), and the checks that its
tensors fit it, as `load_model` would make them: shapes, missing and unexpected tensors, ties."""
from __future__ import annotations

import re
from pathlib import Path

import torch
from accelerate import init_empty_weights
from torch import nn
from transformers import AutoConfig

from normswap.checkpoint import safetensors
from normswap.checkpoint.lazy import Lazy, NotStreamable
from normswap.models.source import auto_class, check_weights


def skeleton(path: Path, config=None, dtype: torch.dtype | None = None, cls=None) -> nn.Module:
    """The model of folder `path` on the meta device (buffers real), in `dtype` or the stored one.
    Never runs the folder's own code (no remote code)."""
    config = config or AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    if dtype is None:
        reader = safetensors.Reader(path)
        dtype = next((d for d, _ in map(reader.meta, reader.keys()) if d.is_floating_point), torch.float32)
    with init_empty_weights():
        if cls is not None:
            model = cls(config).to(dtype)
        else:   # an Auto class's from_config calls the class's _from_config: the same model either way
            found = auto_class(config)
            model = found.from_config(config, dtype=dtype) if hasattr(found, "from_config") else \
                found._from_config(config, dtype=dtype)
    model.tie_weights()  # ties made inside init_empty_weights are lost (it re-creates each parameter)
    return model.eval()


def check_folder(model: nn.Module, lazy: Lazy, src: Path) -> None:
    """As load_model does: every parameter in the checkpoint with its shape, nothing unexpected; and tied
    tensors stored under two names hold the same values (else `NotStreamable`)."""
    alias = safetensors.aliases(model)
    params = [k for k, _ in model.named_parameters(remove_duplicate=False) if alias.get(k, k) == k]
    state = model.state_dict(keep_vars=True)
    missing = [k for k in params if lazy.key(k) is None]
    ignore = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []]
    known = set(lazy.names)
    unexpected = [lazy.names.get(k, k) for k in known - set(state) if not any(p.search(k) for p in ignore)]
    mismatched = [(k, lazy.reader.meta(lazy.key(k))[1], list(state[k].shape)) for k in params
                  if lazy.key(k) is not None and list(lazy.reader.meta(lazy.key(k))[1]) != list(state[k].shape)]
    check_weights(str(src), sorted(missing), sorted(unexpected), mismatched, allow=False)
    _check_ties(lazy, src)


def _check_ties(lazy: Lazy, src: Path) -> None:
    """A tied tensor stored under two names with different values: transformers unties them when loading (the
    model's head is then the stored lm_head, not the embedding), which a model built tied cannot follow."""
    seen = set()
    for group in lazy.groups.values():
        if id(group) in seen:
            continue
        seen.add(id(group))
        keys = list(dict.fromkeys(lazy.names[n] for n in group if n in lazy.names))
        first = lazy.reader.get(keys[0]) if len(keys) > 1 else None
        for key in keys[1:]:
            if not torch.equal(first, lazy.reader.get(key)):
                raise NotStreamable(f"{src} stores the tied tensors {keys[0]} and {key} with different values "
                                    "(transformers unties them)")
