"""`normswap rotate SRC -o OUT` (`normswap.rotate` of a path)."""
from __future__ import annotations

import json

import click

from normswap.cli.options import Shared, shared
from normswap.pipeline import verbs
from normswap.pipeline.options import RotateOptions


@click.command()
@click.argument("src")
@click.option("-o", "--output", "out", required=True, type=click.Path(), help="Folder to write.")
@shared(RotateOptions)
def rotate(src, out, opts: Shared, options: RotateOptions):
    """Rotate the residual streams of SRC (converted exactly, or RMSNorm already) for quantization; save to OUT.

    Outputs are kept (verified); the weights' outliers spread over the channels (SliceGPT, QuaRot)."""
    result = verbs.rotate(src, out, options)
    if opts.as_json:
        click.echo(json.dumps(result.to_dict()))
        return
    click.echo(result.report.to_table())
    click.echo(f"saved to {out}")
