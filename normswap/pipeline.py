"""`convert_checkpoint`: the whole flow `normswap convert` runs, for Python callers too.

Load SRC (or stream it, tensor by tensor, when it is a local safetensors folder and nothing needs the whole
model), convert, optionally heal on text, compare with the original, export to ONNX, save to OUT. Every
check that can fail runs before the slow work; OUT (and the ONNX file) appear only once everything passed.
"""
from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from normswap.atomic import check_output, check_replaceable
from normswap.checkpoint import safetensors
from normswap.checkpoint.lazy import NotStreamable
from normswap.checkpoint.stream import convert_folder, streamable
from normswap.errors import Interrupted, NormswapError
from normswap.export.onnx import ExportReport, export_onnx
from normswap.export.onnx import check_replaceable as check_onnx_replaceable
from normswap.healing.loop import heal
from normswap.healing.report import HealReport
from normswap.healing.tracking import LOG_FILE
from normswap.models.load import LoadOptions, load_model
from normswap.models.save import save_pretrained
from normswap.models.source import check_code, read_config, resolve_source
from normswap.parity import Parity, compare_to, reference_outputs, refuse_nonfinite
from normswap.surgery.convert import convert
from normswap.surgery.probe import NONFINITE
from normswap.surgery.exact import VerificationFailed, fell_back
from normswap.surgery.report import ConversionReport
from normswap.textdata import read_texts


def resolve_device(name: str | torch.device | None) -> torch.device:
    """auto: CUDA when available, else CPU. cuda / cuda:N / cpu / mps are checked, not assumed."""
    if isinstance(name, torch.device):
        return name
    name = (name or "auto").strip().lower()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise NormswapError(f"unknown device '{name}': use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise NormswapError(f"`device` {name}: no CUDA device is available here")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise NormswapError(f"`device` {name}: only {torch.cuda.device_count()} CUDA device(s) here")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise NormswapError(f"`device` {name}: MPS is not available here")
    elif device.type not in ("cpu", "cuda", "mps"):
        raise NormswapError(f"unsupported device '{name}': use auto, cpu, cuda or cuda:N")
    return device


@dataclass(frozen=True)
class ConvertOptions:
    """Everything `convert_checkpoint` does besides naming SRC and OUT (`normswap convert`'s options)."""
    to: str = "rmsnorm"                   # "rmsnorm" | "prmsnorm"
    method: str = "auto"                  # "auto" | "exact" | "naive"
    p: float | None = None                # pRMSNorm fraction (default 0.0625)
    load: LoadOptions = LoadOptions()     # dtype, trust_remote_code, allow_missing_weights
    device: str = "auto"                  # where the model is converted and compared
    finetune_steps: int = 0               # then heal this many distillation steps on `data`
    data: tuple[str, ...] = ()            # text files (or folders of .txt) to heal on
    onnx: str | None = None               # then export to this ONNX file (target ort)
    max_shard_size: int | str = safetensors.DEFAULT_MAX_SHARD_SIZE
    overwrite: bool | str = False         # True: replace OUT if normswap wrote it; "any": whatever it is
    show_progress: bool = False           # progress bars on stderr


@dataclass
class ConvertResult:
    report: ConversionReport
    parity: Parity | None                 # None when there was nothing to convert
    output: str | None                    # OUT, once written
    healed: HealReport | None = None
    exported: ExportReport | None = None
    streamed: bool = False
    notices: list[str] = field(default_factory=list)   # how it ran (e.g. converted in memory, not streamed)

    @property
    def warnings(self) -> list[str]:
        return self.notices + self.report.warnings

    def to_dict(self) -> dict:
        out = {"report": self.report.to_dict(), "parity": self.parity.to_dict() if self.parity else None,
               "output": self.output}
        return {**out, **({"heal": self.healed.to_dict()} if self.healed else {}),
                **({"onnx": self.exported.to_dict()} if self.exported else {})}


def _check_outputs(src: str, out: str, o: ConvertOptions) -> None:
    inputs = [("`src`", src)] + [("`data`", d) for d in o.data]
    check_output(out, inputs)
    check_replaceable(out, o.overwrite)
    if o.onnx:
        check_output(o.onnx, inputs + [("`out`", out)])
        if check_output(out) in check_output(o.onnx).parents:
            raise NormswapError(f"`onnx` {o.onnx} is inside `out` {out}: saving OUT would delete it")
        check_onnx_replaceable(o.onnx, o.overwrite)
    safetensors.parse_size(o.max_shard_size)   # a bad size fails before any work


def _heal_texts(o: ConvertOptions) -> list[str] | None:
    if o.finetune_steps and not o.data:
        raise NormswapError("`finetune_steps` needs `data`: plain text files to distil on")
    if o.data and not o.finetune_steps:
        raise NormswapError("`data` is used only with `finetune_steps`")
    return read_texts(o.data) if o.finetune_steps else None


def _refuse_broken(src: str, report: ConversionReport) -> None:
    """Nothing converted because the norms are broken (NaN/inf on ordinary inputs, e.g. eps < 0): an error
    saying so, not "nothing to convert" (a model with no LayerNorm)."""
    broken = [s["name"] for s in report.skipped if s["reason"] == NONFINITE]
    if broken and not report.converted:
        more = f" and {len(broken) - 3} more" if len(broken) > 3 else ""
        raise NormswapError(f"{src}: {len(broken)} LayerNorm-like modules ({', '.join(broken[:3])}{more}) give "
                            "NaN/inf on ordinary inputs: the model is broken (check its eps and weights); "
                            "nothing was written")


def convert_checkpoint(src: str, out: str | Path, options: ConvertOptions = ConvertOptions()) -> ConvertResult:
    """Convert the model at `src` (folder, Hub id or "normswap-demo") and save it to `out`, verified.

    A local safetensors folder streams (bounded memory) unless healing, ONNX export, a GPU or missing weights
    need the model in memory. Nothing to convert: the result's report lists no norm and nothing is written.
    """
    o, out = options, str(out)
    _check_outputs(src, out, o)
    where, local = resolve_source(src)
    if local:   # a folder with its own model code: refused before any work, streaming or not
        check_code(src, read_config(where), o.load.trust_remote_code, converting=True)
    device = resolve_device(o.device)
    texts = _heal_texts(o)
    notices: list[str] = []
    if not texts and not o.onnx and device.type == "cpu" and not o.load.allow_missing_weights \
            and streamable(src):
        # a checkpoint folder: converted tensor by tensor, in bounded memory, verified before OUT appears
        def stream(method: str) -> ConvertResult:
            report, parity = convert_folder(src, out, o.to, method, o.p, o.load.dtype, o.overwrite,
                                            o.max_shard_size, o.show_progress)
            _refuse_broken(src, report)
            return ConvertResult(report, parity, out if report.converted else None, streamed=True)
        try:
            try:
                return stream(o.method)
            except VerificationFailed as e:   # nothing was written; the source is untouched
                if o.method != "auto":
                    raise
                result = stream("naive")
                result.report.warnings.append(fell_back(e))
                return result
        except NotStreamable as e:   # raised before anything is written
            notices.append(f"{e}: converting in memory")
    model, tokenizer = load_model(src, **asdict(o.load))
    model.to(device)
    reference = reference_outputs(model)   # outputs before editing, not a copy of the model
    # Healing distils from the unconverted model while training the converted one: both must exist
    # at once, so this is the one copy, made only when healing.
    original = copy.deepcopy(model) if texts else None
    try:
        report = convert(model, to=o.to, method=o.method, p=o.p)
    except VerificationFailed as e:   # the edits were made in place: start again from the source, naive
        if o.method != "auto":
            raise
        model, tokenizer = load_model(src, **asdict(o.load))
        model.to(device)
        report = convert(model, to=o.to, method="naive", p=o.p)
        report.warnings.append(fell_back(e))
    result = ConvertResult(report, None, None, notices=notices)
    _refuse_broken(src, report)
    if not report.converted:
        return result
    if texts:
        if tokenizer is None:
            raise NormswapError("`finetune_steps` needs the model's tokenizer files")
        result.healed = heal(model, original, texts, tokenizer=tokenizer, steps=o.finetune_steps,
                             progress=o.show_progress)
        if result.healed.interrupted:  # a half-healed model is not what was asked for: write nothing
            raise Interrupted(result.healed.signum)
    result.parity = compare_to(reference, model, skip=report.unverified)   # those the report names
    refuse_nonfinite(result.parity)
    # Export (validated, atomic) before saving: a failed export then leaves nothing written at all.
    if o.onnx:
        result.exported = export_onnx(model, o.onnx, overwrite=o.overwrite)
    try:
        log = {LOG_FILE: json.dumps(result.healed.log(), indent=1)} if result.healed else None
        save_pretrained(model, out, tokenizer=tokenizer, overwrite=o.overwrite, max_shard_size=o.max_shard_size,
                        files=log)
    except KeyboardInterrupt as e:
        raise Interrupted.after(e, *([str(o.onnx)] if o.onnx else [])) from None
    result.output = out
    return result
