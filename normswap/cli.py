"""`normswap` command line: a thin shell over the Python API. Errors are one line and exit 1."""
from __future__ import annotations

import copy
import json
import sys

import click

from normswap.errors import NormswapError


class _Group(click.Group):
    """Turns every failure into one line on stderr and a non-zero exit, never a traceback."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.ClickException, click.Abort):
            raise
        except NormswapError as e:
            click.echo(f"error: {e}", err=True)
        except KeyboardInterrupt:
            click.echo("interrupted: nothing was written", err=True)
            sys.exit(130)
        except Exception as e:  # a bug of ours, still reported in one line
            msg = str(e).splitlines()[0] if str(e) else ""
            click.echo(f"error: {type(e).__name__}: {msg}", err=True)
        sys.exit(1)


def _quiet_libraries() -> None:
    import warnings

    import transformers
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore")


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="normswap")
def main():
    """Turn a model's LayerNorms into RMSNorm, verify it, save it."""
    _quiet_libraries()


def _methods() -> list[str]:
    from normswap.surgery import available_methods
    return available_methods()


DTYPE = click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16"]), default=None,
                     help="Load the model in this dtype (default: as stored; the demo model: float32).")


@main.command()
@click.argument("src")
@click.option("--to", "to", type=click.Choice(["rmsnorm", "prmsnorm"]), required=True)
@click.option("--p", "p", type=float, default=None, help="pRMSNorm fraction of features (default 0.0625).")
@click.option("--method", type=click.Choice(_methods()), default="auto", show_default=True)
@click.option("-o", "--output", "out", required=True, type=click.Path(), help="Folder to write.")
@click.option("--overwrite", is_flag=True, help="Replace OUT if it exists.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
@DTYPE
@click.option("--finetune-steps", type=click.IntRange(min=0), default=0,
              help="Then heal: N distillation steps from the original on --data.")
@click.option("--data", multiple=True, type=click.Path(), help="Text file(s) for --finetune-steps.")
@click.option("--onnx", "onnx_path", type=click.Path(), help="Then export to this ONNX file (target ort).")
@click.option("--max-shard-size", default="50GB", show_default=True,
              help="Split the weights into shards of at most this size (e.g. 5GB) with an index.")
def convert(src, to, p, method, out, overwrite, as_json, dtype, finetune_steps, data, onnx_path=None,
            max_shard_size="50GB"):
    """Convert SRC (folder, Hub id or normswap-demo) and save it to OUT."""
    from pathlib import Path

    import normswap
    from normswap.parity import compare

    if Path(out).exists() and not overwrite:
        raise NormswapError(f"{out} exists: pass --overwrite to replace it")
    normswap.shards.parse_size(max_shard_size)  # a bad size fails before any work
    if onnx_path and Path(onnx_path).exists() and not overwrite:
        raise NormswapError(f"{onnx_path} exists: pass --overwrite to replace it")
    from normswap.cli_heal import heal_after_convert, read_finetune_data
    texts = read_finetune_data(finetune_steps, data)
    from normswap import stream
    healed = exported = None
    if not texts and not onnx_path and stream.streamable(src):  # a checkpoint folder: bounded memory
        report, parity = stream.convert_folder(src, out, to, method, p, dtype, overwrite, max_shard_size,
                                               progress=not as_json)
    else:
        model, tokenizer = normswap.io.load_model(src, dtype)
        original, parity = copy.deepcopy(model), None
        report = normswap.convert(model, to=to, method=method, p=p)
    if not report.converted:
        msg = f"nothing to convert: {src} has no LayerNorm ({len(report.already_rms)} RMSNorm already)"
        click.echo(json.dumps({"report": report.to_dict(), "message": msg}) if as_json else msg)
        return
    if parity is None:
        healed = heal_after_convert(model, original, tokenizer, texts, finetune_steps) if texts else None
        parity = compare(original, model)
        # Export (validated, atomic) before saving: a failed export then leaves nothing written at all.
        exported = normswap.export_onnx(model, onnx_path, overwrite=overwrite) if onnx_path else None
        normswap.save_pretrained(model, out, tokenizer=tokenizer, overwrite=overwrite,
                                 max_shard_size=max_shard_size)
    if as_json:
        click.echo(json.dumps({"report": report.to_dict(), "parity": parity.to_dict(), "output": str(out),
                                **({"heal": healed.to_dict()} if healed else {}),
                                **({"onnx": exported.to_dict()} if exported else {})}))
    else:
        click.echo(report.to_table())
        click.echo(str(parity))
        if healed:
            click.echo(str(healed))
        click.echo(f"saved to {out}")
        if exported:
            click.echo(str(exported))


@main.command()
@click.argument("src")
@click.option("--json", "as_json", is_flag=True)
@DTYPE
def inspect(src, as_json, dtype):
    """List the norms in SRC and what `convert` would do with each."""
    from normswap.io import load_model
    from normswap.surgery import find_norms
    from normswap.surgery.exact import exact_support

    model, _ = load_model(src, dtype)
    sites, skipped, rms = find_norms(model)
    why_not = exact_support(model, sites)  # None: `--method exact` applies to every norm listed
    bias_fate = " (naive drops the bias)" if why_not else " (exact: bias folded)"
    rows = [{"name": s.name, "type": type(s.module).__name__, "width": s.width, "eps": s.eps,
             "bias_norm": round(s.bias_norm, 6), "exact": why_not is None,
             "action": "to RMSNorm" + (bias_fate if s.bias_norm > 0 else "")} for s in sites]
    rows += [{"name": n, "type": type(model.get_submodule(n)).__name__, "action": "already RMSNorm: kept"}
             for n in rms]
    rows += [{"name": s.name, "type": s.cls, "action": f"skipped: {s.reason}"} for s in skipped]
    if as_json:
        click.echo(json.dumps({"model": type(model).__name__, "norms": rows, "exact_unavailable": why_not}))
        return
    click.echo(f"{type(model).__name__}: {len(sites)} LayerNorm to convert, {len(rms)} RMSNorm, "
               f"{len(skipped)} skipped")
    if sites and why_not:
        click.echo(f"  no exact conversion: {why_not}")
    for r in rows:
        extra = f" width={r['width']} eps={r['eps']:g} |bias|={r['bias_norm']:.4g}" if "width" in r else ""
        click.echo(f"  {r['name'] or '(root)'}  {r['type']}{extra}  -> {r['action']}")


from normswap.cli_heal import eval_cmd, heal  # noqa: E402  (heal and eval live in their own module)
main.add_command(heal)
main.add_command(eval_cmd, "eval")
from normswap.export.cli import export as _export_cmd; main.add_command(_export_cmd)  # noqa: E402,E702

if __name__ == "__main__":
    main()
