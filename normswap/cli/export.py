"""`normswap export SRC -o DIR | --onnx FILE` (`normswap.export_onnx` of a path)."""
from __future__ import annotations

import json

import click

from normswap.cli.options import Shared, shared
from normswap.errors import NormswapError
from normswap.pipeline import verbs
from normswap.pipeline.options import ExportOptions


@click.command("export")
@click.argument("src")
@click.option("-o", "--output", "out", type=click.Path(), default=None,
              help="Deployment folder: model.onnx, config, tokenizer, generation config.")
@shared(ExportOptions, skip=("load.dtype",))   # the model loads as stored; --dtype is the graph's
def export(src, out, opts: Shared, options: ExportOptions):
    """Export SRC (folder, Hub id or normswap-demo; converted or not) to ONNX and validate it in ORT.

    --device is where PyTorch traces and computes the reference; onnxruntime validates on its CPU provider.
    The model loads as stored; --dtype is the graph's.
    """
    if (out is None) == (options.onnx is None):  # the library says this in its own words
        raise NormswapError("give exactly one of -o DIR (deployment folder) and --onnx FILE")
    report = verbs.export_onnx(src, options=options, out=out)
    click.echo(json.dumps(report.to_dict()) if opts.as_json else report.to_table())
