"""`normswap heal` and `normswap eval`."""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import click

from normswap.atomic import check_output, check_replaceable
from normswap.cli.options import Shared, shared
from normswap.cli.training import Training, training_options
from normswap.errors import NormswapError
from normswap.evaluation import evaluate, text_only
from normswap.healing import plot
from normswap.healing.options import check_lr, partial_path
from normswap.healing.loop import heal as run_heal
from normswap.models.load import LoadOptions, load_model
from normswap.pipeline import resolve_device
from normswap.textdata import read_texts


def check_tokenizers(tok, ref_tok, what: str) -> None:
    """Distillation and KL compare token by token: both sides must map text to the same ids."""
    if tok is None or ref_tok is None:
        return
    a, b = tok.get_vocab(), ref_tok.get_vocab()
    if a != b:
        differ = sum(1 for k, v in a.items() if b.get(k) != v)
        raise NormswapError(f"{what}'s tokenizer does not match the model's ({len(b)} vs {len(a)} tokens, "
                            f"{differ} mapped differently): they must share one vocabulary")


def _load_with(src: str, other: str | None, what: str, load: LoadOptions, device=None):
    """(model, other model or None, tokenizer) with the tokenizers checked against each other."""
    kw = dict(dtype=load.dtype, trust_remote_code=load.trust_remote_code,
              allow_missing_weights=load.allow_missing_weights)
    model, tok = load_model(src, **kw)
    ref, ref_tok = load_model(other, **kw) if other else (None, None)
    if device is not None:
        model.to(device)
        if ref is not None:
            ref.to(device)
    check_tokenizers(tok, ref_tok, what)
    tok = tok if tok is not None else ref_tok
    if tok is None and text_only(model):  # image/speech/seq2seq eval needs none (parity on sample inputs)
        raise NormswapError(f"{src} has no tokenizer files")
    return model, ref, tok


@click.command()
@click.argument("src")
@click.option("--teacher", "teacher_src", help="The original model (folder, Hub id, normswap-demo).")
@click.option("--data", multiple=True, type=click.Path(), help="Text file or folder of .txt (repeatable).")
@click.option("--steps", type=click.IntRange(min=1), default=200, show_default=True)
@click.option("-o", "--output", "out", required=True, type=click.Path(), help="Folder to write.")
@click.option("--train", type=click.Choice(["norms", "all", "lora"]), default="norms", show_default=True,
              help="norms: only norm gains/biases; all: every parameter; lora: LoRA adapters (peft) merged "
                   "into the weights at the end, and the norm gains.")
@click.option("--objective", type=click.Choice(["kd", "lm"]), default="kd", show_default=True,
              help="kd: distil from --teacher; lm: next-token loss on the data.")
@click.option("--seq-len", type=click.IntRange(min=2), default=128, show_default=True)
@click.option("--batch-size", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--lr", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Default: 1e-2 (norms), 3e-4 (all), 5e-3 (lora adapters; norm gains 1e-2).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--fsdp", is_flag=True, default=None,
              help="Shard the model over the processes (FSDP2); implied by an FSDP accelerate config.")
@training_options
@shared()
def heal(src, teacher_src, data, steps, out, train, objective, seq_len, batch_size, lr, seed, fsdp, opts: Shared,
         training: Training):
    """Fine-tune SRC briefly towards the original model on plain text; save to OUT.

    Ctrl-C stops after the current step and saves what was done to OUT.partial; OUT is untouched.
    Under `accelerate launch` the processes (and their devices) are Accelerate's; --device cpu keeps
    them on the CPU (gloo); an FSDP config (examples/accelerate_fsdp.yaml) shards the model over them.
    """
    device = resolve_device(opts.device)
    inputs = [("`src`", src), ("`teacher`", teacher_src)] + [("`data`", d) for d in data]
    check_output(out, inputs)
    check_replaceable(out, opts.overwrite)
    check_lr(lr)
    partial = _partial(out, inputs)
    if objective == "kd" and not teacher_src:
        raise NormswapError("--teacher ORIG is required for distillation (or use --objective lm)")
    if not data:
        raise NormswapError("--data FILE is required: plain text to heal on")
    texts = read_texts(data)
    options = dataclasses.replace(training.options, steps=steps, lr=lr, train=train, objective=objective,
                                  seq_len=seq_len, batch_size=batch_size, seed=seed)
    if training.plot:  # before the run, not after it
        plot.check_available()
        plot.check_target(training.plot, opts.overwrite, out)
    student, teacher, tok = _load_with(src, teacher_src if objective == "kd" else None, "the teacher", opts.load)
    report = run_heal(student, teacher, texts, tokenizer=tok, options=options, out=out,
                      overwrite=opts.overwrite, progress=opts.show_progress,
                      cpu=device.type == "cpu", fsdp=fsdp, partial=partial)
    from accelerate import PartialState
    if not PartialState().is_main_process:  # under `accelerate launch`: one report, from rank 0
        return
    click.echo(json.dumps(report.to_dict(losses=True)) if opts.as_json else str(report))
    if training.plot and report.steps_done:
        plot.plot_log(report.log(), training.plot, overwrite=opts.overwrite)
    if report.interrupted:
        where = f"saved to {report.saved_to}" if report.saved_to else "nothing saved"
        when = "during the final save" if report.save_interrupted else "after"
        click.echo(f"interrupted {when} {report.steps_done}/{report.steps} steps: {where}; {out} untouched",
                   err=True)
        sys.exit(128 + (report.signum or 2))


def _partial(out: str, inputs) -> Path:
    """`OUT.partial`, or `OUT.partial-2` where the former is an input (resuming from OUT.partial to OUT):
    an interrupted run must not replace what it reads."""
    first = partial_path(out)
    try:
        check_output(first, inputs)
        return first
    except NormswapError:
        second = first.with_name(first.name + "-2")
        check_output(second, inputs)
        return second


@click.command("eval")
@click.argument("src")
@click.option("--data", multiple=True, type=click.Path(),
              help="Text file(s) to score (default: the held-out Austen chapters shipped with normswap).")
@click.option("--reference", help="Original model: adds KL and top-1 agreement (encoders: embedding cosine).")
@click.option("--seq-len", type=click.IntRange(min=2), default=None, help="Window (default: model context).")
@click.option("--stride", type=click.IntRange(min=1), default=None, help="Default: seq-len // 2.")
@click.option("--batch-size", type=click.IntRange(min=1), default=8, show_default=True)
@shared(overwrite=False)
def eval_cmd(src, data, reference, seq_len, stride, batch_size, opts: Shared):
    """Perplexity of SRC (sliding window), and agreement with --reference."""
    device = resolve_device(opts.device)
    texts = read_texts(data) if data else None
    model, ref, tok = _load_with(src, reference, "the reference", opts.load, device)
    report = evaluate(model, tok, texts, reference=ref, seq_len=seq_len, stride=stride, batch_size=batch_size,
                      show_progress=opts.show_progress)
    if opts.as_json:
        click.echo(json.dumps(report.to_dict(), allow_nan=False))
    if report.error():  # a NaN model must not pass a script's exit-code check
        raise NormswapError(report.error())
    if not opts.as_json:
        click.echo(str(report))
