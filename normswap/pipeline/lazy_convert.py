"""Convert a safetensors checkpoint folder lazily, without loading the model: bounded memory, bit-identical
result.

1. The model is built on the meta device (buffers real); only 1-D tensors (norm gains/biases, layer
   biases: O(layers x width)) are read, so `find_norms`, the exact plan and `convert` itself run as in
   memory: the norms are swapped, biases created, output fixes and config.normswap recorded, and the
   exact method's interpreter records which layer gets which edit instead of doing it (`Deferred`,
   `surgery.interpret.Recorder`).
2. The output is written tensor by tensor in state_dict order (`safetensors.write`): an edited layer's
   weights are read, edited as in memory (its recorded edits replayed), written and put back on meta;
   other tensors are copied through. Peak: a few of the largest tensors.
3. Verification runs the original folder and the written one on the sample inputs through lazy models:
   each module's tensors are mapped from the file (copy-on-write) just before its forward and dropped
   after it (`lazy.Lazy`). The original's outputs go to an unlinked file in the written folder
   (`io.spill`) and are compared block by block with the converted model's as each output comes.

The plan is `exact.plan`'s, from one traced forward of the meta model whose modules read their weights
from the checkpoint just for their own forward: the same plan as in memory, in bounded memory.
"""
from __future__ import annotations

import types
from pathlib import Path

import torch
from torch import nn
from transformers import GenerationConfig

from normswap import progress
from normswap.checkpoint.lazy import InMemoryOnly, Lazy, LoadOnUse, bound_heap, trim
from normswap.checkpoint.meta import open_folder, read_buffers, reopen, skeleton
from normswap.errors import NormswapError, reraised
from normswap.io import safetensors
from normswap.folder import fingerprint, portable, fixes
from normswap.io.spill import Spill
from normswap.models.demo import DEMO_NAME
from normswap.models.inputs.examples import model_inputs
from normswap.models.load import load_tokenizer
from normswap.models.rebuild import base_config
from normswap.models.save import save_pretrained
from normswap.models.source import DTYPES, Folder, Source, dtype_name, read_config, read_folder
from normswap.norms import build_norm
from normswap.parity import Parity, compare
from normswap.surgery import exact
from normswap.surgery.convert import convert_with
from normswap.surgery.interpret import ExactResult, Recorder, interpret
from normswap.surgery.plan import Plan
from normswap.surgery.report import ConversionReport
from normswap.surgery.verification import enforced, judge, refuse_nonfinite


def lazily_convertible(src: Source) -> bool:
    """True for a local folder of plain (not yet converted) safetensors weights, from SRC as read once
    (`read_source`: its config.json is not read again; `normswap-demo` is a name, not such a folder)."""
    return src.local and src.text != DEMO_NAME and safetensors.has_weights(src.where) \
        and not src.config.get("normswap")


class Deferred:
    """The exact method's steps (`surgery.methods.ExactSteps`) on a lazy model: planned by one traced forward
    that reads each module's weights just before it runs; applied by recording each layer's edits."""

    def __init__(self, lazy: Lazy, inputs: list[dict]):
        self.lazy, self.batches, self.seen = lazy, inputs, {}   # seen: the trace, for plans with fewer norms

    def inputs(self, model: nn.Module) -> list[dict]:
        return self.batches

    def plan(self, model: nn.Module, sites) -> Plan:
        handles = self.lazy.attach(model)
        try:
            with LoadOnUse(self.lazy):
                return exact.plan(model, sites, self.batches, seen=self.seen)
        finally:
            for h in handles:
                h.remove()
            self.lazy.free_all()

    def apply(self, model: nn.Module, sites, p: Plan) -> ExactResult:
        """The plan's steps, recorded per layer for the writer (`surgery.interpret`); verified once written."""
        result = interpret(model, p, Recorder())
        self.lazy.new.update(f"{name}.bias" for name in result.added_biases)   # created on meta: not in SRC
        return result


def _edited_tensors(model: nn.Module, lazy: Lazy, specs, edits: Recorder):
    """Yield the converted model's tensors in `specs` order; edited layers are read, edited, dropped."""
    left: dict[str, int] = {}
    for key, _, _ in specs:
        owner = key.rpartition(".")[0]
        if owner in edits:
            left[owner] = left.get(owner, 0) + 1
    with torch.no_grad():
        for key, dtype, _ in specs:
            owner, _, attr = key.rpartition(".")
            module = model.get_submodule(owner)
            if owner in edits:   # exact's edits: fp64 slices of at most 64 MB, so a vocabulary fits too
                lazy.load(model, owner)
                edits.replay(model, owner)
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
                    trim()   # the edits' float64 temporaries


def _sample_inputs(model: nn.Module, examples: list | None) -> list[dict]:
    """`model_inputs` (its samples and the user's `examples`) for a model whose parameters are on meta: the
    inputs go to the CPU."""
    dtype = next(model.parameters()).dtype
    stand_in = types.SimpleNamespace(config=model.config, main_input_name=getattr(model, "main_input_name", ""),
                                     parameters=lambda: iter([torch.empty(0, dtype=dtype)]), forward=model.forward)
    try:
        return model_inputs(stand_in, examples)
    except NormswapError as e:   # e.g. inputs only a trial forward can settle: in memory, they can be
        raise InMemoryOnly(str(e)) from None


def lazy_folder(out: Path, dtype: torch.dtype, bar=None) -> tuple[nn.Module, Lazy, dict]:
    """The model of folder `out` (saved by normswap) on meta, rebuilt from the recorded base class as
    from_pretrained does (no remote code) by the code the folder ships, its tensors read on use; (model, its
    Lazy, the section)."""
    raw = read_config(out)
    config, cls = base_config(raw, raw["normswap"], str(out))
    converted = skeleton(config, dtype, cls)
    with reraised(portable.InvalidConversion):   # what from_pretrained and the folder's own code run
        fixes.rebuild(converted, raw["normswap"], str(out), build_norm, quiet=True)   # the report says it
    lazy = Lazy(converted, safetensors.Reader(out, mapped=True), bar)
    read_buffers(converted, lazy)
    return converted, lazy, raw["normswap"]


def fingerprint_lazy(out: Path, dtype: torch.dtype) -> dict:
    """The fingerprint of the folder `out` as written (converted lazily: the converted model exists only there), its
    probe run on the model rebuilt from it as every loader rebuilds it, in the stored dtype."""
    converted, lazy, section = lazy_folder(out, dtype)
    found = section.get("fingerprint") or {}
    if "probe" not in found:
        return found
    handles = lazy.attach(converted)
    try:
        with LoadOnUse(lazy):
            return fingerprint.record(converted, found["probe"])
    finally:
        for h in handles:
            h.remove()
        lazy.free_all()


def verify_lazy(original: Folder, out: Path, dtype: torch.dtype, show_progress: bool = False,
                skip: dict | None = None, examples: list | None = None) -> Parity:
    """Parity of folder `out` (saved by normswap) against the folder `original` was read from (`read_folder`: not
    checked again) with neither model in memory (the `skip` outputs, name -> why, not compared: see
    `parity.reference_outputs`)."""
    reference, source = reopen(original, dtype)
    inputs = _sample_inputs(reference, examples)
    total = len(inputs) * (original.reader.total_size() + safetensors.Reader(out).total_size())
    with progress.bar(total=total, desc="verify", unit="B", unit_scale=True, enabled=show_progress) as bar:
        source.bar = bar
        converted, lazy, _ = lazy_folder(out, dtype, bar)
        lazies = [source, lazy]
        for model, lazy in zip((reference, converted), lazies):
            # run in fp32, with the values of the model as loaded
            lazy.via = {n: t.dtype for n, t in model.state_dict(keep_vars=True).items() if t.is_floating_point()}
            lazy.attach(model.float())
        # the original's outputs on disk: the converted model's long row runs with none of them in memory
        with LoadOnUse(*lazies), Spill(out) as spill:
            return compare(reference, converted, inputs, skip, spill)


class _Verification:
    """The check `save_pretrained` runs on the written folder before it replaces OUT: SRC's weights files
    unchanged since they were first read, parity against the source, judged for an exact conversion (kept in
    `parity`)."""

    def __init__(self, src: Folder, report: ConversionReport, dtype: torch.dtype, show_progress: bool,
                 skip: dict, examples: list | None):
        self.src, self.report, self.dtype, self.show_progress, self.skip = src, report, dtype, show_progress, skip
        self.examples = examples
        self.parity: Parity | None = None

    def __call__(self, folder: Path) -> None:
        self.parity = verify_lazy(self.src, folder, self.dtype, self.show_progress, self.skip, self.examples)
        self.src.reader.check_unchanged(self.src.src)   # SRC rewritten meanwhile: OUT would mix old and new
        refuse_nonfinite(self.parity)
        if self.report.method == "exact":
            self.report.verification = judge(self.parity, self.dtype, enforce=enforced(self.report))


def convert_folder(src: str | Path | Folder, out: str | Path, to: str = "rmsnorm", method: str = "auto",
                   p: float | None = None, dtype: str | None = None, overwrite: bool | str = False,
                   max_shard_size: int | str = safetensors.DEFAULT_MAX_SHARD_SIZE,
                   show_progress: bool = False, examples: list | None = None) -> tuple[ConversionReport, Parity | None]:
    """Convert the safetensors folder `src` (a path, or a `Folder` already read) into `out` in bounded memory;
    (report, parity).

    Same result, bit for bit, as `load_model` + `convert` + `save_pretrained`; exact conversions are
    verified on sample inputs (and the user's `examples`, batches as `convert`'s example_inputs) before `out`
    appears. Raises `lazy.InMemoryOnly` (before anything is
    written) for a folder that converts only in memory.
    """
    dtype = dtype_name(dtype)
    bound_heap()
    folder = src if isinstance(src, Folder) else read_folder(Path(src).expanduser())
    model, lazy = open_folder(folder, DTYPES[dtype] if dtype else None)
    if (folder.path / "generation_config.json").exists():  # as from_pretrained does
        model.generation_config = GenerationConfig.from_pretrained(folder.path)
    for name, _ in model.named_modules():  # norms and biases: small, and what the plan looks at
        lazy.load(model, name, max_dim=1, keep=True)
    report, result = convert_with(model, to, method, p, steps=Deferred(lazy, _sample_inputs(model, examples)))
    if not report.converted:
        return report, None
    edits = result.edits if isinstance(result, ExactResult) else Recorder()
    specs = safetensors.saved_specs(model)
    stored = next(t.dtype for t in model.parameters() if t.is_floating_point())
    verification = _Verification(folder, report, stored, show_progress, result.unverified, examples)
    with progress.bar(total=safetensors.total_bytes(specs), desc="convert", unit="B", unit_scale=True,
                      enabled=show_progress) as bar:
        lazy.bar = bar
        save_pretrained(model, out, tokenizer=load_tokenizer(folder.src), overwrite=overwrite,
                        max_shard_size=max_shard_size, check=verification,
                        tensors=_edited_tensors(model, lazy, specs, edits), source=folder.path,
                        fingerprint=lambda written: fingerprint_lazy(written, stored))
    return report, verification.parity
