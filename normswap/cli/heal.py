"""`normswap heal` (`normswap.heal` of a path), `normswap eval` (`normswap.evaluate`) and `normswap plot` (a
healed folder's curves)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from normswap.cli.options import Shared, shared
from normswap.errors import NormswapError
from normswap.pipeline import verbs
from normswap.pipeline.options import EvaluateOptions, HealCheckpointOptions, PlotOptions


@click.command()
@click.argument("src")
@click.option("-o", "--output", "out", required=True, type=click.Path(), help="Folder to write.")
@shared(HealCheckpointOptions)
def heal(src, out, opts: Shared, options: HealCheckpointOptions):
    """Fine-tune SRC briefly towards the original model on plain text; save to OUT.

    Ctrl-C stops after the current step and saves what was done to OUT.partial; OUT is untouched.
    Under `accelerate launch` the processes (and their devices) are Accelerate's; --device cpu keeps
    them on the CPU (gloo); an FSDP config (examples/accelerate_fsdp.yaml) shards the model over them.
    """
    result = verbs.heal(src, out, options)
    report = result.report
    if not result.main_process:  # under `accelerate launch`: one report, from rank 0
        return
    click.echo(json.dumps(report.to_dict(losses=True)) if opts.as_json else str(report))
    if report.interrupted:
        when = "during the final save" if report.save_interrupted else "after"
        if report.saved_to and Path(report.saved_to) == Path(out):   # the signal came at the rename: OUT is new
            done = f"{out} written"
        else:
            where = f"saved to {report.saved_to}" if report.saved_to else \
                f"not saved ({report.not_saved})" if report.not_saved else "nothing saved"
            done = f"{where}; {out} untouched"
        click.echo(f"interrupted {when} {report.steps_done}/{report.steps} steps: {done}", err=True)
        sys.exit(128 + (report.signum or 2))


@click.command("eval")
@click.argument("src")
@shared(EvaluateOptions)
def eval_cmd(src, opts: Shared, options: EvaluateOptions):
    """Perplexity of SRC (sliding window), and agreement with --reference."""
    report = verbs.evaluate(src, options)
    if opts.as_json:
        click.echo(json.dumps(report.to_dict(), allow_nan=False))
    if report.error():  # a NaN model must not pass a script's exit-code check
        raise NormswapError(report.error())
    if not opts.as_json:
        click.echo(str(report))


@click.command("plot")
@click.argument("log", metavar="OUT")
@click.option("-o", "--output", "png", required=True, type=click.Path(), help="PNG file to write.")
@shared(PlotOptions)
def plot_cmd(log, png, opts: Shared, options: PlotOptions):
    """Draw a healed folder's training and held-out curves (OUT/heal_log.json, or that file) into a PNG."""
    from normswap.healing.plot import plot_log, read_log
    written = plot_log(read_log(log), png, overwrite=options.overwrite)
    click.echo(json.dumps({"plot": str(written)}) if opts.as_json else f"plotted {log} to {written}")
