"""Evaluation while healing, and its record: held-out windows, the objective's loss on them every N steps,
early stopping (the best evaluation's weights restored), Accelerate's experiment trackers (TensorBoard, W&B,
MLflow), and the log history that `heal` saves as heal_log.json beside the weights (like Trainer's
trainer_state.json).

Every process evaluates its share of the held-out windows and the sums are reduced, so the value is the same
on every process and does not depend on how many there are; under FSDP every process runs the same number
of forwards (a collective), padding its share with zero-weight windows.
"""
from __future__ import annotations

import math
import socket
from datetime import datetime
from pathlib import Path

import torch

from normswap.errors import NormswapError
from normswap.healing.objective import metric, window_losses
from normswap.healing.options import HealOptions
from normswap.textdata import joined_ids

LOG_FILE = "heal_log.json"
PROJECT = "normswap-heal"   # the trackers' project / run name
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


def check(options: HealOptions, out) -> None:
    """Named trackers must be installed (Accelerate would drop a missing one silently), and write outside OUT
    (which is replaced whole at the end)."""
    from accelerate.utils import is_mlflow_available, is_tensorboard_available, is_wandb_available
    available = {"tensorboard": is_tensorboard_available, "wandb": is_wandb_available,
                 "mlflow": is_mlflow_available}
    for name in options.report_to:
        if isinstance(name, str) and not available[name]():
            raise NormswapError(f"`report_to` {name}: {name} is not installed (pip install {PACKAGES[name]})")
    if out is not None and options.logging_dir is not None:
        logs, target = Path(options.logging_dir).resolve(), Path(out).resolve()
        if logs == target or target in logs.parents:
            raise NormswapError(f"`logging_dir` {options.logging_dir} is inside `out` {out}, which is replaced "
                                f"whole when the run ends")


def accelerator_kwargs(options: HealOptions) -> dict:
    """Accelerator(...) arguments for the trackers: none without `report_to`."""
    if not options.report_to:
        return {}
    stamp = f"{datetime.now():%b%d_%H-%M-%S}_{socket.gethostname()}"   # Trainer's default runs/ folder name
    return {"log_with": list(options.report_to), "project_dir": options.logging_dir or f"runs/{stamp}"}


def _pick(ids: torch.Tensor, n: int, seq_len: int) -> torch.Tensor:
    """A boolean mask over `ids` of n windows of seq_len tokens spread evenly over them."""
    count = len(ids) // seq_len
    mask = torch.zeros(len(ids), dtype=torch.bool)
    for i in range(n):
        k = int((i + 0.5) * count / n)
        mask[k * seq_len:(k + 1) * seq_len] = True
    return mask


def hold_out(ids: torch.Tensor, options: HealOptions, tokenizer, seq_len: int
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(training tokens, held-out windows (n, seq_len) or None): `eval_texts`' windows, or up to `eval_windows`
    windows of the training tokens, at most `eval_fraction` of them, spread evenly and removed from training."""
    if options.eval_every is None:
        return ids, None
    if options.eval_texts is not None:
        held = joined_ids(tokenizer, list(options.eval_texts))
        n = min(options.eval_windows, len(held) // seq_len)
        if n == 0:
            raise NormswapError(f"`eval_texts` has {len(held)} tokens: fewer than one window of {seq_len}")
        return ids, held[_pick(held, n, seq_len)].view(n, seq_len)
    n = min(options.eval_windows, int(options.eval_fraction * (len(ids) // seq_len)))
    if n == 0:
        raise NormswapError(f"`eval_fraction` {options.eval_fraction:g} of {len(ids)} tokens holds out no "
                            f"window of {seq_len} tokens: give more data, a larger fraction or `eval_texts`")
    mask = _pick(ids, n, seq_len)
    return ids[~mask], ids[mask].view(n, seq_len)


class Monitor:
    """Logs every step, evaluates on the held-out windows when due, keeps the best weights (early_stop)."""

    def __init__(self, accelerator, options: HealOptions, windows: torch.Tensor | None, teacher, objective: str,
                 hparams: dict):
        self.acc, self.o, self.windows, self.teacher, self.objective = accelerator, options, windows, teacher, \
            objective
        self.history: list[dict] = []          # Trainer-style log_history: {"step", "loss", "learning_rate"} ...
        self.evals: list[tuple[int, float]] = []
        self.metric: str | None = None
        self.best: tuple[int, float] | None = None
        self.restored_step: int | None = None
        self.stopped_early = False
        self._saved: list[torch.Tensor] | None = None
        self._stale = 0
        self._open = bool(options.report_to)
        if self._open:
            accelerator.init_trackers(PROJECT, config=hparams)

    def start(self, model) -> None:
        """The step-0 evaluation: where the curve starts, and what early stopping must beat."""
        if self.windows is not None:
            self.metric = metric(model, self.objective, self.windows.to(self.acc.device))
            self._evaluate(model, 0)

    def step(self, model, step: int, loss: float, lr: float) -> bool:
        """Record one training step; evaluate when due. True: stop now (early stopping)."""
        self.history.append({"step": step, "loss": loss, "learning_rate": lr})
        self._log({"train/loss": loss, "train/learning_rate": lr}, step)
        if self.windows is not None and step % self.o.eval_every == 0:
            return self._evaluate(model, step)
        return False

    def finish(self, model, steps_done: int) -> None:
        """A last evaluation at the final step; with early_stop, the best evaluation's weights back."""
        if self.windows is not None and steps_done and self.evals[-1][0] != steps_done:
            self._evaluate(model, steps_done)
        if self._saved is not None and self.best[0] != steps_done:
            with torch.no_grad():
                for p, saved in zip(self._trained(model), self._saved):
                    _local(p).copy_(saved)
            self.restored_step = self.best[0]

    def end(self) -> None:
        """Close the trackers (main process; Accelerate's end_training would also end the process group)."""
        if self._open:
            for tracker in self.acc.trackers:
                tracker.finish()
            self._open = False

    def _log(self, values: dict, step: int) -> None:
        if self._open:
            self.acc.log(values, step=step)

    @staticmethod
    def _trained(model) -> list[torch.Tensor]:
        return [p for p in model.parameters() if p.requires_grad]

    def _evaluate(self, model, step: int) -> bool:
        value = self.held_out_loss(model)
        self.evals.append((step, value))
        self.history.append({"step": step, f"eval_{self.metric}": value})
        self._log({f"eval/{self.metric}": value}, step)
        if self.best is None or value < self.best[1]:
            self.best, self._stale = (step, value), 0
            if self.o.early_stop:  # on the CPU: a copy of what trains (all parameters with train="all")
                self._saved = [_local(p).detach().to("cpu", copy=True) for p in self._trained(model)]
            return False
        self._stale += 1
        if self.o.early_stop and self.o.patience is not None and self._stale >= self.o.patience:
            self.stopped_early = True
        return self.stopped_early

    @torch.no_grad()
    def held_out_loss(self, model) -> float:
        """Mean per-window loss over the held-out windows, whatever the number of processes."""
        ranks, rank = self.acc.num_processes, self.acc.process_index
        n = len(self.windows)
        mine = list(range(rank, n, ranks))
        share = math.ceil(n / ranks)
        weights = [1.0] * len(mine) + [0.0] * (share - len(mine))
        mine += [0] * (share - len(mine))   # same number of forwards on every process (FSDP)
        size = max(1, self.o.batch_size // ranks)
        total = torch.zeros(2, dtype=torch.float64, device=self.acc.device)
        for i in range(0, share, size):
            x = self.windows[mine[i:i + size]].to(self.acc.device)
            w = torch.tensor(weights[i:i + size], dtype=torch.float64, device=self.acc.device)
            losses = window_losses(model, self.teacher, x, self.objective).double()
            total += torch.stack([(losses * w).sum(), w.sum()])
        total = self.acc.reduce(total, "sum")
        return (total[0] / total[1]).item()


def _local(p: torch.Tensor) -> torch.Tensor:
    """This process's part of a parameter (FSDP2 shards are DTensors), else the parameter."""
    return p.to_local() if hasattr(p, "to_local") else p
