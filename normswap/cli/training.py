"""`heal`'s fine-tuning options beyond the basics (LoRA, held-out evaluation, early stopping, trackers, the
plot), collected into a frozen `HealOptions` the command receives; and `normswap plot`."""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass

import click

from normswap.cli.options import Shared, shared
from normswap.healing.options import HealOptions, LoraOptions
from normswap.textdata import read_texts


@dataclass(frozen=True)
class Training:
    """The options this module adds to `heal`: a HealOptions (its basic fields left at their defaults, the
    command sets them) and where to draw the curves."""
    options: HealOptions = HealOptions()
    plot: str | None = None


def _click_options() -> list:
    return [
        click.option("--lora-rank", type=click.IntRange(min=1), default=LoraOptions.rank, show_default=True,
                     help="--train lora: the adapters' rank."),
        click.option("--lora-alpha", type=click.FloatRange(min=0, min_open=True), default=None,
                     help="--train lora: adapter scale numerator (scale alpha/rank). Default: 2 x rank."),
        click.option("--lora-targets", default=None, metavar="NAMES",
                     help="--train lora: comma-separated linear layer names (c_attn,c_fc or full dotted names). "
                          "Default: every linear layer but the output head."),
        click.option("--lora-norms/--no-lora-norms", default=True, show_default=True,
                     help="--train lora: also train the norm gains."),
        click.option("--eval-every", type=click.IntRange(min=1), default=None, metavar="N",
                     help="Measure the objective (KL to the teacher) on held-out text every N steps."),
        click.option("--eval-fraction", type=click.FloatRange(0, 1, max_open=True),
                     default=HealOptions.eval_fraction, show_default=True,
                     help="At most this share of --data is held out (never trained on) for --eval-every."),
        click.option("--eval-windows", type=click.IntRange(min=1), default=HealOptions.eval_windows,
                     show_default=True, help="At most this many held-out windows of --seq-len tokens."),
        click.option("--eval-data", multiple=True, type=click.Path(),
                     help="Held-out text file(s) for --eval-every instead of a slice of --data."),
        click.option("--early-stop", is_flag=True,
                     help="Keep the weights of the best held-out evaluation; stop after --patience worse ones."),
        click.option("--patience", type=click.IntRange(min=1), default=HealOptions.patience, show_default=True,
                     help="--early-stop: evaluations without improvement before stopping."),
        click.option("--report-to", default="none", show_default=True, metavar="TRACKERS",
                     help="Experiment trackers (Accelerate's): tensorboard, wandb, mlflow (comma-separated), none."),
        click.option("--logging-dir", type=click.Path(), default=None,
                     help="Where trackers write (default: runs/<date>_<host>)."),
        click.option("--plot", type=click.Path(), default=None, metavar="PNG",
                     help="Draw the training and held-out curves into this PNG (needs matplotlib)."),
    ]


def training_options(command):
    """Decorator: add the options above to a command, which receives them as `training: Training`."""
    @functools.wraps(command)
    def run(*args, **kw):
        lora = LoraOptions(kw.pop("lora_rank"), kw.pop("lora_alpha"), kw.pop("lora_targets"), kw.pop("lora_norms"))
        eval_data = kw.pop("eval_data")
        options = HealOptions(
            lora=lora, eval_every=kw.pop("eval_every"), eval_fraction=kw.pop("eval_fraction"),
            eval_windows=kw.pop("eval_windows"), eval_texts=tuple(read_texts(eval_data)) if eval_data else None,
            early_stop=kw.pop("early_stop"), patience=kw.pop("patience"), report_to=kw.pop("report_to"),
            logging_dir=kw.pop("logging_dir"))
        return command(*args, training=Training(options, kw.pop("plot")), **kw)
    for option in reversed(_click_options()):
        run = option(run)
    return run


@click.command("plot")
@click.argument("log", metavar="OUT")
@click.option("-o", "--output", "png", required=True, type=click.Path(), help="PNG file to write.")
@shared(load=False, dtype=False, device=False)
def plot_cmd(log, png, opts: Shared):
    """Draw a healed folder's training and held-out curves (OUT/heal_log.json, or that file) into a PNG."""
    from normswap.healing.plot import plot_log, read_log
    written = plot_log(read_log(log), png, overwrite=opts.overwrite)
    click.echo(json.dumps({"plot": str(written)}) if opts.as_json else f"plotted {log} to {written}")
