"""`normswap convert` (the pipeline: `normswap.convert_checkpoint`) and `normswap inspect`."""
from __future__ import annotations

import json

import click

from normswap.cli.options import Shared, shared, warn
from normswap.models.load import load_model
from normswap.pipeline import ConvertOptions, convert_checkpoint
from normswap.surgery.convert import METHODS
from normswap.surgery.exact import plan
from normswap.surgery.report import BIAS_FATE, plan_lines
from normswap.surgery.walk import find_norms


@click.command()
@click.argument("src")
@click.option("--to", "to", type=click.Choice(["rmsnorm", "prmsnorm"]), required=True)
@click.option("--p", "p", type=float, default=None, help="pRMSNorm fraction of features (default 0.0625).")
@click.option("--method", type=click.Choice(sorted(METHODS)), default="auto", show_default=True)
@click.option("-o", "--output", "out", required=True, type=click.Path(), help="Folder to write.")
@shared()
@click.option("--finetune-steps", type=click.IntRange(min=0), default=0,
              help="Then heal: N distillation steps from the original on --data.")
@click.option("--data", multiple=True, type=click.Path(), help="Text file(s) for --finetune-steps.")
@click.option("--onnx", "onnx_path", type=click.Path(), help="Then export to this ONNX file (target ort).")
@click.option("--max-shard-size", default="50GB", show_default=True,
              help="Split the weights into shards of at most this size (e.g. 5GB) with an index.")
def convert(src, to, p, method, out, opts: Shared, finetune_steps, data, onnx_path=None, max_shard_size="50GB"):
    """Convert SRC (folder, Hub id or normswap-demo) and save it to OUT."""
    result = convert_checkpoint(src, out, ConvertOptions(
        to=to, method=method, p=p, load=opts.load, device=opts.device, finetune_steps=finetune_steps,
        data=tuple(data), onnx=onnx_path, max_shard_size=max_shard_size, overwrite=opts.overwrite,
        show_progress=opts.show_progress))
    report = result.report
    for w in result.notices:  # on stderr, whatever the output format
        warn(w)
    if not report.converted:
        skipped = [f"{s['name']} ({s['cls']}): {s['reason']}" for s in report.skipped]
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
    click.echo(str(result.parity))
    if result.healed:
        click.echo(str(result.healed))
    click.echo(f"saved to {out}")
    if result.exported:
        click.echo(str(result.exported))


@click.command()
@click.argument("src")
@shared(device=False, overwrite=False)
def inspect(src, opts: Shared):
    """List the norms in SRC and what `convert` would do with each."""
    model, _ = load_model(src, opts.load.dtype, opts.load.trust_remote_code, opts.load.allow_missing_weights)
    sites, skipped, rms = find_norms(model)
    traced = plan(model, sites) if sites else None   # one traced forward: sources, readers, bias fate
    found, why_not = (traced.norms, traced.reason) if traced else ({}, None)

    def fate(s):
        return " (naive drops the bias)" if why_not else f" ({BIAS_FATE[found[s.name].bias]})"
    rows = [{"name": s.name, "type": type(s.module).__name__, "width": s.width, "eps": s.eps,
             "bias_norm": round(s.bias_norm, 6), "exact": why_not is None,
             "action": "to RMSNorm" + (fate(s) if s.bias_norm > 0 else ""),
             "plan": {k: v for k, v in vars(found[s.name]).items() if k not in ("name", "width")}} for s in sites]
    rows += [{"name": n, "type": type(model.get_submodule(n)).__name__, "action": "already RMSNorm: kept"}
             for n in rms]
    rows += [{"name": s.name, "type": s.cls, "action": f"skipped: {s.reason}"} for s in skipped]
    if opts.as_json:
        click.echo(json.dumps({"model": type(model).__name__, "norms": rows, "exact_unavailable": why_not}))
        return
    click.echo(f"{type(model).__name__}: {len(sites)} LayerNorm to convert, {len(rms)} RMSNorm, "
               f"{len(skipped)} skipped")
    if sites and why_not:
        click.echo(f"  no exact conversion: {why_not}")
    for r in rows:
        extra = f" width={r['width']} eps={r['eps']:g} |bias|={r['bias_norm']:.4g}" if "width" in r else ""
        click.echo(f"  {r['name'] or '(root)'}  {r['type']}{extra}  -> {r['action']}")
        if "plan" in r:
            click.echo("\n".join(plan_lines(found[r["name"]])))
