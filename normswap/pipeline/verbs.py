"""The public verbs (`normswap.convert`, `heal`, `rotate`, `export_onnx`, `evaluate`, `inspect`): each takes a model
in memory or a path (a folder, a Hub id or "normswap-demo"), and either its options object or that object's fields
as keywords (nested ones too: `dtype` for `load.dtype`, `steps` for `heal.steps`); both only where they agree
(`choices.options_from`). The CLI builds the options object from its flags and calls the same verb.

A model in memory is changed in place and takes the options that apply to it; one that loads, saves or names a
file (`load`, `device`, `overwrite`, ...) is refused, as is `out`. A path is the whole workflow of the command
(`pipeline.convert` ...): load, verify, save to `out`.
"""
from __future__ import annotations

import os
from typing import overload

from torch import nn

from normswap.choices import changed, options_from
from normswap.errors import NormswapError
from normswap.evaluation import EvalReport
from normswap.evaluation import evaluate as evaluate_model
from normswap.export.folder import export_folder
from normswap.export.onnx import ExportReport
from normswap.export.onnx import export_onnx as export_file
from normswap.healing.loop import heal as heal_model
from normswap.healing.options import HealOptions
from normswap.healing.report import HealReport
from normswap.pipeline.convert import ConvertResult, convert_checkpoint
from normswap.pipeline.evaluate import evaluate_checkpoint
from normswap.pipeline.export import export_checkpoint
from normswap.pipeline.heal import HealResult, heal_checkpoint
from normswap.pipeline.inspect import InspectResult, inspect_checkpoint, inspect_model
from normswap.pipeline.options import (ConvertOptions, EvaluateOptions, ExportOptions, HealCheckpointOptions,
                                       InspectOptions, RotateOptions)
from normswap.pipeline.rotate import RotateResult, rotate_checkpoint
from normswap.surgery.convert import convert as convert_model
from normswap.surgery.report import ConversionReport
from normswap.surgery.rotate import RotationReport
from normswap.surgery.rotate import rotate as rotate_model

PathLike = str | os.PathLike   # a folder, a Hub id or "normswap-demo"


def _is_path(model) -> bool:
    return isinstance(model, (str, os.PathLike))


def _in_memory(options, keep: tuple[str, ...], out=None) -> None:
    """A model in memory: refuse `out` and the options outside `keep` (they load, save or name files)."""
    if out is not None:
        raise NormswapError("`out` is for a path: a model in memory changes in place (save it with `normswap.save`)")
    name = changed(options, keep)
    if name is not None:
        raise NormswapError(f"`{name}` applies to a path (a folder or Hub id), not to a model in memory")


def _out(out) -> PathLike:
    if out is None:
        raise NormswapError("a path needs `out`: the folder to write")
    return out


def convert(model: nn.Module | PathLike, out: PathLike | None = None, options: ConvertOptions | None = None, *,
            filter_fn=None, **keywords) -> ConversionReport | ConvertResult:
    """Turn the model's LayerNorms into RMSNorm (or pRMSNorm), verified: `model` in place (its ConversionReport),
    or the model at the path `model` saved to `out` (a ConvertResult; what `normswap convert` runs: streamed where
    it can be, healed, rotated, exported as asked).

    options: a ConvertOptions, or its fields as keywords: to ("rmsnorm" | "prmsnorm"), method ("auto" | "exact" |
    "naive"), p, example_inputs; for a path also dtype, device, finetune_steps, data, rotate, onnx, overwrite...
    filter_fn(module, name) -> bool: which norms of a model in memory to convert.
    """
    o = options_from(ConvertOptions, options, keywords)
    if _is_path(model):
        if filter_fn is not None:
            raise NormswapError("`filter_fn` picks the norms of a model in memory: load it first (`normswap.load`)")
        return convert_checkpoint(os.fspath(model), _out(out), o)
    _in_memory(o, ("to", "method", "p", "example_inputs"), out)
    return convert_model(model, o.to, o.method, o.p, filter_fn, o.example_inputs)


@overload
def heal(model: nn.Module, teacher: nn.Module | None, texts: list[str], tokenizer=None,
         options: HealOptions | None = None, **keywords) -> HealReport: ...


@overload
def heal(model: PathLike, out: PathLike, options: HealCheckpointOptions | None = None, **keywords) -> HealResult: ...


def heal(model, *args, **keywords):
    """Fine-tune a changed model briefly back towards its original on text.

    In memory: `heal(student, teacher, texts, tokenizer, options)`, a HealOptions or its fields as keywords
    (steps, lr, train, objective, ...), besides `out`, `progress`, `callback`... (`healing.loop.heal`); a
    HealReport. A path: `heal(src, out, options)`, a HealCheckpointOptions or its fields as keywords (teacher,
    data, plot, device, and HealOptions' steps, lr...), saved to `out`; a HealResult (`normswap heal`).
    """
    if not _is_path(model):
        return heal_model(model, *args, **keywords)
    return _heal_path(model, *args, **keywords)


def _heal_path(src: PathLike, out: PathLike | None = None, options: HealCheckpointOptions | None = None,
               **keywords) -> HealResult:
    return heal_checkpoint(os.fspath(src), _out(out), options_from(HealCheckpointOptions, options, keywords))


def rotate(model: nn.Module | PathLike, out: PathLike | None = None, options: RotateOptions | None = None,
           **keywords) -> RotationReport | RotateResult:
    """Rotate the residual streams of a model converted exactly (or RMSNorm already: Llama, Qwen, Mistral,
    Gemma...) for quantization, verified: `model` in place (a RotationReport), or the model at the path `model`
    saved to `out` (a RotateResult; `normswap rotate`).

    options: a RotateOptions, or its fields as keywords: method ("hadamard" | "random"), seed, heads (QuaRot's R2
    too), online (QuaRot's R4 too), example_inputs; for a path also dtype, device, overwrite, max_shard_size.
    """
    o = options_from(RotateOptions, options, keywords)
    if _is_path(model):
        return rotate_checkpoint(os.fspath(model), _out(out), o)
    _in_memory(o, ("method", "seed", "example_inputs", "heads", "online"), out)
    return rotate_model(model, o.method, o.seed, o.example_inputs, o.heads, o.online)


# export_onnx's keywords for a model in memory beyond ExportOptions: validate=False skips onnxruntime's check,
# external_data_bytes moves weights to model.onnx.data above that size, source (a folder) names the files a
# deployment folder keeps, saved_fingerprint the digest a saved folder recorded
IN_MEMORY_EXPORT = ("validate", "external_data_bytes", "source", "saved_fingerprint")


def export_onnx(model: nn.Module | PathLike, onnx: PathLike | None = None, options: ExportOptions | None = None, *,
                out: PathLike | None = None, tokenizer=None, example_inputs=None, fp16: bool | None = None,
                **keywords) -> ExportReport:
    """Export a (converted) model to ONNX, fused norms, validated in onnxruntime: into the file `onnx`, or the
    deployment folder `out` (model.onnx, config, tokenizer, generation config). `model` is a model in memory
    (`tokenizer` goes into the folder; `example_inputs` trace and validate a module without a transformers
    config) or a path, loaded as stored (what `normswap export` runs).

    options: an ExportOptions, or its fields as keywords: dtype ("fp32" | "fp16"; `fp16=True` is deprecated),
    target ("ort" | "onnx23"), with_past, opset, quantize, overwrite; for a path also device and `load`; for a
    model in memory also IN_MEMORY_EXPORT.
    """
    if onnx is not None:   # the options' `onnx`, given first as the file to write
        keywords["onnx"] = onnx
    # a model in memory's own settings, not the command's options
    extra = {k: keywords.pop(k) for k in IN_MEMORY_EXPORT if k in keywords}
    o = options_from(ExportOptions, options, keywords)
    if _is_path(model):
        if extra:
            raise NormswapError(f"`{next(iter(extra))}` is for a model in memory; a path is exported as stored")
        if tokenizer is not None or example_inputs is not None or fp16 is not None:
            raise NormswapError("a path is exported with its own tokenizer and inputs, and `dtype`: give neither "
                                "`tokenizer`, `example_inputs` nor `fp16`")
        return export_checkpoint(os.fspath(model), out, o)
    if (out is None) == (o.onnx is None):
        raise NormswapError("give exactly one of `out` (a deployment folder) and `onnx` (a single file)")
    _in_memory(o, ("onnx", "target", "dtype", "with_past", "opset", "quantize", "overwrite"))
    # the deprecated `fp16` alone says the dtype; with `dtype` given too, they must agree (`fp16_graph`)
    dtype = None if fp16 is not None and "dtype" not in keywords and options is None else o.dtype
    if out is None:
        if "source" in extra:
            raise NormswapError("`source` names the files a deployment folder keeps: give `out`, not `onnx`")
        return export_file(model, o.onnx, o.target, dtype, bool(o.with_past), o.opset, o.overwrite,
                           example_inputs=example_inputs, quantize=o.quantize, fp16=fp16, **extra)
    if example_inputs is not None:
        raise NormswapError("a deployment folder exports a transformers model on its own inputs: leave out "
                            "`example_inputs` (or export a single file with `onnx`)")
    return export_folder(model, out, tokenizer, o.target, dtype, o.with_past, o.opset, o.overwrite,
                         quantize=o.quantize, fp16=fp16, **extra)


@overload
def evaluate(model: nn.Module, tokenizer=None, texts: list[str] | str | None = None,
             options: EvaluateOptions | None = None, *, reference: nn.Module | None = None,
             max_sentences: int | None = None, **keywords) -> EvalReport: ...


@overload
def evaluate(model: PathLike, options: EvaluateOptions | None = None, **keywords) -> EvalReport: ...


def evaluate(model, *args, **keywords):
    """Perplexity on held-out text (default: the bundled Austen chapters) and, with `reference` (the original),
    its KL and top-1 agreement (encoders: embedding cosine; image, speech: parity on sample inputs).

    In memory: `evaluate(model, tokenizer, texts, options, reference=original)`. A path: `evaluate(src, options)`
    (`normswap eval`: `data` files, `reference` a path too). options: an EvaluateOptions, or its fields as
    keywords: seq_len, stride, batch_size, show_progress; for a path also data, reference, dtype, device.
    """
    if _is_path(model):
        return _evaluate_path(model, *args, **keywords)
    return _evaluate_model(model, *args, **keywords)


def _evaluate_path(src: PathLike, options: EvaluateOptions | None = None, **keywords) -> EvalReport:
    return evaluate_checkpoint(os.fspath(src), options_from(EvaluateOptions, options, keywords))


def _evaluate_model(model: nn.Module, tokenizer=None, texts=None, options: EvaluateOptions | None = None, *,
                    reference: nn.Module | None = None, max_sentences: int | None = None, **keywords) -> EvalReport:
    o = options_from(EvaluateOptions, options, keywords)
    _in_memory(o, ("seq_len", "stride", "batch_size", "show_progress"))
    if _is_path(reference):
        raise NormswapError("with a model in memory, `reference` is a model too: load it first (`normswap.load`)")
    sentences = {} if max_sentences is None else {"max_sentences": max_sentences}
    return evaluate_model(model, tokenizer, texts, reference, o.seq_len, o.stride, o.batch_size,
                          show_progress=o.show_progress, **sentences)


def inspect(model: nn.Module | PathLike, options: InspectOptions | None = None, **keywords) -> InspectResult:
    """The norms of a model (in memory, or at a path: `normswap inspect`) and what `convert` would do with each:
    converted (and how its bias fares), kept (already RMSNorm) or skipped (why); one traced forward, no edit.

    options: an InspectOptions, or its fields as keywords (a path: dtype, trust_remote_code, device).
    """
    o = options_from(InspectOptions, options, keywords)
    if _is_path(model):
        return inspect_checkpoint(os.fspath(model), o)
    _in_memory(o, ())
    return inspect_model(model)
