"""`HealReport`: what a `heal` run did, as text, as JSON (`--json`), and as heal_log.json's content."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


def window(steps: int) -> int:
    """How many steps each end of the loss curve averages: 10, fewer in a short run (the two ends never overlap
    but in a 1-step run). One step's loss is one random batch's: ends of one size compare like with like."""
    return min(10, max(1, steps // 2))


def ends(losses: list[float]) -> tuple[float | None, float | None]:
    """(mean loss of the first `window` steps, of the last `window` steps); (None, None) with no step."""
    if not losses:
        return None, None
    k = window(len(losses))
    return sum(losses[:k]) / k, sum(losses[-k:]) / k


@dataclass
class HealReport:
    steps: int                 # requested
    steps_done: int
    train: str
    objective: str
    trainable: int             # number of trained parameter values
    lr: float
    seq_len: int
    batch_size: int
    seed: int
    loss_first: float | None   # mean training loss of the first `window(steps_done)` steps (10, fewer in short runs)
    loss_last: float | None    # mean training loss of the last as many steps
    seconds: float
    parallel: str = "none"     # none, ddp or fsdp
    processes: int = 1
    fsdp_units: int = 0        # FSDP-sharded modules (transformer blocks + the root)
    interrupted: bool = False
    signum: int | None = None        # the signal that interrupted the run (2: Ctrl-C, 15: SIGTERM)
    save_interrupted: bool = False   # Ctrl-C came during the final save: the work went to OUT.partial
    saved_to: str | None = None
    not_saved: str | None = None     # interrupted, and the steps saved nowhere: why
    parameters: int = 0              # the model's parameters (without adapters): trainable / parameters
    lora: dict | None = None         # train="lora": rank, alpha, targets (module names)
    eval_metric: str | None = None   # held-out evaluation: kl, hidden_mse or nll
    eval_first: float | None = None  # at step 0
    eval_best: float | None = None
    best_step: int | None = None
    restored_step: int | None = None  # early_stop: the step whose weights were restored (None: the last)
    stopped_early: bool = False
    losses: list[float] = field(default_factory=list, repr=False)
    evals: list[tuple[int, float]] = field(default_factory=list, repr=False)   # (step, held-out value)
    history: list[dict] = field(default_factory=list, repr=False)  # heal_log.json's log_history

    def to_dict(self, losses: bool = False) -> dict:
        """losses=True adds the per-step losses and the held-out evaluations (not the log history)."""
        d = asdict(self)
        d.pop("history")
        return d if losses else {k: v for k, v in d.items() if k not in ("losses", "evals")}

    def log(self) -> dict:
        """heal_log.json: the report and its log history (Trainer's trainer_state.json `log_history`)."""
        return {**self.to_dict(), "log_history": self.history}

    def __str__(self) -> str:
        share = f" = {self.trainable / self.parameters:.2%}" if self.parameters else ""
        k = window(self.steps_done)
        span = f"the first {k} steps -> the last {k}" if k > 1 else "step 1 -> the last step"
        loss = f"training loss (mean of {span}) {self.loss_first:.4g} -> {self.loss_last:.4g}" \
            if self.steps_done else "no step finished"
        s = (f"healed {self.steps_done}/{self.steps} steps ({self.train}, {self.trainable:,} params{share}, "
             f"{self.objective}) in {self.seconds:.1f}s: {loss}")
        if self.eval_metric and self.evals:
            s += f"; held-out {self.eval_metric} {self.eval_first:.4g} -> {self.evals[-1][1]:.4g}"
            s += f" (best {self.eval_best:.4g} at step {self.best_step})"
            s += f", step {self.restored_step}'s weights kept" if self.restored_step is not None else ""
            s += ", stopped early" if self.stopped_early else ""
        s += f" (FSDP over {self.processes} processes)" if self.parallel == "fsdp" else ""
        return s + (f"; saved to {self.saved_to}" if self.saved_to else "")
