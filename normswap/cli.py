"""`normswap` command line: a thin shell over the Python API. Errors are one line: exit 1, usage 2."""
from __future__ import annotations

import copy
import json
import sys

import click

from normswap.cli_options import device_option, dtype_name, dtype_option, resolve_device, setup_output, warn
from normswap.cli_load import load_options
from normswap.errors import NormswapError


def _terminated(signum, frame):
    raise KeyboardInterrupt(signum)  # SIGTERM ends a run the way Ctrl-C does: cleaned up, one line


_NoArgs = getattr(click.exceptions, "NoArgsIsHelpError", ())


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())


class _Group(click.Group):
    """Turns every failure into one line on stderr and a non-zero exit, never a traceback.

    Exit codes: 1 runtime errors, 2 usage errors (bad options), 130 Ctrl-C, 143 SIGTERM.
    """

    def main(self, *args, standalone_mode=True, **kwargs):
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            rv = super().main(*args, standalone_mode=False, **kwargs)
        except _NoArgs as e:  # plain `normswap`: the help, as before
            click.echo(e.ctx.get_help())
            sys.exit(0)
        except click.UsageError as e:  # click would print usage + a hint + the error: three lines
            hint = f" (see '{e.ctx.command_path} --help')" if e.ctx else ""
            click.echo(f"error: {_one_line(e.format_message())}{hint}", err=True)
            sys.exit(2)
        except click.ClickException as e:
            click.echo(f"error: {_one_line(e.format_message())}", err=True)
            sys.exit(e.exit_code)
        except click.Abort:
            click.echo("interrupted", err=True)
            sys.exit(130)
        sys.exit(rv if isinstance(rv, int) else 0)

    def invoke(self, ctx):
        import signal
        import threading
        main_thread = threading.current_thread() is threading.main_thread()
        old_term = signal.signal(signal.SIGTERM, _terminated) if main_thread else None
        from normswap.atomic import written
        written.clear()  # what this command writes, for the interrupt message
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.ClickException, click.Abort):
            raise
        except NormswapError as e:
            click.echo(f"error: {e}", err=True)
        except KeyboardInterrupt as e:
            done = f"{', '.join(written)} written" if written else "nothing was written"
            click.echo(f"interrupted: {done}", err=True)
            sys.exit(128 + (e.args[0] if e.args and isinstance(e.args[0], int) else 2))
        except Exception as e:  # a bug of ours, still reported in one line
            msg = str(e).splitlines()[0] if str(e) else ""
            click.echo(f"error: {type(e).__name__}: {msg}", err=True)
        finally:
            if main_thread:
                signal.signal(signal.SIGTERM, old_term if old_term is not None else signal.SIG_DFL)
        sys.exit(1)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="normswap")
@click.option("-q", "--quiet", "quiet", count=True, help="No warnings, no progress bars (errors and the result still print).")
@click.option("-v", "--verbose", "verbose", count=True, help="Also the libraries' info messages.")
@click.pass_context
def main(ctx, quiet, verbose):
    """Turn a model's LayerNorms into RMSNorm, verify it, save it."""
    ctx.obj = {"verbosity": verbose - quiet}
    setup_output(verbose - quiet)


def _output(as_json: bool) -> None:
    """Per command: --json turns progress bars off (stdout must stay one JSON object)."""
    setup_output(click.get_current_context().obj["verbosity"], as_json)


def _methods() -> list[str]:
    from normswap.surgery import available_methods
    return available_methods()


OVERWRITE_ANY = click.option("--overwrite-any", is_flag=True,
                              help="Replace OUT even if normswap did not write it (its files are deleted).")


@main.command()
@click.argument("src")
@click.option("--to", "to", type=click.Choice(["rmsnorm", "prmsnorm"]), required=True)
@click.option("--p", "p", type=float, default=None, help="pRMSNorm fraction of features (default 0.0625).")
@click.option("--method", type=click.Choice(_methods()), default="auto", show_default=True)
@click.option("-o", "--output", "out", required=True, type=click.Path(), help="Folder to write.")
@click.option("--overwrite", is_flag=True, help="Replace OUT if normswap wrote it (or it is empty).")
@OVERWRITE_ANY
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
@dtype_option
@device_option
@load_options
@click.option("--finetune-steps", type=click.IntRange(min=0), default=0,
              help="Then heal: N distillation steps from the original on --data.")
@click.option("--data", multiple=True, type=click.Path(), help="Text file(s) for --finetune-steps.")
@click.option("--onnx", "onnx_path", type=click.Path(), help="Then export to this ONNX file (target ort).")
@click.option("--max-shard-size", default="50GB", show_default=True,
              help="Split the weights into shards of at most this size (e.g. 5GB) with an index.")
def convert(src, to, p, method, out, overwrite, overwrite_any, as_json, dtype, device, finetune_steps, data,
            onnx_path=None, max_shard_size="50GB"):
    """Convert SRC (folder, Hub id or normswap-demo) and save it to OUT."""
    import normswap
    from normswap.atomic import check_output, check_replaceable
    from normswap.parity import compare_to, reference_outputs, refuse_nonfinite

    overwrite = "any" if overwrite_any else overwrite
    inputs = [("SRC", src)] + [("--data", d) for d in data]
    check_output(out, inputs)
    check_replaceable(out, overwrite)
    if onnx_path:
        check_output(onnx_path, inputs + [("OUT", out)])
        if check_output(out) in check_output(onnx_path).parents:
            raise NormswapError(f"--onnx {onnx_path} is inside OUT {out}: saving OUT would delete it")
        from normswap.export import check_replaceable as check_onnx
        check_onnx(onnx_path, overwrite)
    normswap.shards.parse_size(max_shard_size)  # a bad size fails before any work
    from normswap.cli_heal import heal_after_convert, read_finetune_data
    _output(as_json)
    device = resolve_device(device)
    texts = read_finetune_data(finetune_steps, data)
    from normswap import stream
    healed = exported = None
    streamed = False
    if not texts and not onnx_path and device.type == "cpu" and stream.streamable(src):
        # a checkpoint folder: converted tensor by tensor, in bounded memory, verified before OUT appears
        try:
            report, parity = stream.convert_folder(src, out, to, method, p, dtype_name(dtype), overwrite,
                                                   max_shard_size)
            streamed = True
        except stream.NotStreamable as e:   # raised before anything is written
            warn(f"{e}: converting in memory")
    if not streamed:
        model, tokenizer = normswap.io.load_model(src, dtype_name(dtype))
        model.to(device)
        reference = reference_outputs(model)   # outputs before editing, not a copy of the model
        # Healing distils from the unconverted model while training the converted one: both must exist
        # at once, so this is the one copy, made only with --finetune-steps.
        original = copy.deepcopy(model) if texts else None
        report, parity = normswap.convert(model, to=to, method=method, p=p), None
    if not report.converted:
        msg = f"nothing to convert: {src} has no LayerNorm ({len(report.already_rms)} RMSNorm already)"
        click.echo(json.dumps({"report": report.to_dict(), "message": msg}) if as_json else msg)
        return
    for w in report.warnings:  # on stderr, whatever the output format
        warn(w)
    if parity is None:
        healed = heal_after_convert(model, original, tokenizer, texts, finetune_steps) if texts else None
        parity = compare_to(reference, model)
        refuse_nonfinite(parity)
        # Export (validated, atomic) before saving: a failed export then leaves nothing written at all.
        exported = normswap.export_onnx(model, onnx_path, overwrite=overwrite) if onnx_path else None
        normswap.save_pretrained(model, out, tokenizer=tokenizer, overwrite=overwrite,
                                 max_shard_size=max_shard_size)
    if as_json:
        click.echo(json.dumps({"report": report.to_dict(), "parity": parity.to_dict(), "output": str(out),
                                **({"heal": healed.to_dict()} if healed else {}),
                                **({"onnx": exported.to_dict()} if exported else {})}))
    else:
        click.echo(report.to_table(warnings=False))
        click.echo(str(parity))
        if healed:
            click.echo(str(healed))
        click.echo(f"saved to {out}")
        if exported:
            click.echo(str(exported))


@main.command()
@click.argument("src")
@click.option("--json", "as_json", is_flag=True)
@dtype_option
@load_options
def inspect(src, as_json, dtype):
    """List the norms in SRC and what `convert` would do with each."""
    from normswap.io import load_model
    from normswap.surgery import find_norms
    from normswap.surgery.exact import plan
    from normswap.surgery.report import BIAS_FATE, plan_lines

    _output(as_json)
    model, _ = load_model(src, dtype_name(dtype))
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
        if "plan" in r:
            click.echo("\n".join(plan_lines(found[r["name"]])))


from normswap.cli_heal import eval_cmd, heal  # noqa: E402  (heal and eval live in their own module)
main.add_command(heal)
main.add_command(eval_cmd, "eval")
from normswap.export.cli import export as _export_cmd; main.add_command(_export_cmd)  # noqa: E402,E702

if __name__ == "__main__":
    main()
