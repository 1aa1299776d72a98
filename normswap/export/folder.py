"""A deployment folder: model.onnx (+ model.onnx.data) with config, tokenizer and generation config
beside it, the layout optimum's ORTModelForCausalLM / ORTModel.from_pretrained(DIR) loads."""
from __future__ import annotations

import json
import os
from pathlib import Path

from torch import nn

from normswap.io import kept
from normswap.io.atomic import atomic_dir
from normswap.errors import NormswapError, first_line
from normswap.export import genai, wrap
from normswap.choices import GraphDtype
from normswap.export.onnx import EXTERNAL_DATA_BYTES, build, check_args, check_quantize, fp16_graph
from normswap.export.report import ExportReport
from normswap.models.save import save_tokenizer

ONNX_NAME = "model.onnx"


def _write_config(model: nn.Module, out: Path, with_past: bool, fp16: bool) -> None:
    """config.json of the exported graph: the architecture's own model_type (runtimes read it for the
    KV-cache layout), no auto_map (no Python code runs here), use_cache = has a past."""
    config = model.config.to_dict()
    config.pop("auto_map", None)
    config["use_cache"] = with_past
    config["dtype"] = "float16" if fp16 else "float32"
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _write_generation_config(model: nn.Module, out: Path) -> bool:
    gen = getattr(model, "generation_config", None)
    if gen is None:
        return False
    try:
        gen.save_pretrained(out)
    except Exception as e:  # e.g. a config transformers' own validation rejects
        raise NormswapError(f"cannot write generation_config.json: {first_line(e)}") from None
    return True


def export_folder(model: nn.Module, out: str | os.PathLike, tokenizer=None, target: str = "ort",
                  dtype: GraphDtype | None = None, with_past: bool | None = None, opset: int | None = None,
                  overwrite: bool = False, validate: bool = True,
                  external_data_bytes: int | None = None, source: str | os.PathLike | None = None,
                  quantize: str | None = None, saved_fingerprint: dict | None = None, *,
                  fp16: bool | None = None) -> ExportReport:
    """Export `model` to the folder `out`: model.onnx (+ model.onnx.data when the weights exceed
    `external_data_bytes`), config.json, tokenizer files, generation_config.json (decoders) and, for
    decoders with the past, genai_config.json (onnxruntime-genai's generate loop).

    dtype: the graph's, "fp32" (None) or "fp16" (`export_onnx`; `fp16=True` is its deprecated spelling).
    with_past=None: with the past for decoder-only LMs (what generation runs), without otherwise.
    source: the model's folder, whose other files its loaders read the folder keeps (`io.kept`).
    quantize "int8": model.onnx is the validated graph's int8 quantization (`export_onnx`).
    saved_fingerprint: the fingerprint of the folder `model` was loaded from, which the graph must also reproduce
    where its probe maps exactly (`export_onnx`).
    The folder appears (atomically) only once the export validated.
    """
    fp16, said = fp16_graph(dtype, fp16)
    opset = check_args(target, opset)
    check_quantize(quantize, fp16, said)
    if not hasattr(model, "config"):
        raise NormswapError("export_folder needs a Hugging Face model (with .config)")
    out = Path(out).expanduser()
    decoder = wrap.is_decoder(model)
    with_past = decoder if with_past is None else with_past
    limit = EXTERNAL_DATA_BYTES if external_data_bytes is None else external_data_bytes
    with atomic_dir(out, overwrite) as tmp:
        report = build(model, tmp / ONNX_NAME, out / ONNX_NAME, target, fp16, with_past, opset, validate,
                       limit, quantize=quantize, saved=saved_fingerprint)
        names = kept.copy_kept(source, tmp) if source is not None else []   # before the files written here
        _write_config(model, tmp, with_past, fp16)
        if decoder:
            _write_generation_config(model, tmp)
        if tokenizer is not None:
            save_tokenizer(tokenizer, tmp)
        if with_past:
            genai.write(model, tmp, ONNX_NAME)
        kept.record(tmp, names)
        report.files = sorted(p.name for p in tmp.iterdir())
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(out, 0o777 & ~umask)  # mkdtemp made it 0700; a model folder is for sharing
    return report
