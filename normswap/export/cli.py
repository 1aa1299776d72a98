"""`normswap export SRC -o DIR | --onnx FILE`: registered on the main group in normswap/cli.py."""
from __future__ import annotations

import json

import click

from normswap.cli_load import load_options
from normswap.cli_options import device_option, resolve_device, setup_output
from normswap.errors import NormswapError


@click.command("export")
@click.argument("src")
@click.option("-o", "--output", "out", type=click.Path(), default=None,
              help="Deployment folder: model.onnx, config, tokenizer, generation config.")
@click.option("--onnx", "onnx_path", type=click.Path(), default=None, help="A single ONNX file instead.")
@click.option("--target", default="ort", show_default=True,
              help="ort: SimplifiedLayerNormalization (+Skip) for onnxruntime; onnx23: standard RMSNormalization.")
@click.option("--dtype", type=click.Choice(["fp32", "fp16"]), default="fp32", show_default=True,
              help="Weights and activations of the graph (fp16: norm statistics stay fp32).")
@click.option("--fp16", is_flag=True, help="Same as --dtype fp16.")
@device_option
@click.option("--with-past/--no-past", default=None,
              help="Decoder with past key/values in and out (default: on for decoders with -o, off with --onnx).")
@click.option("--opset", type=int, default=None, help="ONNX opset (ort: 18-23, default 18; onnx23: 23).")
@click.option("--overwrite", is_flag=True, help="Replace DIR or FILE if normswap wrote it.")
@click.option("--overwrite-any", is_flag=True, help="Replace DIR or FILE whatever it is.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@load_options
@click.pass_context
def export(ctx, src, out, onnx_path, target, dtype, fp16, device, with_past, opset, overwrite, overwrite_any,
           as_json):
    """Export SRC (folder, Hub id or normswap-demo; converted or not) to ONNX and validate it in ORT.

    --device is where PyTorch traces and computes the reference; onnxruntime validates on its CPU provider.
    """
    import normswap
    from normswap.atomic import check_output, check_replaceable
    from normswap.export import _check_args

    setup_output(ctx.obj["verbosity"], as_json)
    if (out is None) == (onnx_path is None):
        raise NormswapError("give exactly one of -o DIR (deployment folder) and --onnx FILE")
    fp16 = fp16 or dtype == "fp16"
    device = resolve_device(device)
    _check_args(target, opset)  # fail before the (slow) load
    overwrite = "any" if overwrite_any else overwrite
    check_output(out or onnx_path, [("SRC", src)])
    if out is not None:
        check_replaceable(out, overwrite)
    model, tokenizer = normswap.io.load_model(src)
    model.to(device)
    if out is not None:
        report = normswap.export_folder(model, out, tokenizer=tokenizer, target=target, fp16=fp16,
                                        with_past=with_past, opset=opset, overwrite=overwrite)
    else:
        report = normswap.export_onnx(model, onnx_path, target=target, fp16=fp16, with_past=bool(with_past),
                                      opset=opset, overwrite=overwrite)
    click.echo(json.dumps(report.to_dict()) if as_json else report.to_table())
