"""The model of a checkpoint folder built on the meta device (no weights read), and the checks that its
tensors fit it, as `load_model` would make them: shapes, missing and unexpected tensors, ties; its buffers and
the tensors transformers makes instead of reading hold what `load_model` gives them."""
from __future__ import annotations

import torch
from accelerate import init_empty_weights
from torch import nn
from transformers import AutoConfig

from normswap.io import safetensors
from normswap.checkpoint.lazy import InMemoryOnly, Lazy
from normswap.errors import NormswapError, first_line
from normswap.models.source import Folder, auto_class, build_model, check_weights, ignored_keys, load_dtype


def skeleton(config, dtype: torch.dtype, cls=None) -> nn.Module:
    """The model of `config` on the meta device (buffers real), in `dtype`. Never runs a folder's own code (no
    remote code)."""
    with init_empty_weights():
        model = build_model(cls or auto_class(config), config, dtype)
    model.tie_weights()  # ties made inside init_empty_weights are lost (it re-creates each parameter)
    return model.eval()


def _build(folder: Folder, dtype: torch.dtype | None) -> nn.Module:
    """The skeleton of `folder`, in `dtype` or the one it loads in (`load_dtype`); a load error in one line."""
    try:
        config = AutoConfig.from_pretrained(folder.path, local_files_only=True, trust_remote_code=False)
        return skeleton(config, dtype or load_dtype(folder.src, config, folder.reader))
    except NormswapError:
        raise
    except Exception as e:  # as load_model says it: one line
        raise NormswapError(f"cannot load model from {folder.src}: {first_line(e)}") from None


def open_folder(folder: Folder, dtype: torch.dtype | None = None, bar=None) -> tuple[nn.Module, Lazy]:
    """The model of checkpoint folder `folder` (`read_folder`) on meta and the `Lazy` that reads its tensors,
    checked and completed as `load_model` loads it (`check_folder`)."""
    model = _build(folder, dtype)
    lazy = Lazy(model, folder.reader, bar)
    check_folder(model, lazy, folder.src)
    return model, lazy


def reopen(folder: Folder, dtype: torch.dtype) -> tuple[nn.Module, Lazy]:
    """`open_folder` again, for a fresh (unconverted) model of a folder it already checked: completed
    (`complete`), not checked again."""
    model = _build(folder, dtype)
    lazy = Lazy(model, folder.reader)
    complete(model, lazy, _compare(model, lazy)[0])
    return model, lazy


def _compare(model: nn.Module, lazy: Lazy) -> tuple[list[str], list[str], list[str], list]:
    """(unstored, missing, unexpected, mismatched): the parameters the checkpoint lacks that transformers makes
    (does not report missing), those it reports missing, the checkpoint's tensors the model lacks, and those
    of the wrong shape."""
    alias = safetensors.aliases(model)
    params = [k for k, _ in model.named_parameters(remove_duplicate=False) if alias.get(k, k) == k]
    state = model.state_dict(keep_vars=True)
    absent = [k for k in params if lazy.key(k) is None]
    missing, unexpected = ignored_keys(model, absent, set(lazy.names) - set(state))
    mismatched = [(k, lazy.reader.meta(lazy.key(k))[1], list(state[k].shape)) for k in state
                  if lazy.key(k) is not None and list(lazy.reader.meta(lazy.key(k))[1]) != list(state[k].shape)]
    return sorted(set(absent) - set(missing)), missing, unexpected, mismatched


def check_folder(model: nn.Module, lazy: Lazy, src: str) -> None:
    """As load_model does: every parameter in the checkpoint with its shape, nothing unexpected (but what
    transformers ignores, `ignored_keys`); tied tensors stored under two names hold the same values (else
    `InMemoryOnly`). Then the model is completed (`complete`)."""
    unstored, missing, unexpected, mismatched = _compare(model, lazy)
    check_weights(src, missing, [lazy.names[k] for k in unexpected], mismatched, allow=False)
    _check_ties(lazy, src)
    complete(model, lazy, unstored)


def complete(model: nn.Module, lazy: Lazy, unstored: list[str]) -> None:
    """The stored buffers read (`read_buffers`), and the `unstored` parameters made as transformers makes them
    (`_make_unstored`)."""
    read_buffers(model, lazy)
    _make_unstored(model, unstored)


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
    under different seeds: one that comes out random differs between two loads, so the folder converts only
    in memory."""
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
            raise InMemoryOnly(f"{name} is not stored and transformers initialises it at random")


def _check_ties(lazy: Lazy, src: str) -> None:
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
                raise InMemoryOnly(f"{src} stores the tied tensors {keys[0]} and {key} with different values "
                                    "(transformers unties them)")
