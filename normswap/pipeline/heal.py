"""`heal_checkpoint`: what `normswap heal` runs, for Python callers too. Every check that can fail (outputs,
options, the plot's target) runs before the models load; OUT appears only once training completed."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from normswap.errors import NormswapError
from normswap.healing import plot
from normswap.healing.loop import heal
from normswap.healing.options import check_lr, partial_path
from normswap.healing.report import HealReport
from normswap.io.atomic import check_output, check_replaceable
from normswap.models.source import source_folder
from normswap.pipeline.device import resolve_device
from normswap.pipeline.evaluate import load_pair
from normswap.pipeline.options import HealCheckpointOptions
from normswap.textdata import read_texts


@dataclass
class HealResult:
    report: HealReport
    main_process: bool = True             # False on the other processes of `accelerate launch`
    plotted: Path | None = None           # the curves drawn (`plot`), by the main process


def partial_beside(out: str, inputs) -> Path:
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


def heal_checkpoint(src: str, out: str | Path, options: HealCheckpointOptions | None = None) -> HealResult:
    """Fine-tune the model at `src` briefly towards `options.teacher` on the text files `options.data`
    (`normswap.heal` does the training; `options.heal` says how) and save it to `out`.

    An interrupt stops after the current step and saves what was done to `<out>.partial` (see the report);
    `out` is untouched. Under `accelerate launch` every process runs this; the main one draws the plot.
    """
    o, out = options if options is not None else HealCheckpointOptions(), str(out)
    device = resolve_device(o.device)
    inputs = [("`src`", src), ("`teacher`", o.teacher)] + [("`data`", d) for d in o.data]
    check_output(out, inputs)
    check_replaceable(out, o.overwrite)
    check_lr(o.heal.lr)
    partial = partial_beside(out, inputs)
    if o.heal.objective == "kd" and not o.teacher:
        raise NormswapError("`teacher` ORIG is required for distillation (or use `objective='lm'`)")
    if not o.data:
        raise NormswapError("`data` FILE is required: plain text to heal on")
    texts = read_texts(o.data)
    if o.plot:  # before the run, not after it
        plot.check_available()
        plot.check_target(o.plot, o.overwrite, out)
    student, teacher, tok = load_pair(src, o.teacher if o.heal.objective == "kd" else None, "the teacher", o.load)
    report = heal(student, teacher, texts, tokenizer=tok, options=o.heal, out=out, overwrite=o.overwrite,
                  progress=o.show_progress, cpu=device.type == "cpu", fsdp=o.fsdp, partial=partial,
                  source=source_folder(src))
    from accelerate import PartialState
    result = HealResult(report, PartialState().is_main_process)
    if o.plot and report.steps_done and result.main_process:
        result.plotted = plot.plot_log(report.log(), o.plot, overwrite=o.overwrite)
    return result
