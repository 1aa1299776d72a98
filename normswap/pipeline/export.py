"""`export_checkpoint`: what `normswap export` runs, for Python callers too: load SRC as stored, export it to
ONNX (a deployment folder OUT, or the single file `options.onnx`) and validate it in onnxruntime."""
from __future__ import annotations

from pathlib import Path

from normswap.errors import NormswapError
from normswap.export.folder import export_folder
from normswap.export.onnx import ExportReport, check_args, check_quantize, export_onnx, fp16_graph
from normswap.folder import fingerprint
from normswap.io.atomic import check_output, check_replaceable
from normswap.models.load import LoadOptions, load_model
from normswap.folder.attached import section
from normswap.models.source import source_folder
from normswap.pipeline.device import resolve_device
from normswap.pipeline.options import ExportOptions


def export_checkpoint(src: str, out: str | Path | None = None, options: ExportOptions | None = None) -> ExportReport:
    """Export the model at `src` (folder, Hub id or "normswap-demo"; converted or not) into the folder `out`
    (model.onnx, config, tokenizer, generation config) or, with `out` None, into the file `options.onnx`.

    `options.device` is where PyTorch traces and computes the reference; onnxruntime validates on its CPU.
    A converted SRC's recorded fingerprint is the graph's too (`export_onnx`'s `saved_fingerprint`): the file is
    checked against the model SRC saved, not only against the model loaded from it.
    """
    o = options if options is not None else ExportOptions()
    if (out is None) == (o.onnx is None):
        raise NormswapError("give exactly one of `out` (a deployment folder) and `onnx` (a single file)")
    fp16, said = fp16_graph(o.dtype)   # bf16 refused
    device = resolve_device(o.device)
    check_args(o.target, o.opset)  # fail before the (slow) load
    check_quantize(o.quantize, fp16, said)
    check_output(out or o.onnx, [("`src`", src)])
    if out is not None:
        check_replaceable(out, o.overwrite)
    model, tokenizer = load_model(src, options=o.load)
    model.to(device)
    saved = saved_fingerprint(model, o.load)
    if out is not None:
        return export_folder(model, out, tokenizer=tokenizer, target=o.target, dtype=o.dtype, with_past=o.with_past,
                             opset=o.opset, overwrite=o.overwrite, source=source_folder(src), quantize=o.quantize,
                             saved_fingerprint=saved)
    return export_onnx(model, o.onnx, target=o.target, dtype=o.dtype, with_past=bool(o.with_past), opset=o.opset,
                       overwrite=o.overwrite, quantize=o.quantize, saved_fingerprint=saved)


def saved_fingerprint(model, load: LoadOptions) -> dict | None:
    """The fingerprint SRC's folder recorded (None: not converted); its digest left out, with why, where the load
    skipped checking it (the model is then knowingly not the one saved)."""
    found = (section(model) or {}).get("fingerprint")
    skipped = f"{fingerprint.SKIP_ENV}=1" if fingerprint.skipped() else \
        "`allow_missing_weights`" if load.allow_missing_weights else None
    if not isinstance(found, dict) or skipped is None:
        return found if isinstance(found, dict) else None
    return {"probe": found.get("probe"), "none": f"not checked when SRC was loaded ({skipped})"}
