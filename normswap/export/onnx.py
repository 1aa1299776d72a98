"""ONNX export with fused RMSNorm nodes, validated in onnxruntime before the file is moved into place.

Exporter: torch.onnx.export(dynamo=True), with each RMSNorm lowered to one node by a custom
translation table (translate.py). Why, as measured with torch 2.13 / onnxscript 0.7:
- the legacy TorchScript exporter fails on aten::rms_norm ("not supported") and traces our
  reference as Pow/ReduceMean/Sqrt/Div/Mul;
- dynamo's own aten::rms_norm lowering gives x * Reciprocal(Sqrt(.)) below opset 23, a form ORT's
  built-in SimplifiedLayerNormFusion does not match, and depends on which kernel the model calls;
- the translation table yields exactly one fused node per norm with stash_type=1 (fp32 statistics)
  whatever the dtype or the ops backend. onnxscript's rewrite rules then fold residual Adds into
  SkipSimplifiedLayerNormalization and fuse other libraries' RMSNorms (fuse.py).
"""
from __future__ import annotations

import contextlib
import copy
import importlib.util
import inspect
import io
import json
import logging
import os
import warnings
from pathlib import Path
from typing import get_args

import torch
from torch import nn

from normswap.io import owned
from normswap.io.atomic import atomic_files
from normswap.choices import GraphDtype, Quantize
from normswap.errors import NormswapError, warn_caller
from normswap.export import wrap
from normswap.export.report import ExportReport
from normswap.models.inputs import sample_inputs
from normswap.models.inputs.examples import HOW, as_batches
from normswap.folder.attached import has_config
from normswap.models.introspect import is_rms_norm
from normswap.models.modes import eval_mode
from normswap.models.source import dtype_name
from normswap.norms import PartialRMSNorm
from normswap.parity import main_output
from normswap.folder.shipped import original_class

TARGETS = {"ort": (18, 23), "onnx23": (23, 23)}   # opsets each target accepts
DEFAULT_OPSET = {"ort": 18, "onnx23": 23}
# the main inputs of vision and audio encoders, and the axes of each own input exported dynamic: the batch, and a
# waveform's length (images keep the config's size, log-mel features the model's window)
MEDIA = ("pixel_values", "input_features", "input_values")
MEDIA_AXES = {"pixel_values": (0,), "input_features": (0,), "input_values": (0, 1), "attention_mask": (0, 1)}
KINDS = "decoder-only language models, text encoders and vision and audio encoders"
FP32_TOL = 1e-4
FP16_TOL = 1e-2   # fp16 weights and activations: relative to max |reference| (at least 1)
EXTERNAL_DATA_BYTES = 2**30   # weights above this are saved as external data (protobuf's limit is 2 GB)
QUANTIZE = get_args(Quantize)   # `quantize` schemes (export.quantize)
PROBE_TOKENS = 16   # the export's own fingerprint probe: one row of this many tokens (a conversion's is as long)
SHORT = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}   # a graph's dtype, by dtype_name


def graph_dtype(dtype) -> GraphDtype:
    """fp32, fp16 or bf16, for a graph dtype given so, as float16, "torch.float16" or a torch.dtype."""
    if isinstance(dtype, bool):   # the old `fp16` flag, passed where `dtype` now is
        raise NormswapError(f"`dtype` takes fp32 or fp16 (or a torch.dtype), not {dtype}: `fp16=True` is now "
                            "`dtype='fp16'`")
    if dtype is None:
        raise NormswapError("`dtype` takes fp32, fp16 or bf16 (or a torch.dtype), not None")
    return dtype if dtype in SHORT.values() else SHORT[dtype_name(dtype)]


def fp16_graph(dtype, fp16: bool | None = None) -> tuple[bool, str]:
    """(whether the graph is fp16, how the caller said so) from `dtype` (None: fp32) or the deprecated `fp16`;
    bf16 is refused: every export is validated in onnxruntime on the CPU, which has no bf16 kernels."""
    if fp16 is not None:
        warn_caller("`fp16` is deprecated: use `dtype='fp16'` (or 'fp32')", DeprecationWarning)
        if dtype is not None and graph_dtype(dtype) != ("fp16" if fp16 else "fp32"):
            raise NormswapError(f"give `dtype` or `fp16`, not both: `dtype={dtype!r}` but `fp16={fp16!r}`")
        return bool(fp16), f"`fp16={fp16!r}`"
    dtype = graph_dtype("fp32" if dtype is None else dtype)
    if dtype == "bf16":
        raise NormswapError(f"cannot export `dtype={dtype!r}`: every export is validated in onnxruntime on the CPU, "
                            "which has no bfloat16 kernels (MatMul, Add); export fp32 or fp16")
    return dtype == "fp16", f"`dtype={dtype!r}`"


def check_args(target: str, opset: int | None) -> int:
    """The opset to export `target` with; one-line errors for missing packages, targets and opsets."""
    missing = [m for m in ("onnx", "onnxruntime", "onnxscript") if importlib.util.find_spec(m) is None]
    if missing:
        raise NormswapError(f"ONNX export needs {', '.join(missing)}: pip install 'normswap[onnx]'")
    if target not in TARGETS:
        raise NormswapError(f"unsupported target '{target}': choose one of {', '.join(TARGETS)}")
    lo, hi = TARGETS[target]
    opset = DEFAULT_OPSET[target] if opset is None else int(opset)
    if not lo <= opset <= hi:
        span = f"{lo}" if lo == hi else f"{lo}..{hi}"
        raise NormswapError(f"opset {opset} is not supported for target '{target}': use {span}")
    return opset


def check_quantize(quantize: str | None, fp16: bool, fp16_name: str = "`dtype='fp16'`") -> None:
    """One-line errors, before any work, for an unknown scheme and for an fp16 graph (int8 starts from fp32)."""
    if quantize is None:
        return
    if quantize not in QUANTIZE:
        raise NormswapError(f"unknown quantization '{quantize}': choose {', '.join(QUANTIZE)}")
    if fp16:
        raise NormswapError(f"`quantize={quantize!r}` quantizes the fp32 graph (int8 weights, fp32 elsewhere): "
                            f"leave out {fp16_name}")


def check_replaceable(path: Path, overwrite) -> None:
    """An existing FILE is replaced only with overwrite, and only if normswap exported it (or "any"); so is its
    external-data file `<path>.data`, which an export may write beside it."""
    if str(path).endswith(("/", os.sep)):   # Path() would drop the slash and write a file of that name
        raise NormswapError(f"`onnx` {path} names a folder: give a file name (e.g. {path}model.onnx)")
    path = Path(path).expanduser()
    data = path.with_name(path.name + ".data")
    for f in (path, data):
        if (f.exists() or f.is_symlink()) and (f.is_dir() or not overwrite):
            raise NormswapError(f"{f} exists" + (" and is a folder" if f.is_dir() else
                                                 ": pass `overwrite=True` to replace it"))
    if path.exists() and overwrite != "any" and not owned.exported_onnx(path):  # never another tool's file
        raise NormswapError(f"{path} is not an ONNX file normswap exported: pass `overwrite='any'` to replace it")
    if data.exists() and overwrite != "any" and not owned.exported_onnx(path):  # its data, not a stray file
        raise NormswapError(f"{data} is not the data of an ONNX file normswap exported: pass `overwrite='any'` "
                            "to replace it")
    if path.parent.exists() and not path.parent.is_dir():
        raise NormswapError(f"cannot write to {path.parent}: not a folder")


def count_norms(model: nn.Module) -> dict[str, int]:
    """Norms of `model` by kind, and how many are lowered to one fused node ("lowered")."""
    from normswap.export import translate   # onnx is an optional extra: imported when exporting

    mods = list(model.modules())
    return {"rmsnorm": sum(is_rms_norm(m) and not isinstance(m, PartialRMSNorm) for m in mods),
            "prmsnorm": sum(isinstance(m, PartialRMSNorm) for m in mods),
            "layernorm": sum(isinstance(m, nn.LayerNorm) for m in mods),
            "lowered": sum(translate.fusable(m) for m in mods)}


def own_inputs(model: nn.Module, with_past: bool) -> list[dict] | None:
    """A vision or audio encoder's own inputs, to export it on as on example inputs: normswap's sample batches
    (images of the config's size, log-mel features, waveforms with their mask), less the inputs that only
    switch an optional path on (`bool_masked_pos`); None for a model that reads text (input_ids). Encoder-decoders
    are refused: one graph of both halves is not what their generation runs."""
    main, name = getattr(model, "main_input_name", "input_ids"), original_class(model).__name__
    if "decoder_input_ids" in inspect.signature(model.forward).parameters:
        raise NormswapError(f"cannot export {name}: an encoder-decoder (its decoder runs once per generated token "
                            f"on the encoder's output); normswap exports {KINDS}")
    if main == "input_ids":
        return None
    if main not in MEDIA:
        raise NormswapError(f"cannot export {name}: its main input `{main}` is none of input_ids, {', '.join(MEDIA)}")
    if with_past:
        raise NormswapError(f"`with_past=True` needs a decoder-only language model, not {name} (an encoder)")
    return [{k: v for k, v in b.items() if k in (main, "attention_mask")} for b in sample_inputs(model)]


def _main_output(model: nn.Module) -> str:
    if getattr(model.config, "vocab_size", None) is None:
        raise NormswapError(f"cannot export {original_class(model).__name__}: it reads input_ids but its config "
                            "names no "
                            f"vocab_size (a model of several towers?); normswap exports {KINDS}")
    ids = torch.zeros(1, 3, dtype=torch.long, device=next(model.parameters()).device)
    with torch.no_grad():
        name, _ = main_output(model(input_ids=ids, attention_mask=torch.ones_like(ids)))
    if name in ("logits", "last_hidden_state"):
        return name
    raise NormswapError(f"{original_class(model).__name__} returns neither logits nor last_hidden_state")


def _keep_input_names(model, names: list[str]) -> None:
    """Give the graph's inputs the names asked for: where the forward returns an input unchanged, the exporter
    renames that input `<output>_orig` (one value cannot be both), and the output becomes an Identity of it.
    By position: the exporter keeps every input, in order (even one the forward does not read)."""
    if len(model.graph.inputs) != len(names):
        raise RuntimeError(f"the exported graph has {len(model.graph.inputs)} inputs for {len(names)} given")
    for value, name in zip(model.graph.inputs, names):
        value.name = name


def _dynamo(wrapper: nn.Module, model: nn.Module, args: tuple, names: tuple[list[str], list[str]], dyn,
            target: str, opset: int):
    """torch.onnx (dynamo) with norms lowered to fused nodes, then the library fusions; (ONNXProgram, rewrites)."""
    from normswap.export import fuse, translate   # onnx is an optional extra: imported when exporting

    with translate.lowered_norms(model), warnings.catch_warnings(), \
            contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        log = logging.getLogger("torch.onnx")
        level, log.level = log.level, logging.ERROR  # "torchvision is not installed" notices
        try:
            prog = torch.onnx.export(wrapper, args, dynamo=True, opset_version=opset, input_names=names[0],
                                     output_names=names[1], dynamic_shapes=dyn, verbose=False,
                                     optimize=False,
                                     custom_translation_table=translate.translation_table(target, opset))
        except Exception as e:
            summary = [ln for ln in str(e).splitlines() if ln.startswith("<class")]
            raise NormswapError(f"torch.onnx export failed: {(summary or [str(e)])[-1][:300]}") from None
        finally:
            log.setLevel(level)
    # torch's optimize=True also runs onnxscript's opset-23 fusions, whose RotaryEmbedding breaks in
    # ORT for batch > 1 (cos/sin cache keeps batch 1): run the same optimiser without those fusions.
    import onnxscript.optimizer
    onnxscript.optimizer.optimize_ir(prog.model)
    _keep_input_names(prog.model, names[0])
    rewrites = fuse.fuse(prog.model, target)
    fuse.drop_trailing_empty_inputs(prog.model)
    return prog, rewrites


def _export(wrapper: nn.Module, model: nn.Module, with_past: bool, names: tuple[list[str], list[str]], target: str,
            opset: int):
    """An HF model's graph (Optimum's names and axes); (ONNXProgram, rewrites)."""
    args, dyn = wrap.example(model, with_past)
    prog, rewrites = _dynamo(wrapper, model, args, names, dyn, target, opset)
    wrap.name_axes(prog.model, with_past)
    return prog, rewrites


def _export_module(model: nn.Module, batch: dict, target: str, opset: int, axes: dict | None, report: ExportReport):
    """Any module's graph on an example batch: its inputs' dims (`axes`: only those named there) dynamic where
    the model allows it, else (where torch.export fails with them, or `report.fixed_shapes` says why not) the
    example's shapes; (ONNXProgram, rewrites, output names)."""
    flat = wrap.flat_inputs(batch)
    args = tuple(t for _, t in flat)
    names = ([n for n, _ in flat], wrap.output_names(model, batch))
    if not names[1]:
        raise NormswapError(f"{original_class(model).__name__} returns no tensor on the example inputs: nothing "
                            "to export")
    wrapper = wrap.Flat(model, batch)
    dyn = wrap.auto_shapes(args, axes and [axes.get(n, ()) for n in names[0]])
    if report.fixed_shapes is None:
        try:
            return (*_dynamo(wrapper, model, args, names, dyn, target, opset), names[1])
        except NormswapError as e:   # dynamic shapes it cannot trace: the example's own
            report.fixed_shapes = f"torch.export cannot trace its dynamic dims ({e})"
    return (*_dynamo(wrapper, model, args, names, None, target, opset), names[1])


def _module_graph(reference: nn.Module, work: nn.Module, example_inputs, axes: dict | None, report: ExportReport):
    """A module's graph on its example inputs: (ONNXProgram, the graph in PyTorch for its fingerprint, the
    example batches, output names)."""
    from normswap.export import onnx_fingerprint   # onnx is an optional extra: imported when exporting

    batches = as_batches(reference, example_inputs)
    prog, report.rewrites, names = _export_module(work, as_batches(work, batches[:1])[0], report.target,
                                                  report.opset, axes, report)
    report.output = ", ".join(names)
    return prog, onnx_fingerprint.for_module(reference, batches[0], names), batches, names


def _weight_bytes(model: nn.Module, fp16: bool) -> int:
    return sum(p.numel() * (2 if fp16 and p.is_floating_point() else p.element_size()) for p in model.parameters())


def _build_hf(reference: nn.Module, work: nn.Module, report: ExportReport):
    """An HF model's export (its main output; with_past: the KV cache too); (ONNXProgram, the graph in PyTorch
    for its fingerprint: `onnx_fingerprint.Traced`)."""
    from normswap.export import onnx_fingerprint, validate   # onnx is an optional extra: imported when exporting

    report.output = _main_output(reference)
    if report.with_past and (report.output != "logits" or not wrap.is_decoder(reference)):
        raise NormswapError("`with_past=True` needs a decoder-only language model (with logits and a KV cache)")
    names = wrap.io_names(wrap.num_layers(reference.config) if report.with_past else 0, report.with_past,
                          report.output, positions=wrap.takes_positions(reference))
    def wrapped(m):
        return wrap.WithPast(m) if report.with_past else wrap.Plain(m, report.output)
    prog, report.rewrites = _export(wrapped(work), work, report.with_past, names, report.target, report.opset)
    own = {k: torch.from_numpy(v) for k, v in validate.random_inputs(reference, 1, PROBE_TOKENS).items()}
    dtype = torch.float16 if report.fp16 else torch.float32
    return prog, onnx_fingerprint.for_hf(reference, wrapped(reference), names, own, dtype)


def build(model: nn.Module, staged: Path, final: Path, target: str, fp16: bool, with_past: bool, opset: int,
          validate: bool, external_data_bytes: int, example_inputs=None, quantize: str | None = None,
          saved: dict | None = None) -> ExportReport:
    """Export and validate `model` to `staged` (a path in a temporary folder); the report names `final`. With
    `example_inputs`, any module, on them (`_export_module`); without, an HF model on its own inputs: a text
    model's input_ids (`_build_hf`), a vision or audio encoder's (`own_inputs`, then as on example inputs).
    The file's metadata holds the graph's fingerprint (`onnx_fingerprint`; `saved`: the model's folder's).
    quantize "int8": the validated file is then replaced by its int8 quantization, measured (`export.quantize`)."""
    from normswap.export import onnx_fingerprint   # onnx is an optional extra: imported when exporting
    from normswap.export import quantize as int8
    from normswap.export.validate import GrownFails, validate_export, validate_module

    modes = contextlib.ExitStack()   # eval, every module's own flag back after it
    modes.enter_context(eval_mode(model))
    try:
        axes = None
        if example_inputs is None:
            example_inputs, axes = own_inputs(model, with_past), MEDIA_AXES
        reference = model if next(model.parameters()).dtype == torch.float32 else copy.deepcopy(model).float()
        work = copy.deepcopy(reference).half() if fp16 else reference
        report = ExportReport(str(final), target, opset, fp16, with_past, "", norms=count_norms(work))
        while True:   # a module's graph once more, of the example's shapes, where a dynamic dim does not hold
            if example_inputs is None:
                prog, traced = _build_hf(reference, work, report)
            else:
                prog, traced, batches, names = _module_graph(reference, work, example_inputs, axes, report)
            stamp = onnx_fingerprint.stamp(traced, prog.model, onnx_fingerprint.model_probe(model, saved),
                                           "float16" if fp16 else "float32", saved)
            report.fingerprint = onnx_fingerprint.summary(stamp)
            prog.model.metadata_props.update({owned.ONNX_MARK: target, "normswap.fp16": str(fp16),
                                              onnx_fingerprint.META: json.dumps(stamp)})
            # Weights beside the graph (model.onnx.data) for big models: protobuf stops at 2 GB.
            report.external_data = _weight_bytes(work, fp16) > external_data_bytes
            prog.save(staged, external_data=report.external_data)
            if validate and example_inputs is None:
                validate_export(staged, report, reference, fp16, FP32_TOL, FP16_TOL)
            elif validate:
                try:
                    validate_module(staged, report, reference, batches, names, FP32_TOL, FP16_TOL)
                except GrownFails as e:
                    if report.fixed_shapes is not None:   # the example's shapes already: nothing to fall back to
                        raise
                    report.fixed_shapes, report.parity = f"a dynamic dim does not hold in onnxruntime ({e})", []
                    continue
            break
        if report.fixed_shapes:
            warn_caller(f"{final}: exported for the example's input shapes only: {report.fixed_shapes}")
        if quantize:
            report.quantized = int8.quantize(staged, report, reference, *((batches, names) if example_inputs
                                                                           is not None else ()))
            report.fingerprint = {"none": onnx_fingerprint.INT8}   # its fp32 fingerprint does not hold in int8
            onnx_fingerprint.rewrite(staged, report.fingerprint)
    finally:
        modes.close()
    return report


def _check_model(model, example_inputs, with_past: bool) -> None:
    """One-line errors before anything is written: what the model is, its example inputs, with_past."""
    if not isinstance(model, nn.Module):
        raise NormswapError(f"`model` must be a torch.nn.Module, not {type(model).__name__}")
    if next(model.parameters(), None) is None:
        raise NormswapError(f"{original_class(model).__name__} has no parameters: nothing to export")
    if example_inputs is None and not has_config(model):
        raise NormswapError(f"cannot export {original_class(model).__name__} (not a transformers model with a "
                            "config) without "
                            f"inputs: {HOW}")
    if example_inputs is not None and with_past:
        raise NormswapError("`with_past=True` exports an HF decoder on its own inputs: leave out `example_inputs`")
    if example_inputs is not None:
        as_batches(model, example_inputs)   # each batch fits the forward


def export_onnx(model: nn.Module, path: str | os.PathLike, target: str = "ort", dtype: GraphDtype | None = None,
                with_past: bool = False, opset: int | None = None, overwrite: bool = False,
                validate: bool = True, external_data_bytes: int = EXTERNAL_DATA_BYTES,
                example_inputs=None, quantize: str | None = None,
                saved_fingerprint: dict | None = None, *, fp16: bool | None = None) -> ExportReport:
    """Export a (converted) model to ONNX at `path` and validate it in onnxruntime.

    example_inputs (any nn.Module; needed without a transformers config): one batch or a list of batches, as
    `convert` takes them. The first is traced: its tensors are the graph's inputs (named by keyword; nested:
    `pair.0`), every dim > 1 dynamic where the model allows it (else, where torch.export cannot trace them,
    the example's shapes); whatever the model returns (tensor, tuple, dict, nested) is flattened into outputs
    named `output`, `0`, `logits`, `a.b`. Validated in onnxruntime against PyTorch on every batch and on the
    first with each dynamic dim doubled in turn (the batch size first; where PyTorch runs it), every output
    within 1e-4 of its max |value| (fp16: 1e-2 of max(1, max |value|)). Without them, an HF model is exported
    on its own inputs (input_ids, attention_mask) and output (logits or last_hidden_state):

    target "ort": RMSNorm -> SimplifiedLayerNormalization, residual add + norm ->
    com.microsoft.SkipSimplifiedLayerNormalization; "onnx23": standard opset-23 RMSNormalization.
    dtype: "fp32" (None) or "fp16" (fp16 weights/activations, norm statistics fp32; `fp16=True`, deprecated, says
    the same); "bf16" is refused (onnxruntime's CPU cannot run it to validate it). with_past: decoder with
    past_key_values.{i}.key/value inputs and present.{i}.key/value outputs. Decoders also take
    position_ids. Weights over `external_data_bytes` go to `<file>.data` beside it. The file appears
    only once every check passed (validate=False skips the checks, not the atomic write).
    quantize "int8": after validating the fp32 graph, write its int8 quantization instead (onnxruntime's
    dynamic quantization of MatMul/Gemm), measured against PyTorch and refused only where broken (`export.quantize`).
    The file's metadata (`normswap.fingerprint`) holds the graph's fingerprint: a probe by the graph's input names
    (a converted model's own, else one drawn as the validation draws its inputs) and a digest of the PyTorch
    model's outputs on it, which the validation checks in onnxruntime (`validate.check_fingerprint(path)`
    checks it later); int8 files carry none. saved_fingerprint: the fingerprint recorded in the folder `model`
    was loaded from (config.json's `normswap.fingerprint`; `normswap export` passes its SRC's): where the graph's
    probe is that folder's exactly, the graph must reproduce the outputs it recorded too, and the file keeps them.
    See export_folder for a deployment folder (config, tokenizer, generation config beside it).
    """
    fp16, said = fp16_graph(dtype, fp16)
    opset = check_args(target, opset)
    check_quantize(quantize, fp16, said)
    check_replaceable(path, overwrite)
    path = Path(path).expanduser()
    _check_model(model, example_inputs, with_past)
    with atomic_files(path, lambda: check_replaceable(path, overwrite)) as tmp:
        return build(model, tmp / path.name, path, target, fp16, with_past, opset, validate, external_data_bytes,
                     example_inputs, quantize, saved_fingerprint)
