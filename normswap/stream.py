"""Convert a safetensors checkpoint folder without loading the model: bounded memory, bit-identical result.

1. The model is built on the meta device (buffers real); only 1-D tensors (norm gains/biases, layer
   biases: O(layers x width)) are read, so `find_norms`, the exact plan and `convert` itself run as in
   memory: the norms are swapped, biases created, output fixes and config.normswap recorded, and the
   method returns which layer gets which edit instead of doing it (`_StreamExact`).
2. The output is written tensor by tensor in state_dict order (`shards.write`): an edited layer's
   weights are read, edited by the in-memory code (`exact._centre_step`, `exact._fold`), written and
   put back on meta; other tensors are copied through. Peak: a few of the largest tensors.
3. Verification runs the original folder and the written one on the sample inputs through lazy models:
   each module's tensors are mapped from the file (copy-on-write) just before its forward and dropped
   after it (`Lazy`).

The plan is `exact.plan`'s, from one traced forward of the meta model whose modules read their weights
from the checkpoint just for their own forward (`_lazy_plan`): the same plan as in memory, in bounded memory.
"""
from __future__ import annotations

import types
from pathlib import Path

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from normswap import progress, shards
from normswap.errors import NormswapError
from normswap.parity import compare, refuse_nonfinite, sample_inputs
from normswap.surgery.methods import MethodResult, get_method
from normswap.surgery.trace import IGNORE, _tensors

ZERO_OK = "normswap_zero_ok"  # module attribute: params missing from the checkpoint start as zeros


def streamable(src: str) -> bool:
    """True for a local folder of plain (not yet converted) safetensors weights; not with
    --allow-missing-weights (a missing tensor's random values exist only in memory)."""
    from normswap.io import LOAD_POLICY
    path = Path(src).expanduser()
    if LOAD_POLICY.allow_missing_weights:
        return False
    if not (path.is_dir() and (path / "config.json").exists() and shards.has_weights(path)):
        return False
    from normswap.io import read_config
    return not read_config(path).get("normswap")


def _trim() -> None:
    """Give freed heap memory back to the system. glibc keeps freed blocks of a few MB (the edits'
    float64 temporaries) and RSS crept up by ~0.5x the checkpoint on a 58 MB model without this."""
    global _TRIM
    if _TRIM is None:
        try:
            import ctypes
            _TRIM = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):  # not glibc: nothing to do
            _TRIM = False
    if _TRIM:
        _TRIM(0)


_TRIM = None


class Lazy:
    """Swaps a module's own tensors in from a checkpoint on demand, and back out to meta.

    The values go into the model's existing tensor objects (`torch.utils.swap_tensors`), never into new
    ones: tied weights stay tied, and whatever holds a parameter (the plan's trace) sees the real values."""

    def __init__(self, model: nn.Module, reader: shards.Reader, bar=None):
        self.reader, self.bar = reader, bar
        self.groups: dict[str, list[str]] = {}   # state name -> all names of that (tied) tensor
        for name, first in shards.aliases(model).items():
            self.groups.setdefault(first, []).append(name)
            self.groups[name] = self.groups[first]
        self.names = _checkpoint_names(model, reader.keys())
        self.held: dict[int, list] = {}   # id(module) -> [(its tensor, the meta stand-in swapped out)]
        self.running: list[nn.Module] = []   # modules whose forward is running, innermost last
        self.stuck: list = []   # frees refused while something else held the tensor (a view kept by the trace)

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
        value = self.reader.get(key).to(dtype)
        if self.bar is not None:
            self.bar.update(value.numel() * value.element_size())
        return value

    def _load_one(self, module: nn.Module, full: str, n: str, t: torch.Tensor, held: list | None) -> None:
        value = self.read(full, t.dtype)
        if value is None:
            if n not in getattr(module, ZERO_OK, ()):
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
        F.multi_head_attention_forward) is loaded when a torch call reads it (under `_OnUse`) and freed with
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


class _OnUse(TorchFunctionMode):
    def __init__(self, *lazies: Lazy):
        super().__init__()
        self.lazies = lazies

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = _tensors((args, kwargs))
        if not any(x.is_meta for x in tensors) or getattr(func, "__name__", "") in IGNORE:
            return func(*args, **kwargs)
        if getattr(func, "__name__", "") == "__get__":   # .dtype, .shape, .device: no values needed
            if getattr(func, "__self__", None) is torch.Tensor.device and self.owned(tensors):
                return torch.device("cpu")   # where its values are: code builds tensors on it (WavLM's positions)
            out = func(*args, **kwargs)
            if not _tensors(out):
                return out
        for lazy in self.lazies:
            lazy.use(tensors)
        return func(*args, **kwargs)

    def owned(self, tensors) -> bool:
        return any(x.is_meta and id(x) in lazy.owner for x in tensors for lazy in self.lazies)


class NotStreamable(NormswapError):
    """The folder converts, but not in bounded memory: the caller loads it in memory instead."""


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


def _check_weights(model: nn.Module, lazy: Lazy, src: Path) -> None:
    """As load_model does: every parameter in the checkpoint with its shape, nothing unexpected."""
    import re

    from normswap.io import _check_weights as check
    alias = shards.aliases(model)
    params = [k for k, _ in model.named_parameters(remove_duplicate=False) if alias.get(k, k) == k]
    state = model.state_dict(keep_vars=True)
    missing = [k for k in params if lazy.key(k) is None]
    ignore = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []]
    known = set(lazy.names)
    unexpected = [lazy.names.get(k, k) for k in known - set(state) if not any(p.search(k) for p in ignore)]
    mismatched = [(k, lazy.reader.meta(lazy.key(k))[1], list(state[k].shape)) for k in params
                  if lazy.key(k) is not None and list(lazy.reader.meta(lazy.key(k))[1]) != list(state[k].shape)]
    check(str(src), sorted(missing), sorted(unexpected), mismatched, allow=False)


def _lazy_plan(lazy: Lazy, inputs: dict):
    """`exact.plan` on the meta model: its one traced forward reads each module's weights just before the
    module runs and puts them back on meta after it."""
    from normswap.surgery.exact import plan as exact_plan

    def plan_fn(model: nn.Module, sites):
        handles = lazy.attach(model)
        try:
            with _OnUse(lazy):
                return exact_plan(model, sites, inputs)
        finally:
            for h in handles:
                h.remove()
            lazy.free_all()
    return plan_fn


def _checkpoint_names(model: nn.Module, keys: list[str]) -> dict[str, str]:
    """Model state name -> checkpoint key, renamed as transformers renames when loading (base-model prefix,
    legacy names such as GPT-NeoX's embed_out); tensors it would convert (merge, split) are refused."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, rename_source_key
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if not isinstance(t, WeightRenaming)]
    meta = model.state_dict()
    out = {}
    for key in keys:
        new, converted = rename_source_key(key, renamings, converters, model.base_model_prefix, meta)
        if converted is not None:
            raise NotStreamable(f"cannot stream {key}: transformers transforms it when loading")
        out[new] = key
    return out


def skeleton(path: Path, config=None, dtype: torch.dtype | None = None, cls=None) -> nn.Module:
    """The model of folder `path` on the meta device (buffers real), in `dtype` or the stored one.
    Never runs the folder's own code (no remote code)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig

    from normswap.io import auto_class
    config = config or AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    if dtype is None:
        reader = shards.Reader(path)
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


class _StreamExact(MethodResult):
    """What the exact method would do, recorded per layer for the streaming pass."""

    def __init__(self, edits: dict[str, list], fixes: dict, inputs: list[str], **kw):
        super().__init__("exact", **kw)
        self.edits, self.fixes, self.inputs = edits, fixes, inputs

    def after_swap(self, model: nn.Module, report) -> None:
        from normswap.surgery.exact import install_fixes
        install_fixes(model, self.fixes, self.inputs)


@torch.no_grad()
def _plan_exact(model: nn.Module, sites, p) -> _StreamExact:
    """`exact.convert_exact`'s steps, recorded per module instead of applied (same order, so the same bits).
    Norm biases and LayerScale parameters are 1-D, hence already real on the meta model."""
    from normswap.surgery.exact import bias_fates, output_fix
    from normswap.surgery.walk import ensure_bias
    edits: dict[str, list] = {}
    fixes: dict = {}
    added: list[str] = []
    inputs: list[str] = []
    for step in p.steps:
        if step.op == "centre":
            owner = step.target[6:].rpartition(".")[0] if step.target.startswith("param:") else step.target
            edits.setdefault(owner, []).append(("centre", step))
        elif step.op == "fold":
            b = model.get_submodule(step.norm).bias.detach().double()
            layer = model.get_submodule(step.target)
            _, created = ensure_bias(layer)  # on meta: the pass below fills it
            if created:
                added.append(step.target)
                setattr(layer, ZERO_OK, ("bias",))
            edits.setdefault(step.target, []).append(("fold", b))
        elif step.op == "scale":   # LayerScale (target) folded into the layer before it (norm)
            lam = next(model.get_submodule(step.target).parameters())
            edits.setdefault(step.norm, []).append(("scale", lam.detach().clone()))
            lam.fill_(1.0)
        elif step.norm == "input":
            inputs.append(step.target)
        else:
            fixes[step.target] = output_fix(model, step)
    return _StreamExact(edits, fixes, inputs, bias=bias_fates(p), added_biases=added)


def _method(method: str, plan_fn):
    """The convert method for streaming: exact/auto record edits; naive needs none."""
    from normswap.surgery.exact import plan_or_naive
    naive = get_method("naive")

    def run(model: nn.Module, sites) -> MethodResult:
        if method == "naive":
            return naive(model, sites)
        return plan_or_naive(method, model, sites, plan_fn, _plan_exact)
    return run


def _edited_tensors(model: nn.Module, lazy: Lazy, specs, edits: dict[str, list]):
    """Yield the converted model's tensors in `specs` order; edited layers are read, edited, dropped."""
    from normswap.surgery.exact import _centre_step, _fold, _scale_layer
    left: dict[str, int] = {}
    for key, _, _ in specs:
        owner = key.rpartition(".")[0]
        if owner in edits:
            left[owner] = left.get(owner, 0) + 1
    with torch.no_grad():
        for key, dtype, _ in specs:
            owner, _, attr = key.rpartition(".")
            module = model.get_submodule(owner)
            if owner in edits and edits[owner] is not None:
                lazy.load(model, owner)
                for op, arg in edits[owner]:
                    if op == "fold":
                        _fold(module, arg)
                    elif op == "scale":
                        _scale_layer(module, arg)
                    else:   # exact's own step: fp64 slices of at most 64 MB, so a vocabulary fits too
                        _centre_step(model, arg.target, arg.group)
                edits[owner] = None  # done: never edit twice
            t = getattr(module, attr)
            if t.is_meta:
                t = lazy.read(key, dtype)
                if t is None:
                    raise NormswapError(f"{key} is not in the checkpoint")
            yield t
            if owner in left:
                left[owner] -= 1
                if not left[owner]:
                    lazy.free(module, min_dim=2)
                    _trim()   # the edits' float64 temporaries


def _sample_inputs(model: nn.Module) -> list[dict]:
    """`parity.sample_inputs` for a model whose parameters are on meta: the inputs go to the CPU."""
    dtype = next(model.parameters()).dtype
    stand_in = types.SimpleNamespace(config=model.config, main_input_name=getattr(model, "main_input_name", ""),
                                     parameters=lambda: iter([torch.empty(0, dtype=dtype)]), forward=model.forward)
    return sample_inputs(stand_in)


def verify_lazy(src: Path, out: Path, dtype: torch.dtype):
    """Parity of folder `out` (saved by normswap) against folder `src` with neither model in memory."""
    from normswap.io import _base_config, apply_structure, read_config
    raw = read_config(out)   # rebuilt from the recorded base class, as from_pretrained does: no remote code
    config, cls = _base_config(raw, raw["normswap"], str(out))
    converted = skeleton(out, config, dtype, cls)
    apply_structure(converted, raw["normswap"])
    reference = skeleton(src, None, dtype)
    inputs = _sample_inputs(reference)
    total = len(inputs) * (shards.Reader(src).total_size() + shards.Reader(out).total_size())
    with progress.bar(total=total, desc="verify", unit="B", unit_scale=True) as bar:
        lazies = []
        for model, folder in ((reference, src), (converted, out)):
            lazies.append(Lazy(model, shards.Reader(folder, mapped=True), bar))
            lazies[-1].attach(model.float())
        with _OnUse(*lazies):
            return compare(reference, converted, inputs)


def convert_folder(src: str | Path, out: str | Path, to: str = "rmsnorm", method: str = "auto",
                   p: float | None = None, dtype: str | None = None, overwrite: bool = False,
                   max_shard_size: int | str = shards.DEFAULT_MAX_SHARD_SIZE):
    """Convert the safetensors folder `src` into `out` in bounded memory; (report, parity).

    Same result, bit for bit, as `load_model` + `convert` + `save_pretrained`; exact conversions are
    verified on sample inputs before `out` appears.
    """
    import normswap
    from normswap.io import DTYPES, load_tokenizer
    from normswap.surgery.exact import PARTIAL_WARNING, judge
    src = Path(src).expanduser()
    target = DTYPES[dtype] if dtype else None
    try:
        model = skeleton(src, None, target)
    except Exception as e:  # as load_model says it: one line
        raise NormswapError(f"cannot load model from {src}: {str(e).splitlines()[0]}") from None
    if (src / "generation_config.json").exists():  # as from_pretrained does
        from transformers import GenerationConfig
        model.generation_config = GenerationConfig.from_pretrained(src)
    lazy = Lazy(model, shards.Reader(src, mapped=True))
    _check_weights(model, lazy, src)
    _check_ties(lazy, src)
    for name, _ in model.named_modules():  # norms and biases: small, and what the plan looks at
        lazy.load(model, name, max_dim=1, keep=True)
    run = _method(method, _lazy_plan(lazy, _sample_inputs(model)[0]))
    holder: dict = {}

    def method_fn(m, sites):
        holder["result"] = run(m, sites)
        return holder["result"]

    report = normswap.convert(model, to=to, method=method_fn, p=p)
    if not report.converted:
        return report, None
    report.method = holder["result"].method
    edits = getattr(holder["result"], "edits", {})
    specs = shards.saved_specs(model)
    stored = next(t.dtype for t in model.parameters() if t.is_floating_point())
    parity: dict = {}

    def check(tmp: Path) -> None:  # runs on the written folder before it replaces `out`
        parity["p"] = verify_lazy(src, tmp, stored)
        refuse_nonfinite(parity["p"])
        if report.method == "exact":
            report.verification = judge(parity["p"], stored, enforce=to == "rmsnorm")

    with progress.bar(total=shards.total_bytes(specs), desc="convert", unit="B", unit_scale=True) as bar:
        lazy.bar = bar
        model._normswap_tensors = lambda specs: _edited_tensors(model, lazy, specs, edits)
        normswap.save_pretrained(model, out, tokenizer=load_tokenizer(str(src)), overwrite=overwrite,
                                 max_shard_size=max_shard_size, check=check)
    if to == "prmsnorm" and report.method == "exact":
        report.warnings.append(PARTIAL_WARNING)
    return report, parity["p"]
