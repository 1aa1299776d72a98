"""`normswap export SRC -o DIR | --onnx FILE`."""
from __future__ import annotations

import json

import click

from normswap.atomic import check_output, check_replaceable
from normswap.cli.options import Shared, shared
from normswap.errors import NormswapError
from normswap.export.folder import export_folder
from normswap.export.onnx import check_args, export_onnx
from normswap.models.load import load_model
from normswap.pipeline import resolve_device


@click.command("export")
@click.argument("src")
@click.option("-o", "--output", "out", type=click.Path(), default=None,
              help="Deployment folder: model.onnx, config, tokenizer, generation config.")
@click.option("--onnx", "onnx_path", type=click.Path(), default=None, help="A single ONNX file instead.")
@click.option("--target", default="ort", show_default=True,
              help="ort: SimplifiedLayerNormalization (+Skip) for onnxruntime; onnx23: standard RMSNormalization.")
@click.option("--dtype", "graph_dtype", type=click.Choice(["fp32", "fp16"]), default="fp32", show_default=True,
              help="Weights and activations of the graph (fp16: norm statistics stay fp32).")
@click.option("--fp16", is_flag=True, help="Same as --dtype fp16.")
@click.option("--with-past/--no-past", default=None,
              help="Decoder with past key/values in and out (default: on for decoders with -o, off with --onnx).")
@click.option("--opset", type=int, default=None, help="ONNX opset (ort: 18-23, default 18; onnx23: 23).")
@shared(dtype=False)
def export(src, out, onnx_path, target, graph_dtype, fp16, with_past, opset, opts: Shared):
    """Export SRC (folder, Hub id or normswap-demo; converted or not) to ONNX and validate it in ORT.

    --device is where PyTorch traces and computes the reference; onnxruntime validates on its CPU provider.
    The model loads as stored; --dtype is the graph's.
    """
    if (out is None) == (onnx_path is None):
        raise NormswapError("give exactly one of -o DIR (deployment folder) and --onnx FILE")
    fp16 = fp16 or graph_dtype == "fp16"
    device = resolve_device(opts.device)
    check_args(target, opset)  # fail before the (slow) load
    check_output(out or onnx_path, [("`src`", src)])
    if out is not None:
        check_replaceable(out, opts.overwrite)
    model, tokenizer = load_model(src, trust_remote_code=opts.load.trust_remote_code,
                                  allow_missing_weights=opts.load.allow_missing_weights)
    model.to(device)
    if out is not None:
        report = export_folder(model, out, tokenizer=tokenizer, target=target, fp16=fp16,
                               with_past=with_past, opset=opset, overwrite=opts.overwrite)
    else:
        report = export_onnx(model, onnx_path, target=target, fp16=fp16, with_past=bool(with_past),
                             opset=opset, overwrite=opts.overwrite)
    click.echo(json.dumps(report.to_dict()) if opts.as_json else report.to_table())
