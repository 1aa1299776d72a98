"""`heal`'s options as frozen objects: `HealOptions` (what to train and how, evaluation on held-out text while
training, experiment trackers) with `LoraOptions` nested. Bad values fail when the object is made, in one
line naming the parameter (the CLI shows the flag that sets it)."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import get_args

from normswap.choices import Objective, Train, choice
from normswap.errors import NormswapError
from normswap.textdata import read_texts

TRACKERS = ("tensorboard", "wandb", "mlflow")   # --report-to names; Python also takes GeneralTracker objects


def _names(value, what: str) -> tuple[str, ...] | None:
    """A tuple of names from "a,b", ["a", "b"] or None."""
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else list(value)
    if not all(isinstance(v, str) for v in items):
        raise NormswapError(f"`{what}` must be names (strings), got {value!r}")
    names = tuple(v.strip() for v in items if v.strip())
    if not names:
        raise NormswapError(f"`{what}` names no module")
    return names


def _positive_int(value, what: str, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise NormswapError(f"`{what}` must be an integer >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class LoraOptions:
    """LoRA adapters (through peft) on linear layers, merged into the weights when training ends.

    rank: the adapters' rank r; alpha: their scale numerator (scale alpha / r; default 2 x rank).
    targets: module names (the last part, e.g. "c_attn", or a full dotted name) of the linear layers to adapt;
    None: every nn.Linear / transformers Conv1D but the output head. norms: also train the norm gains (and
    the biases a conversion added), as `train="norms"` does.
    """
    rank: int = field(default=4, metadata=dict(
        flag="--lora-rank", type=int, min=1, show_default=True, help="--train lora: the adapters' rank."))
    alpha: float | None = field(default=None, metadata=dict(
        flag="--lora-alpha", type=float, min=0, min_open=True,
        help="--train lora: adapter scale numerator (scale alpha/rank). Default: 2 x rank."))
    targets: tuple[str, ...] | None = field(default=None, metadata=dict(
        flag="--lora-targets", metavar="NAMES",
        help="--train lora: comma-separated linear layer names (c_attn,c_fc or full dotted names). "
             "Default: every linear layer but the output head."))
    norms: bool = field(default=True, metadata=dict(
        flag="--lora-norms", secondary="--no-lora-norms", show_default=True,
        help="--train lora: also train the norm gains."))

    def __post_init__(self):
        _positive_int(self.rank, "lora.rank")
        if self.alpha is not None and (isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float))
                                       or not math.isfinite(self.alpha) or self.alpha <= 0):
            raise NormswapError(f"`lora.alpha` must be a finite number > 0, got {self.alpha!r}")
        object.__setattr__(self, "targets", _names(self.targets, "lora.targets"))

    @property
    def scale(self) -> float:
        return float(self.alpha if self.alpha is not None else 2 * self.rank) / self.rank


@dataclass(frozen=True)
class HealOptions:
    """What `heal` trains and how. Every field is also a keyword of `heal` (`heal(..., steps=100)`).

    train: "norms" (norm gains and the biases a conversion added), "all", "lora" (adapters, see `lora`), or
    "auto": by what the conversion changed (`params.default_train`: norms, but lora for pRMSNorm).
    lr: default 1e-2 (norms), 3e-4 (all), 5e-3 (lora; the norm gains at 1e-2). AdamW, no weight decay, 10% of
    the steps warm-up then cosine to zero.

    Held-out evaluation: every `eval_every` steps (and at step 0 and the last step) the objective's loss is
    measured on held-out windows: `eval_texts` if given, else up to `eval_windows` windows of `seq_len` tokens
    spread evenly over the training data, at most `eval_fraction` of it, which training then never draws.
    early_stop: stop after `patience` evaluations without a better held-out value (None: never stop early)
    and restore the trained parameters of the best evaluation. report_to: experiment trackers
    (Accelerate's: "tensorboard", "wandb", "mlflow", or `accelerate.tracking.GeneralTracker` objects),
    writing under `logging_dir` (default: runs/<date>_<host>).

    Field metadata: the `normswap heal` flag that sets each field (the keys: `normswap.cli.flags`).
    """
    steps: int = field(default=200, metadata=dict(flag="--steps", type=int, min=1, show_default=True))
    lr: float | None = field(default=None, metadata=dict(
        flag="--lr", type=float, min=0, min_open=True,
        help="Default: 1e-2 (norms), 3e-4 (all), 5e-3 (lora adapters; norm gains 1e-2)."))
    train: Train = field(default="auto", metadata=dict(
        flag="--train", choices=get_args(Train), show_default=True,
        help="norms: only norm gains/biases; all: every parameter; lora: LoRA adapters (peft) merged into the "
             "weights at the end, and the norm gains; auto: norms, but lora for a pRMSNorm conversion (all "
             "without peft)."))
    objective: Objective = field(default="kd", metadata=dict(
        flag="--objective", choices=get_args(Objective), show_default=True,
        help="kd: distil from --teacher; lm: next-token loss on the data."))
    seq_len: int = field(default=128, metadata=dict(flag="--seq-len", type=int, min=2, show_default=True))
    batch_size: int = field(default=8, metadata=dict(flag="--batch-size", type=int, min=1, show_default=True))
    seed: int = field(default=0, metadata=dict(flag="--seed", type=int, show_default=True))
    lora: LoraOptions = field(default=LoraOptions(), metadata=dict(prefix="lora."))   # errors say `lora.rank`
    eval_every: int | None = field(default=None, metadata=dict(
        flag="--eval-every", type=int, min=1, metavar="N",
        help="Measure the objective (KL to the teacher) on held-out text every N steps."))
    eval_fraction: float = field(default=0.05, metadata=dict(
        flag="--eval-fraction", type=float, min=0, max=1, max_open=True, show_default=True,
        help="At most this share of --data is held out (never trained on) for --eval-every."))
    eval_windows: int = field(default=64, metadata=dict(
        flag="--eval-windows", type=int, min=1, show_default=True,
        help="At most this many held-out windows of --seq-len tokens."))
    eval_texts: tuple[str, ...] | None = field(default=None, metadata=dict(   # the CLI reads them from files
        flag="--eval-data", multiple=True, type="path",
        parse=lambda files: tuple(read_texts(files)) if files else None,
        help="Held-out text file(s) for --eval-every instead of a slice of --data."))
    early_stop: bool = field(default=False, metadata=dict(
        flag="--early-stop",
        help="Keep the weights of the best held-out evaluation; stop after --patience worse ones."))
    patience: int | None = field(default=3, metadata=dict(
        flag="--patience", type=int, min=1, show_default=True,
        help="--early-stop: evaluations without improvement before stopping."))
    report_to: tuple = field(default=(), metadata=dict(
        flag="--report-to", default="none", show_default=True, metavar="TRACKERS",
        help="Experiment trackers (Accelerate's): tensorboard, wandb, mlflow (comma-separated), none."))
    logging_dir: str | None = field(default=None, metadata=dict(
        flag="--logging-dir", type="path", help="Where trackers write (default: runs/<date>_<host>)."))

    def __post_init__(self):
        choice(self.train, Train, "train mode")
        choice(self.objective, Objective, "objective")
        if not isinstance(self.lora, LoraOptions):
            raise NormswapError(f"`lora` must be a LoraOptions, got {type(self.lora).__name__}")
        if self.eval_every is not None:
            _positive_int(self.eval_every, "eval_every")
        f = self.eval_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 <= f < 1:
            raise NormswapError(f"`eval_fraction` must be in [0, 1), got {f!r}")
        _positive_int(self.eval_windows, "eval_windows")
        if self.patience is not None:
            _positive_int(self.patience, "patience")
        if self.eval_texts is not None:
            texts = (self.eval_texts,) if isinstance(self.eval_texts, str) else tuple(self.eval_texts)
            if not any(isinstance(t, str) and t.strip() for t in texts):
                raise NormswapError("`eval_texts` holds no text")
            object.__setattr__(self, "eval_texts", texts)
        if self.eval_texts is not None and self.eval_every is None:
            raise NormswapError("`eval_texts` is used only with `eval_every`")
        if self.early_stop and self.eval_every is None:
            raise NormswapError("`early_stop=True` needs `eval_every`: the held-out evaluations it compares")
        if self.eval_every is not None and self.eval_texts is None and self.eval_fraction == 0:
            raise NormswapError("`eval_every` needs held-out text: `eval_fraction` > 0 or `eval_texts`")
        object.__setattr__(self, "report_to", _trackers(self.report_to))
        if self.logging_dir is not None and not self.report_to:
            raise NormswapError("`logging_dir` is used only with `report_to` (a tracker)")


def _trackers(value) -> tuple:
    """("tensorboard", ...) from "none", "tensorboard,wandb", a list, or GeneralTracker objects."""
    items = value.split(",") if isinstance(value, str) else list(value or ())
    out = []
    for item in items:
        if isinstance(item, str):
            name = item.strip().lower()
            if name in ("", "none"):
                continue
            if name not in TRACKERS:
                raise NormswapError(f"unknown tracker '{item}' (`report_to`): choose {', '.join(TRACKERS)} or none")
            item = name
        elif not all(hasattr(item, a) for a in ("log", "store_init_configuration", "finish")):
            raise NormswapError(f"`report_to` takes tracker names or accelerate GeneralTracker objects, got "
                                f"{type(item).__name__}")
        if item not in out:
            out.append(item)
    return tuple(out)


def check_lr(lr) -> None:
    """A learning rate must be a finite number > 0 (inf, nan or 0 train to NaN or not at all)."""
    finite = isinstance(lr, (int, float)) and not isinstance(lr, bool) and math.isfinite(lr)
    if lr is not None and not (finite and lr > 0):
        raise NormswapError(f"`lr` must be a finite number > 0, not {lr}")


def partial_path(out: str | Path) -> Path:
    """Where an interrupted heal saves by default: `<out>.partial` beside `out` (`out/` and `out` alike)."""
    return Path(os.path.normpath(os.path.expanduser(str(out))) + ".partial")
