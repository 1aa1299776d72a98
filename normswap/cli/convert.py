"""`normswap convert` (`normswap.convert` of a path) and `normswap inspect` (`normswap.inspect`)."""
from __future__ import annotations

import json

import click

from normswap.cli.options import Shared, shared, warn
from normswap.pipeline import verbs
from normswap.pipeline.options import ConvertOptions, InspectOptions


@click.command()
@click.argument("src")
@click.option("-o", "--output", "out", required=True, type=click.Path(), help="Folder to write.")
@shared(ConvertOptions)
def convert(src, out, opts: Shared, options: ConvertOptions):
    """Convert SRC (folder, Hub id or normswap-demo) and save it to OUT."""
    result = verbs.convert(src, out, options)
    report = result.report
    for w in result.notices:  # on stderr, whatever the output format
        warn(w)
    if not report.converted:
        skipped = [f"{s.name} ({s.cls}): {s.reason}" for s in report.skipped]
        why = f"; {len(skipped)} skipped: {'; '.join(skipped[:3])}" if skipped else ""
        more = f" +{len(skipped) - 3} more" if len(skipped) > 3 else ""
        msg = (f"nothing to convert: {src} has no LayerNorm normswap can convert "
               f"({len(report.already_rms)} RMSNorm already{why}{more})")
        click.echo(json.dumps({"report": report.to_dict(), "message": msg}) if opts.as_json else msg)
        return
    for w in report.warnings:
        warn(w)
    if opts.as_json:
        click.echo(json.dumps(result.to_dict()))
        return
    click.echo(report.to_table(warnings=False))
    if result.healed:   # the conversion's parity, the heal, then the healed model's parity
        click.echo(f"before healing: {result.parity_before_heal}")
        click.echo(str(result.healed))
        click.echo(f"after healing: {result.parity}")
    else:
        click.echo(str(result.parity))
    if result.rotation:
        click.echo(result.rotation.to_table())
    click.echo(f"saved to {out}")
    if result.exported:
        click.echo(str(result.exported))


@click.command()
@click.argument("src")
@shared(InspectOptions)
def inspect(src, opts: Shared, options: InspectOptions):
    """List the norms in SRC and what `convert` would do with each."""
    result = verbs.inspect(src, options)
    click.echo(json.dumps(result.to_dict()) if opts.as_json else result.to_text())
