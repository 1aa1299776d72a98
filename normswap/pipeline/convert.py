"""`convert_checkpoint`: the whole flow `normswap convert` runs, for Python callers too.

Load SRC (or convert it lazily, tensor by tensor, when it is a local safetensors folder and nothing needs the whole
model), convert, optionally heal on text, rotate the residual streams (`surgery.rotate`), compare with the
original, export to ONNX, save to OUT. Every check that can fail runs before the slow work; OUT (and the ONNX
file) appear only once everything passed.
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from normswap.checkpoint.lazy import InMemoryOnly
from normswap.errors import Interrupted, NormswapError
from normswap.export.onnx import ExportReport, export_onnx
from normswap.export.onnx import check_replaceable as check_onnx_replaceable
from normswap.healing.loop import heal
from normswap.healing.report import HealReport
from normswap.healing.tracking import LOG_FILE
from normswap.io import safetensors
from normswap.io.atomic import check_output, check_replaceable
from normswap.models.inputs.examples import batches_of, check_examples, model_inputs
from normswap.models.load import load_model
from normswap.models.save import save_pretrained
from normswap.norms import NormType
from normswap.models.source import Source, check_code, read_folder, read_source, source_folder
from normswap.parity import Parity, compare_to, reference_outputs
from normswap.pipeline.device import resolve_device
from normswap.pipeline.options import ConvertOptions
from normswap.pipeline.lazy_convert import convert_folder, lazily_convertible
from normswap.surgery.convert import convert
from normswap.surgery.exact import auto_or_naive
from normswap.surgery.methods import Method
from normswap.surgery.report import ConversionReport
from normswap.surgery.rotate import RotationReport, rotate
from normswap.surgery.verification import broken_source, refuse_nonfinite
from normswap.surgery.walk import Skip
from normswap.textdata import read_texts

DEFAULTS = ConvertOptions()   # frozen


@dataclass
class ConvertResult:
    report: ConversionReport
    parity: Parity | None                 # None when there was nothing to convert; healed: after healing
    output: str | None                    # OUT, once written
    healed: HealReport | None = None
    exported: ExportReport | None = None
    streamed: bool = False
    notices: list[str] = field(default_factory=list)   # how it ran (e.g. converted in memory, not streamed)
    parity_before_heal: Parity | None = None   # healed: the conversion's parity before the heal (`parity`: after)
    rotation: RotationReport | None = None     # rotated: what `rotate` did (`parity`: the rotated model's)

    @property
    def warnings(self) -> list[str]:
        return self.notices + self.report.warnings

    def to_dict(self) -> dict:
        out = {"report": self.report.to_dict(), "parity": self.parity.to_dict() if self.parity else None,
               "output": self.output}
        if self.parity_before_heal is not None:
            out["parity_before_heal"] = self.parity_before_heal.to_dict()
        return {**out, **({"heal": self.healed.to_dict()} if self.healed else {}),
                **({"rotation": self.rotation.to_dict()} if self.rotation else {}),
                **({"onnx": self.exported.to_dict()} if self.exported else {})}


def _check_outputs(src: str, out: str, o: ConvertOptions) -> None:
    inputs = [("`src`", src)] + [("`data`", d) for d in o.data]
    if isinstance(o.example_inputs, (str, Path)):
        inputs.append(("`example_inputs`", o.example_inputs))
    check_output(out, inputs)
    check_replaceable(out, o.overwrite)
    if o.onnx:
        check_output(o.onnx, inputs + [("`out`", out)])
        if check_output(out) in check_output(o.onnx).parents:
            raise NormswapError(f"`onnx` {o.onnx} is inside `out` {out}: saving OUT would delete it")
        check_onnx_replaceable(o.onnx, o.overwrite)
    safetensors.parse_size(o.max_shard_size)   # a bad size fails before any work
    _check_rotate(o)


def _heal_texts(o: ConvertOptions) -> list[str] | None:
    """The text `finetune_steps` heals on; refused where there is none, or nothing a heal could bring back."""
    if o.finetune_steps and o.method == Method.EXACT and o.to == NormType.RMSNORM:
        raise NormswapError("`finetune_steps` heals a model the conversion changed, and `method='exact'` keeps "
                            "the original's outputs: healing could only move them away; drop `finetune_steps`, or "
                            "use `method='naive'` or `method='auto'` (which heals only where it falls back to naive)")
    if o.finetune_steps and not o.data:
        raise NormswapError("`finetune_steps` needs `data`: plain text files to distil on")
    if o.data and not o.finetune_steps:
        raise NormswapError("`data` is used only with `finetune_steps`")
    return read_texts(o.data) if o.finetune_steps else None


def _exact(report: ConversionReport) -> bool:
    """An RMSNorm conversion that kept the original's outputs (verified): nothing for a heal to bring back."""
    return report.method == Method.EXACT and report.to == NormType.RMSNORM


def _check_rotate(o: ConvertOptions) -> None:
    """A rotation keeps the function only of an exact RMSNorm conversion (`surgery.rotate`)."""
    if not o.rotate:
        given = [f"{k}=True" if getattr(o, k) is True else k for k in ("rotate_method", "seed", "rotate_heads",
                                                                        "rotate_online")
                 if getattr(o, k) != getattr(DEFAULTS, k)]
        if given:
            raise NormswapError(f"`{given[0]}` is used only with `rotate=True`")
        return
    if o.method != Method.EXACT:
        raise NormswapError("`rotate=True` needs `method='exact'`: a rotation keeps the outputs only of a model "
                            "converted exactly")
    if o.to != NormType.RMSNORM:
        raise NormswapError("`rotate=True` needs `to='rmsnorm'`: pRMSNorm's RMS over a few features does not "
                            "commute with a rotation")


def _refuse_broken(src: str, report: ConversionReport) -> None:
    """Nothing converted because the norms are broken (NaN/inf on ordinary inputs, e.g. eps < 0): an error
    saying so, not "nothing to convert" (a model with no LayerNorm)."""
    broken = [s.name for s in report.skipped if s.cause is Skip.BROKEN]
    if broken and not report.converted:
        more = f" and {len(broken) - 3} more" if len(broken) > 3 else ""
        raise NormswapError(f"{src}: {len(broken)} LayerNorm-like modules ({', '.join(broken[:3])}{more}) give "
                            "NaN/inf on ordinary inputs: the model is broken (check its eps and weights); "
                            "nothing was written")


def _lazily(source: Source, out: str, o: ConvertOptions, examples: list | None) -> ConvertResult:
    """A checkpoint folder converted tensor by tensor, in bounded memory, verified before OUT appears;
    InMemoryOnly, before anything is written, where it converts only in memory."""
    folder = read_folder(source.where, source.config)   # its weights' headers, read once for every pass
    def run(method: str) -> ConvertResult:
        report, parity = convert_folder(folder, out, o.to, method, o.p, o.load.dtype, o.overwrite,
                                        o.max_shard_size, o.show_progress, examples)
        _refuse_broken(source.text, report)
        return ConvertResult(report, parity, out if report.converted else None, streamed=True)
    # a failed verification wrote nothing and left the source untouched: under auto, convert it again naively
    return auto_or_naive(o.method, lambda: run(o.method), lambda: run(Method.NAIVE),
                         lambda result: result.report.warnings)


def _load(src: str, o: ConvertOptions, device: torch.device) -> tuple:
    model, tokenizer = load_model(src, options=o.load)
    model.to(device)
    return model, tokenizer


def _converted(src: str, o: ConvertOptions, device: torch.device, model, tokenizer, examples: list | None) -> tuple:
    """(model, tokenizer, report): `model` converted in place; under auto, a failed verification (after the
    edits) loads the source again and converts that naively."""
    def naively() -> tuple:
        fresh, tok = _load(src, o, device)
        return fresh, tok, convert(fresh, to=o.to, method=Method.NAIVE, p=o.p)
    return auto_or_naive(o.method, lambda: (model, tokenizer, convert(model, to=o.to, method=o.method, p=o.p,
                                                                      example_inputs=examples)),
                         naively, lambda converted: converted[2].warnings)


def convert_checkpoint(src: str, out: str | Path, options: ConvertOptions = DEFAULTS) -> ConvertResult:
    """Convert the model at `src` (folder, Hub id or "normswap-demo") and save it to `out`, verified.

    A local safetensors folder converts lazily (bounded memory) unless healing, rotating, ONNX export, a GPU or missing
    weights need the model in memory (a rotation edits every weight reading or writing the stream).
    Nothing to convert: the result's report lists no norm and nothing is written.
    """
    o, out = options, str(out)
    _check_outputs(src, out, o)
    source = read_source(src)
    if source.local:   # a folder with its own model code: refused before any work, lazily or not
        check_code(src, source.config, o.load.trust_remote_code, converting=True)
    device = resolve_device(o.device)
    texts = _heal_texts(o)
    examples = batches_of(o.example_inputs) or None   # a file is read (and checked) now, before any work
    check_examples(examples)
    notices: list[str] = []
    if not texts and not o.rotate and not o.onnx and device.type == "cpu" and not o.load.allow_missing_weights \
            and lazily_convertible(source):
        try:
            return _lazily(source, out, o, examples)
        except InMemoryOnly as e:   # raised before anything is written
            notices.append(f"{e}: converting in memory")
    model, tokenizer = _load(src, o, device)
    # outputs before editing (on the samples and the user's examples), not a copy of the model
    reference = reference_outputs(model, model_inputs(model, examples))
    # Healing distils from the unconverted model while training the converted one: both must exist
    # at once, so this is the one copy, made only when healing.
    original = copy.deepcopy(model) if texts else None
    model, tokenizer, report = _converted(src, o, device, model, tokenizer, examples)
    result = ConvertResult(report, None, None, notices=notices)
    _refuse_broken(src, report)   # its norms named, where they are what gives NaN
    if not report.converted:
        return result
    if reference.nonfinite:   # the source is at fault, whatever the converted model gives
        raise broken_source(reference.nonfinite, reference.output, "; nothing was written")
    if texts and _exact(report):
        result.notices.append("the conversion is exact (the original's outputs): `finetune_steps` was not used, "
                              "since healing could only move them away")
    elif texts:
        if tokenizer is None:
            raise NormswapError("`finetune_steps` needs the model's tokenizer files")
        result.parity_before_heal = compare_to(reference, model, skip=report.unverified)
        result.healed = heal(model, original, texts, tokenizer=tokenizer, steps=o.finetune_steps,
                             progress=o.show_progress)
        if result.healed.interrupted:  # a half-healed model is not what was asked for: write nothing
            raise Interrupted(result.healed.signum)
    skip = report.unverified
    if o.rotate:   # refused (NotRotatable) before any edit, and before anything is written
        result.rotation = rotate(model, o.rotate_method, o.seed or 0, examples, o.rotate_heads, o.rotate_online)
        skip = {**skip, **result.rotation.not_preserved}
    result.parity = compare_to(reference, model, skip=skip)   # those the reports name
    refuse_nonfinite(result.parity)
    # Export (validated, atomic) before saving: a failed export then leaves nothing written at all.
    if o.onnx:
        result.exported = export_onnx(model, o.onnx, overwrite=o.overwrite)
    _save(model, src, out, tokenizer, result.healed, o)
    result.output = out
    return result


def _save(model, src: str, out: str, tokenizer, healed: HealReport | None, o: ConvertOptions) -> None:
    """OUT, with heal's log when healed and SRC's kept files; interrupted, the ONNX file already written is named."""
    try:
        log = {LOG_FILE: json.dumps(healed.log(), indent=1)} if healed else None
        save_pretrained(model, out, tokenizer=tokenizer, overwrite=o.overwrite, max_shard_size=o.max_shard_size,
                        files=log, source=source_folder(src))
    except KeyboardInterrupt as e:
        raise Interrupted.after(e, *([str(o.onnx)] if o.onnx else [])) from None
