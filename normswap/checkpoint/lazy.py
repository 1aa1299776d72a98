"""Lazy models: a model on the meta device whose tensors are read from a safetensors checkpoint only while
they are needed (a module's own forward, a torch call reading them), then put back on meta.

A lazy conversion (`pipeline.lazy_convert`) plans, edits and verifies whole checkpoints this way in bounded
memory.
"""
from __future__ import annotations

import ctypes
import functools

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightRenaming, rename_source_key

from normswap.io import safetensors
from normswap.errors import NormswapError
from normswap.surgery.trace import IGNORE, tensors_in

class InMemoryOnly(NormswapError):
    """The folder converts, but not lazily (in bounded memory): the caller loads it in memory instead."""


def checkpoint_names(model: nn.Module, keys: list[str]) -> dict[str, str]:
    """Model state name -> checkpoint key, renamed as transformers renames when loading (base-model prefix,
    legacy names such as GPT-NeoX's embed_out); tensors it would convert (merge, split) are refused."""
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if not isinstance(t, WeightRenaming)]
    meta = model.state_dict()
    out = {}
    for key in keys:
        new, converted = rename_source_key(key, renamings, converters, model.base_model_prefix, meta)
        if converted is not None:
            raise InMemoryOnly(f"cannot stream {key}: transformers transforms it when loading")
        out[new] = key
    return out


@functools.cache
def _libc():
    """glibc, or None (not glibc: nothing to give back)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None
    except OSError:
        return None


@functools.cache
def bound_heap() -> None:
    """Blocks of 1 MB and more (a layer's activations, a sample's logits) come from the system and go back to it
    when freed (glibc's M_MMAP_THRESHOLD, process-wide, set once). glibc's own threshold grows with the blocks
    freed, after which they stay in the heap: a lazy GPT-2 convert held ~0.25 GB more at its peak."""
    libc = _libc()
    if libc is not None:
        libc.mallopt(-3, 1 << 20)   # M_MMAP_THRESHOLD


def trim() -> None:
    """Give freed heap memory back to the system. glibc keeps freed blocks of a few MB (the edits'
    float64 temporaries) and RSS crept up by ~0.5x the checkpoint on a 58 MB model without this."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)




class Lazy:
    """Swaps a module's own tensors in from a checkpoint on demand, and back out to meta.

    The values go into the model's existing tensor objects (`torch.utils.swap_tensors`), never into new
    ones: tied weights stay tied, and whatever holds a parameter (the plan's trace) sees the real values."""

    def __init__(self, model: nn.Module, reader: safetensors.Reader, bar=None):
        self.reader, self.bar = reader, bar
        self.groups: dict[str, list[str]] = {}   # state name -> all names of that (tied) tensor
        for name, first in safetensors.aliases(model).items():
            self.groups.setdefault(first, []).append(name)
            self.groups[name] = self.groups[first]
        self.names = checkpoint_names(model, reader.keys())
        self.held: dict[int, list] = {}   # id(module) -> [(its tensor, the meta stand-in swapped out)]
        self.running: list[nn.Module] = []   # modules whose forward is running, innermost last
        self.stuck: list = []   # frees refused while something else held the tensor (a view kept by the trace)
        self.new: set[str] = set()   # state names the conversion created (added biases): zeros, not read
        # state name -> the dtype the model was loaded in, when it runs upcast (verification in fp32): values
        # are rounded through it, so that an fp32 checkpoint loaded in bf16 is the bf16 model, not the fp32 one
        self.via: dict[str, torch.dtype] = {}

    def key(self, name: str) -> str | None:
        return next((self.names[n] for n in self.groups.get(name, [name]) if n in self.names), None)

    def load(self, model: nn.Module, module_name: str, max_dim: int = 99, keep: bool = False) -> None:
        """Make `module_name`'s own meta params (and persistent buffers) of up to max_dim dims real; `keep`:
        for good (`free` leaves them)."""
        module = model.get_submodule(module_name)
        prefix = module_name + "." if module_name else ""
        held = self.held.setdefault(id(module), [])
        for store in (module._parameters, module._buffers):
            for n, t in list(store.items()):
                if t is None or not t.is_meta or t.dim() > max_dim:
                    continue
                self._load_one(module, prefix + n, n, t, None if keep else held)

    def read(self, name: str, dtype: torch.dtype) -> torch.Tensor | None:
        """The checkpoint's tensor for model state `name` in `dtype` (counted on the bar); None if absent."""
        key = self.key(name)
        if key is None:
            return None
        stored = self.reader.get(key)
        if self.bar is not None:   # the file's bytes (the totals are file sizes), not the cast's
            self.bar.update(stored.numel() * stored.element_size())
        via = self.via.get(name)
        return (stored.to(via) if via is not None and stored.is_floating_point() else stored).to(dtype)

    def _load_one(self, module: nn.Module, full: str, n: str, t: torch.Tensor, held: list | None) -> None:
        value = self.read(full, t.dtype)
        if value is None:
            if full not in self.new:
                raise NormswapError(f"{full} is not in the checkpoint")
            value = torch.zeros(t.shape, dtype=t.dtype)
        real = nn.Parameter(value, requires_grad=False) if isinstance(t, nn.Parameter) else value
        torch.utils.swap_tensors(t, real)   # `real` now holds the meta stand-in
        if held is not None:
            held.append((t, real))

    def free(self, module: nn.Module, min_dim: int = 0) -> None:
        """Put what `load` made real in `module` (of min_dim dims or more) back on meta."""
        held = self.held.pop(id(module), [])
        for t, meta in held:
            if t.dim() >= min_dim:
                self._unload(t, meta)
        rest = [(t, m) for t, m in held if t.dim() < min_dim]
        if rest:
            self.held[id(module)] = rest

    def _unload(self, t: torch.Tensor, meta: torch.Tensor) -> None:
        try:
            torch.utils.swap_tensors(t, meta)
        except RuntimeError:   # still referenced (a view of it kept alive by the plan's trace): later
            self.stuck.append((t, meta))

    def free_all(self) -> None:   # after a forward (one that failed midway too)
        import gc
        pairs = [pair for pairs in self.held.values() for pair in pairs] + self.stuck
        self.held.clear()
        self.running.clear()
        self.stuck = []
        gc.collect()
        for t, meta in pairs:
            torch.utils.swap_tensors(t, meta)

    def attach(self, model: nn.Module) -> list:
        """Hooks that load each module's tensors before its forward and free them after it; the handles.
        A tensor read without its module running (WavLM's attention passes its projections' weights to
        F.multi_head_attention_forward) is loaded when a torch call reads it (under `LoadOnUse`) and freed with
        the innermost module running then."""
        handles = []
        self.owner = {}
        for name, module in model.named_modules():
            prefix = name + "." if name else ""
            for store in (module._parameters, module._buffers):
                for n, t in store.items():
                    if t is not None and t.is_meta:
                        self.owner[id(t)] = (t, module, prefix + n, n)
            handles.append(module.register_forward_pre_hook(lambda m, a, n=name: self._enter(model, m, n)))
            handles.append(module.register_forward_hook(lambda m, a, o: self._leave(m)))
        return handles

    def _enter(self, model: nn.Module, module: nn.Module, name: str) -> None:
        self.running.append(module)
        if module._parameters:
            self.load(model, name)

    def _leave(self, module: nn.Module) -> None:
        self.free(module)
        if self.running and self.running[-1] is module:
            self.running.pop()

    def use(self, tensors) -> None:
        """Make real the meta tensors of this model among `tensors` (the arguments of a torch call)."""
        for x in tensors:
            hit = self.owner.get(id(x)) if x.is_meta else None
            if hit is not None and hit[0] is x:
                t, module, full, n = hit
                holder = self.running[-1] if self.running else module
                self._load_one(module, full, n, t, self.held.setdefault(id(holder), []))


class LoadOnUse(TorchFunctionMode):
    """Within it, a torch call that reads a lazy model's meta tensor loads it first (see `Lazy.attach`)."""

    def __init__(self, *lazies: Lazy):
        super().__init__()
        self.lazies = lazies

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = tensors_in((args, kwargs))
        if not any(x.is_meta for x in tensors) or getattr(func, "__name__", "") in IGNORE:
            return func(*args, **kwargs)
        if getattr(func, "__name__", "") == "__get__":   # .dtype, .shape, .device: no values needed
            if getattr(func, "__self__", None) is torch.Tensor.device and self.owned(tensors):
                return torch.device("cpu")   # where its values are: code builds tensors on it (WavLM's positions)
            out = func(*args, **kwargs)
            if not tensors_in(out):
                return out
        for lazy in self.lazies:
            lazy.use(tensors)
        return func(*args, **kwargs)

    def owned(self, tensors) -> bool:
        return any(x.is_meta and id(x) in lazy.owner for x in tensors for lazy in self.lazies)
