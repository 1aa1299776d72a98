"""`heal`: a short distillation fine-tune that brings a converted model back to its original.

Loss (`objective`): KL(teacher || student) on token distributions for models with logits, MSE on every hidden
state for encoders without a head ("kd"); or the plain causal-LM loss ("lm", no teacher needed). What trains:
`params` (norm gains, everything, or LoRA adapters from `lora`, merged at the end); held-out evaluation,
early stopping, trackers and the log saved as heal_log.json: `tracking`. The setup (token windows, Accelerator,
optimizer): `prepare`; here the step loop, its stopping, the report and the save. The loop runs
under Hugging Face Accelerate, so `accelerate launch -m normswap heal ...` spreads it over processes (GPUs, or
CPU processes over gloo): `batch_size` is the global batch, split evenly, so the loss curve does not depend
on the number of processes. With FSDP requested (an FSDP launch config, or fsdp=True) the student's parameters
are sharded over the processes with FSDP2 (see `fsdp`); the teacher stays a full copy per process.

Interruption (Ctrl-C or SIGTERM, or KeyboardInterrupt from `callback`): training stops at a step boundary
and the model of the completed steps is saved to `<out>.partial` (or `partial`; config.json
`normswap_heal.interrupted`); `out` itself is never touched unless the run completes. An interrupt that
lands inside an optimizer update (a second signal) leaves the weights half-updated, so then nothing is saved.
A loss or trained weight that is not finite (a learning rate far too high) ends the run with an error and
nothing saved: a NaN model is never written. A Ctrl-C during the final
save to `out` abandons that save (`out` is replaced atomically, so it stays as it was) and writes
`<out>.partial` instead, with Ctrl-C ignored until it is written.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import time
import warnings
from pathlib import Path
from collections.abc import Callable

import torch
from torch import nn

from normswap import progress as shown_progress
from normswap import signals
from normswap.choices import options_from
from normswap.io.atomic import Held, check_output, check_replaceable, held
from normswap.io import safetensors
from normswap.errors import Interrupted, NormswapError
from normswap.evaluation import check_vocabulary
from normswap.healing import fsdp as heal_fsdp
from normswap.healing import tracking
from normswap.healing.objective import check_teacher, window_losses
from normswap.healing.options import HealOptions, check_lr, partial_path
from normswap.healing.params import DEFAULT_LR, default_train
from normswap.healing.prepare import Run, prepare, restore
from normswap.healing.report import HealReport, ends
from normswap.models import save
from normswap.models.demo import contains_heldout
from normswap.models.introspect import is_causal_lm
from normswap.models.source import read_config
from normswap.textdata import wrap_special


def _check(student, teacher, texts, train, objective, steps, lr, seq_len, batch_size, out, overwrite, partial):
    if train not in DEFAULT_LR:
        raise NormswapError(f"unknown train mode '{train}': choose auto, norms, all or lora")
    if objective not in ("kd", "lm"):
        raise NormswapError(f"unknown objective '{objective}': choose kd or lm")
    if objective == "kd" and teacher is None:
        raise NormswapError("distillation (objective kd) needs a teacher: the original model")
    if objective == "lm" and not is_causal_lm(student):
        raise NormswapError("objective lm needs a causal LM; use kd for encoders")
    if int(steps) < 1 or int(batch_size) < 1 or int(seq_len) < 2:
        raise NormswapError("steps and batch_size must be >= 1, seq_len >= 2")
    check_lr(lr)
    if not texts or not any(isinstance(t, str) and t.strip() for t in texts):
        raise NormswapError("no training text")
    check_vocabulary(student, teacher, "the teacher")
    check_teacher(student, teacher)
    if out is not None:  # before training, not after
        check_output(partial)   # its name fits the file system too
        check_replaceable(out, overwrite)
        safetensors.check_space(out, safetensors.total_bytes(safetensors.saved_specs(student)))


def _save(student, tokenizer, out, overwrite: bool, info: dict, log: dict, partial: Path, keep: Keep) -> str | None:
    student.config.normswap_heal = info
    files = {tracking.LOG_FILE: json.dumps(log, indent=1)}
    if info["interrupted"]:
        if partial.exists() or partial.is_symlink():  # replace an earlier partial checkpoint, never anything else
            try:
                earlier = read_config(partial).get("normswap_heal")
            except (OSError, ValueError, NormswapError):   # a file, a folder without config.json: the user's
                earlier = None
            if not (isinstance(earlier, dict) and earlier.get("interrupted")):
                return None
        return str(save.save_pretrained(student, partial, tokenizer, overwrite=True, files=files, source=keep.source))
    return str(save.save_pretrained(student, out, tokenizer, overwrite=overwrite, files=files, source=keep.source,
                                    lock=keep.lock))


@dataclasses.dataclass(frozen=True)
class Keep:
    """What the save keeps: the student's folder, whose kept files (`io.kept`) OUT keeps as convert's does, and
    OUT's lock, held since before training."""
    source: str | Path | None = None
    lock: Held | None = None


def _main_process() -> bool:
    """Rank 0 of a launch (accelerate launch, torchrun: RANK), or no launcher: the process that saves."""
    return os.environ.get("RANK", "0") == "0"


def heal(student: nn.Module, teacher: nn.Module | None, texts: list[str], tokenizer=None,
         options: HealOptions | None = None, *, out: str | Path | None = None, overwrite: bool = False,
         progress: bool = False, callback: Callable[[int, float], None] | None = None,
         cpu: bool | None = None, fsdp: bool | None = None, partial: str | Path | None = None,
         source: str | Path | None = None, **fields) -> HealReport:
    """Fine-tune `student` in place towards `teacher` on random `seq_len` windows of `texts`.

    options: a `HealOptions` (steps, lr, train mode, LoRA, held-out evaluation, early stopping, trackers);
    or its fields as keywords (`heal(..., steps=100, train="lora")`); both only where they agree.
    train: "norms" (only norm gains/biases; lr default 1e-2), "all" (lr default 3e-4), "lora" (adapters
    through peft, merged into the weights at the end, plus the norm gains; lr default 5e-3) or "auto" (the
    default: norms, but lora for a pRMSNorm conversion, all without peft; `params.default_train`). AdamW, no
    weight decay, 10% warm-up then cosine; dropout off; batches drawn with `seed`, so runs repeat exactly.
    out: save the result there (atomically) at the end, with heal_log.json. progress: draw a bar on stderr
    (off by default: a library does not draw on your terminal; `normswap heal` turns it on). callback(step,
    loss) runs after every step. cpu: train on the CPU even where CUDA is available (None: CUDA when
    available). Ctrl-C: see the module docstring. fsdp: shard the student over the processes (None: when
    the launch asked for FSDP). partial: where an interrupted run saves (default `<out>.partial`). source: the
    student's folder, whose other files (tokenizer, sentence-transformers modules: `io.kept`) `out` keeps. OUT's
    lock is held from before training to the save: a second writer of `out` fails at once. Diverged
    training (a non-finite loss or weight) raises NormswapError, nothing saved; `student` then holds the last
    finite step.
    """
    o = options_from(HealOptions, options, fields)
    if o.train == "auto":   # by what the conversion changed
        o = dataclasses.replace(o, train=default_train(student))
    partial = Path(partial) if partial is not None else partial_path(out) if out is not None else None
    _check(student, teacher, texts, o.train, o.objective, o.steps, o.lr, o.seq_len, o.batch_size, out, overwrite,
           partial)
    tracking.check(o, out)
    if contains_heldout(texts):   # an honest number needs text the heal never saw
        warnings.warn("the training text contains the held-out chapters that `normswap eval` scores by default "
                      "(Persuasion ch. 21-24): evaluate this heal on other text (eval --data)", stacklevel=2)
    with contextlib.ExitStack() as stack:
        lock = stack.enter_context(held(out)) if out is not None and _main_process() else None
        run = prepare(student, teacher, texts, tokenizer, o, cpu, fsdp)
        state = _train(run, progress, callback)
        _check_finite(run, state)
        report = _report(run, state)
        if out is not None and not state.torn and state.losses:
            if run.accelerator.is_main_process:
                _save_keeping_work(run.student, tokenizer, out, overwrite, report, partial, Keep(source, lock))
            run.accelerator.wait_for_everyone()
    return report


@dataclasses.dataclass
class State:
    """What the steps did and why they stopped."""
    losses: list[float] = dataclasses.field(default_factory=list)
    start: float = 0.0             # time.perf_counter() at the loop's start
    requested: bool = False        # Ctrl-C or SIGTERM came: stop after this step
    updating: bool = False         # inside an optimizer update
    torn: bool = False             # interrupted inside an update: the weights are half-updated
    signum: int | None = None      # the signal that stopped the run
    diverged: str | None = None    # where the loss stopped being finite
    ended: bool = False            # the loop ran out, stopped or was interrupted (it did not fail)

    def on_signal(self, signum, frame):   # Ctrl-C or SIGTERM: stop after this step; a second one: at once
        if self.requested:
            raise KeyboardInterrupt(signum)
        self.requested, self.signum = True, signum

    def interrupted(self, e: KeyboardInterrupt) -> None:
        self.requested, self.torn, self.ended = True, self.updating, True
        self.signum = self.signum or (e.args[0] if e.args and isinstance(e.args[0], int) else signal.SIGINT)


def _train(run: Run, progress: bool, callback: Callable[[int, float], None] | None) -> State:
    """The step loop under heal's signal handler, then its stopping; the student restored (adapters merged,
    flags and dtype as they were) however the loop ends."""
    state = State()
    previous = signals.install(state.on_signal)
    bar = shown_progress.bar(total=run.steps, desc="heal",
                             enabled=progress and run.accelerator.is_local_main_process)
    state.start = time.perf_counter()
    try:
        _steps(run, state, bar, callback)
    except KeyboardInterrupt as e:
        state.interrupted(e)
    finally:
        bar.close()
        try:
            _stop(run, state)
        finally:
            run.monitor.end()
            signals.restore(previous)
            run.student = run.student if run.sharded else run.accelerator.unwrap_model(run.model)
            restore(run)
    return state


def _batch(run: Run) -> torch.Tensor:
    """This process's slice of the next global batch of windows, on its device."""
    w, accelerator, batch_size = run.windows, run.accelerator, run.options.batch_size
    local, rank = batch_size // accelerator.num_processes, accelerator.process_index
    starts = torch.randint(0, len(w.ids) - w.seq_len + 1, (batch_size,), generator=run.gen)
    mine = starts[rank * local:(rank + 1) * local]
    x = torch.stack([w.ids[s:s + w.seq_len] for s in mine.tolist()])
    return (x if w.causal else wrap_special(run.tokenizer, x)).to(accelerator.device)


def _steps(run: Run, state: State, bar, callback: Callable[[int, float], None] | None) -> None:
    """Train until `steps`, early stopping, an interrupt or a non-finite loss; every process stops at the
    same step."""
    accelerator, losses = run.accelerator, state.losses
    run.monitor.start(run.model)
    for _ in range(run.steps):
        loss = window_losses(run.model, run.teacher, _batch(run), run.options.objective).mean()
        value = accelerator.reduce(loss.detach(), "mean").item()  # the global batch's loss
        if not math.isfinite(value):   # every process sees the same value: all stop here
            state.diverged = f"at step {len(losses) + 1}/{run.steps} (loss {value})"
            break
        accelerator.backward(loss)
        state.updating = True
        run.optimizer.step()
        run.scheduler.step()
        run.optimizer.zero_grad(set_to_none=True)
        state.updating = False
        losses.append(value)
        lr = run.lr * run.schedule(len(losses) - 1)
        early = run.monitor.step(run.model, len(losses), value, lr)  # the same on every process
        bar.update()
        bar.set_postfix(loss=f"{losses[-1]:.4g}")
        if callback is not None:
            callback(len(losses), losses[-1])
        if state.requested:
            accelerator.set_trigger()
        if accelerator.check_trigger() or early:  # any process interrupted: all stop at the same step
            break
    state.ended = True


def _stop(run: Run, state: State) -> None:
    """After a loop that ended whole (collectives: every process gets here at the same step): the last
    evaluation (early_stop: the best weights back), and under FSDP the trained shards back in the student."""
    if state.ended and not state.torn:
        if not state.diverged:
            run.monitor.finish(run.model, len(state.losses))
        # FSDP: the trained shards go back into `student` (a torn update leaves it as it was before
        # heal). Signals are held off: one process leaving early would hang the others.
        if run.sharded:
            with signals.held():
                heal_fsdp.gather_into(run.model, run.student)


def _check_finite(run: Run, state: State) -> None:
    """A non-finite loss, or trained weight, ends the run with an error: a NaN model is never saved."""
    # adapters are merged by now: check the weights they went into, and every trained one
    bad = [n for n, p in run.student.named_parameters() if p.is_floating_point() and not bool(torch.isfinite(p).all())]
    if state.diverged or (bad and not state.torn):
        losses = state.losses
        why = state.diverged or f"after {len(losses)} steps ({len(bad)} trained tensors not finite, {bad[0]} first)"
        raise NormswapError(f"training diverged {why}: nothing was saved; use a lower `lr` (this run: {run.lr:g})")


def _report(run: Run, state: State) -> HealReport:
    o, m, losses = run.options, run.monitor, state.losses
    ranks = run.accelerator.num_processes
    return HealReport(run.steps, len(losses), o.train, o.objective, run.trainable, run.lr, run.windows.seq_len,
                      o.batch_size, o.seed, *ends(losses), time.perf_counter() - state.start,
                      "fsdp" if run.sharded else "ddp" if ranks > 1 else "none", ranks, run.units,
                      interrupted=len(losses) < run.steps and not m.stopped_early,
                      signum=int(state.signum) if state.signum else None, parameters=run.parameters,
                      lora=run.lora_info, eval_metric=m.metric, eval_first=m.evals[0][1] if m.evals else None,
                      eval_best=m.best[1] if m.best else None, best_step=m.best[0] if m.best else None,
                      restored_step=m.restored_step, stopped_early=m.stopped_early, losses=losses, evals=m.evals,
                      history=m.history)


def _save_keeping_work(student, tokenizer, out, overwrite: bool, report: HealReport, partial: Path,
                       keep: Keep) -> None:
    """Save to `out` (or `out`.partial if interrupted); a Ctrl-C during the final save must not lose the
    finished steps, so it falls back to `out`.partial, written with further signals held off (a torn
    partial checkpoint would be worse than a few seconds' wait)."""
    def info():
        return {k: getattr(report, k) for k in ("steps", "steps_done", "train", "objective", "lr", "seq_len",
                                                "batch_size", "seed", "interrupted")}
    if not report.interrupted:
        try:
            report.saved_to = _save(student, tokenizer, out, overwrite, info(), report.log(), partial, keep)
            return
        except Interrupted as e:   # held during the rename, delivered after it: `out` is complete
            report.interrupted, report.save_interrupted = True, True
            report.saved_to, report.signum = str(out), e.signum or signal.SIGINT
            return
        except KeyboardInterrupt as e:  # the atomic save leaves `out` as it was; keep the work in .partial
            report.interrupted, report.save_interrupted = True, True
            report.signum = report.signum or (e.args[0] if e.args and isinstance(e.args[0], int) else signal.SIGINT)
    with signals.held():
        report.saved_to = _save(student, tokenizer, out, overwrite, info(), report.log(), partial, keep)
    if report.saved_to is None:
        report.not_saved = f"{partial} is not an interrupted run's checkpoint of normswap's"
