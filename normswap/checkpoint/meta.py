"""The model of a checkpoint folder built on the meta device (no weights read), and the checks that its
tensors fit it, as `load_model` would make them: shapes, missing and unexpected tensors, ties; its buffers and
the tensors transformers makes instead of reading hold what `load_model` gives them."""
from __future__ import annotations

from pathlib import Path

import torch
from accelerate import init_empty_weights
from torch import nn
from transformers import AutoConfig

from normswap.io import safetensors
from normswap.checkpoint.lazy import Lazy, NotStreamable
from normswap.errors import NormswapError, first_line
from normswap.models.source import (auto_class, build_model, check_code, check_weights, ignored_keys, load_dtype,
                                    read_config, weights_reader)


def skeleton(path: Path, config=None, dtype: torch.dtype | None = None, cls=None) -> nn.Module:
    """The model of folder `path` on the meta device (buffers real), in `dtype` or the one it loads in
    (`load_dtype`). Never runs the folder's own code (no remote code)."""
    config = config or AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    if dtype is None:
        dtype = load_dtype(str(path), config, safetensors.Reader(path))
    with init_empty_weights():
        model = build_model(cls or auto_class(config), config, dtype)
    model.tie_weights()  # ties made inside init_empty_weights are lost (it re-creates each parameter)
    return model.eval()


def open_folder(src: Path, dtype: torch.dtype | None = None, bar=None) -> tuple[nn.Module, Lazy]:
    """The model of checkpoint folder `src` on meta and the `Lazy` that reads its tensors, checked and
    completed as `load_model` loads it (`check_folder`). Refuses folders with their own model code."""
    check_code(str(src), read_config(src), trust_remote_code=False, converting=True)
    reader = weights_reader(str(src), src, mapped=True)
    try:
        config = AutoConfig.from_pretrained(src, local_files_only=True, trust_remote_code=False)
        model = skeleton(src, config, dtype or load_dtype(str(src), config, reader))
    except NormswapError:
        raise
    except Exception as e:  # as load_model says it: one line
        raise NormswapError(f"cannot load model from {src}: {first_line(e)}") from None
    lazy = Lazy(model, reader, bar)
    check_folder(model, lazy, src)
    return model, lazy


def check_folder(model: nn.Module, lazy: Lazy, src: Path) -> None:
    """As load_model does: every parameter in the checkpoint with its shape, nothing unexpected (but what
    transformers ignores, `ignored_keys`); tied tensors stored under two names hold the same values (else
    `NotStreamable`). Then the stored buffers are read (`read_buffers`) and the tensors transformers makes
    instead of reading are made (`_make_unstored`)."""
    alias = safetensors.aliases(model)
    params = [k for k, _ in model.named_parameters(remove_duplicate=False) if alias.get(k, k) == k]
    state = model.state_dict(keep_vars=True)
    absent = [k for k in params if lazy.key(k) is None]
    missing, unexpected = ignored_keys(model, absent, set(lazy.names) - set(state))
    mismatched = [(k, lazy.reader.meta(lazy.key(k))[1], list(state[k].shape)) for k in state
                  if lazy.key(k) is not None and list(lazy.reader.meta(lazy.key(k))[1]) != list(state[k].shape)]
    check_weights(str(src), missing, [lazy.names[k] for k in unexpected], mismatched, allow=False)
    _check_ties(lazy, src)
    read_buffers(model, lazy)
    _make_unstored(model, sorted(set(absent) - set(missing)))


def read_buffers(model: nn.Module, lazy: Lazy) -> None:
    """The stored values of the model's persistent buffers (a BatchNorm's running statistics), read now: the
    skeleton's buffers are real, so `Lazy` never reads them, and they would keep the values of a fresh model."""
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=True).items():
            if name not in params and not t.is_meta and lazy.key(name) is not None:
                t.copy_(lazy.read(name, t.dtype))


def _make_unstored(model: nn.Module, names: list[str]) -> None:
    """Parameters the checkpoint lacks and transformers does not ask for (Marian's sinusoidal positions): made
    as transformers makes them, by the model's `_init_weights` on their module, and kept real. Made twice
    under different seeds: one that comes out random differs between two loads, so it cannot stream."""
    for name in names:
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        t = getattr(owner, attr)
        real = torch.empty(t.shape, dtype=t.dtype)
        torch.utils.swap_tensors(t, nn.Parameter(real, requires_grad=False) if isinstance(t, nn.Parameter) else real)
        made = []
        for seed in (0, 1):
            with torch.random.fork_rng(), torch.no_grad():
                torch.manual_seed(seed)
                model._init_weights(owner)
                made.append(t.detach().clone())
        if not torch.equal(*made):
            raise NotStreamable(f"{name} is not stored and transformers initialises it at random")


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
