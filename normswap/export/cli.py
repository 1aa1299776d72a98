"""`normswap export SRC -o DIR | --onnx FILE`: registered on the main group in normswap/cli.py."""
from __future__ import annotations

import json

import click

from normswap.errors import NormswapError


@click.command("export")
@click.argument("src")
@click.option("-o", "--output", "out", type=click.Path(), default=None,
              help="Deployment folder: model.onnx, config, tokenizer, generation config.")
@click.option("--onnx", "onnx_path", type=click.Path(), default=None, help="A single ONNX file instead.")
@click.option("--target", default="ort", show_default=True,
              help="ort: SimplifiedLayerNormalization (+Skip) for onnxruntime; onnx23: standard RMSNormalization.")
@click.option("--fp16", is_flag=True, help="fp16 weights and activations (norm statistics stay fp32).")
@click.option("--with-past/--no-past", default=None,
              help="Decoder with past key/values in and out (default: on for decoders with -o, off with --onnx).")
@click.option("--opset", type=int, default=None, help="ONNX opset (ort: 18-23, default 18; onnx23: 23).")
@click.option("--overwrite", is_flag=True, help="Replace DIR or FILE if it exists.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
def export(src, out, onnx_path, target, fp16, with_past, opset, overwrite, as_json):
    """Export SRC (folder, Hub id or normswap-demo; converted or not) to ONNX and validate it in ORT."""
    import normswap
    from normswap.export import _check_args

    if (out is None) == (onnx_path is None):
        raise NormswapError("give exactly one of -o DIR (deployment folder) and --onnx FILE")
    _check_args(target, opset)  # fail before the (slow) load
    model, tokenizer = normswap.io.load_model(src)
    if out is not None:
        report = normswap.export_folder(model, out, tokenizer=tokenizer, target=target, fp16=fp16,
                                        with_past=with_past, opset=opset, overwrite=overwrite)
    else:
        report = normswap.export_onnx(model, onnx_path, target=target, fp16=fp16, with_past=bool(with_past),
                                      opset=opset, overwrite=overwrite)
    click.echo(json.dumps(report.to_dict()) if as_json else report.to_table())
