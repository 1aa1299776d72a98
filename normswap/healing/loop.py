"""`heal`: a short distillation fine-tune that brings a converted model back to its original.

Loss (`objective`): KL(teacher || student) on token distributions for models with logits, MSE on every hidden
state for encoders without a head ("kd"); or the plain causal-LM loss ("lm", no teacher needed). What trains:
`params` (norm gains, everything, or LoRA adapters from `lora`, merged at the end); held-out evaluation,
early stopping, trackers and the log saved as heal_log.json: `tracking`. The loop runs
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
import signal
import threading
import time
from pathlib import Path
from collections.abc import Callable

import torch
from torch import nn

from normswap.atomic import check_output, check_replaceable
from normswap.checkpoint import safetensors
from normswap.errors import NormswapError
from normswap.healing import fsdp as heal_fsdp
from normswap.healing import lora as heal_lora
from normswap.healing import tracking
from normswap.healing.objective import window_losses
from normswap.healing.options import HealOptions, check_lr, partial_path
from normswap.healing.params import DEFAULT_LR, norm_parameters, optimizer_groups, to_train
from normswap.healing.report import HealReport
from normswap.models import save
from normswap.models.introspect import is_causal_lm
from normswap.models.source import read_config
from normswap.textdata import max_positions, token_stream, wrap_special


def _schedule(steps: int) -> Callable[[int], float]:
    """Linear warm-up over 10% of the steps, then cosine decay to zero."""
    warm = max(1, steps // 10)
    return lambda i: min(1.0, (i + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(i, steps) / steps))


def _check(student, teacher, texts, train, objective, steps, lr, seq_len, batch_size, out, overwrite, partial):
    if train not in DEFAULT_LR:
        raise NormswapError(f"unknown train mode '{train}': choose norms, all or lora")
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
    if teacher is not None and getattr(teacher.config, "vocab_size", None) != getattr(
            student.config, "vocab_size", None):
        raise NormswapError(f"teacher vocabulary ({teacher.config.vocab_size}) differs from the "
                            f"student's ({student.config.vocab_size})")
    if out is not None:  # before training, not after
        check_output(partial)   # its name fits the file system too
        check_replaceable(out, overwrite)
        safetensors.check_space(out, safetensors.total_bytes(safetensors.saved_specs(student)))


def _save(student, tokenizer, out, overwrite: bool, info: dict, log: dict, partial: Path) -> str | None:
    student.config.normswap_heal = info
    files = {tracking.LOG_FILE: json.dumps(log, indent=1)}
    if info["interrupted"]:
        if partial.exists():  # replace an earlier partial checkpoint, never anything else
            try:
                if not read_config(partial).get("normswap_heal", {}).get("interrupted"):
                    return None
            except (OSError, ValueError):
                return None
        return str(save.save_pretrained(student, partial, tokenizer, overwrite=True, files=files))
    return str(save.save_pretrained(student, out, tokenizer, overwrite=overwrite, files=files))


def heal(student: nn.Module, teacher: nn.Module | None, texts: list[str], tokenizer=None,
         options: HealOptions | None = None, *, out: str | Path | None = None, overwrite: bool = False,
         progress: bool = True, callback: Callable[[int, float], None] | None = None,
         cpu: bool | None = None, fsdp: bool | None = None, partial: str | Path | None = None,
         **fields) -> HealReport:
    """Fine-tune `student` in place towards `teacher` on random `seq_len` windows of `texts`.

    options: a `HealOptions` (steps, lr, train mode, LoRA, held-out evaluation, early stopping, trackers);
    its fields are also accepted as keywords (`heal(..., steps=100, train="lora")`), over `options`.
    train: "norms" (only norm gains/biases; lr default 1e-2), "all" (lr default 3e-4) or "lora" (adapters
    through peft, merged into the weights at the end, plus the norm gains; lr default 5e-3). AdamW, no
    weight decay, 10% warm-up then cosine; dropout off; batches drawn with `seed`, so runs repeat exactly.
    out: save the result there (atomically) at the end, with heal_log.json. callback(step, loss) runs after
    every step. cpu: train on the CPU even where CUDA is available (None: CUDA when available). Ctrl-C: see
    the module docstring. fsdp: shard the student over the processes (None: when the launch asked for FSDP).
    partial: where an interrupted run saves (default `<out>.partial`). Diverged training (a non-finite
    loss or weight) raises NormswapError, nothing saved; `student` then holds the last finite step.
    """
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm

    if options is not None and not isinstance(options, HealOptions):
        raise NormswapError(f"`options` must be a HealOptions, got {type(options).__name__}")
    o = dataclasses.replace(options or HealOptions(), **fields)
    steps, lr, train, objective, seq_len, batch_size, seed = (o.steps, o.lr, o.train, o.objective, o.seq_len,
                                                              o.batch_size, o.seed)
    partial = Path(partial) if partial is not None else partial_path(out) if out is not None else None
    _check(student, teacher, texts, train, objective, steps, lr, seq_len, batch_size, out, overwrite, partial)
    tracking.check(o, out)
    lr = float(lr if lr is not None else DEFAULT_LR[train])
    ids = token_stream(tokenizer, texts)
    causal = is_causal_lm(student)
    limit = max_positions(student)
    if limit and not causal:
        limit -= 2  # room for [CLS] and [SEP]
    seq_len = min(int(seq_len), limit or seq_len, len(ids))
    if seq_len < 2:
        raise NormswapError("the training text has fewer than 2 tokens")
    ids, held = tracking.hold_out(ids, o, tokenizer, seq_len)  # held-out windows leave the training tokens
    held = held if held is None or causal else wrap_special(tokenizer, held)

    # cpu=True without CUDA: under `accelerate launch`/torchrun that selects gloo (MULTI_CPU) instead of no
    # distribution at all.
    accelerator = Accelerator(cpu=not torch.cuda.is_available() if cpu is None else cpu,
                              **tracking.accelerator_kwargs(o))
    sharded = heal_fsdp.requested(accelerator, fsdp)
    ranks, rank = accelerator.num_processes, accelerator.process_index
    if batch_size % ranks:
        raise NormswapError(f"batch_size {batch_size} is the global batch: it must be divisible by the "
                            f"{ranks} processes")
    set_seed(seed)
    # Every process draws the same global batch and trains on its slice: with gradients averaged across
    # processes, N processes follow the loss curve of one process (to rounding).
    gen = torch.Generator().manual_seed(seed)
    local = batch_size // ranks
    dtype = next(student.parameters()).dtype
    student.float()  # train in fp32 whatever the stored dtype; cast back at the end
    grad_before = {p: p.requires_grad for p in student.parameters()}  # by identity: LoRA renames layers
    parameters = sum(p.numel() for p in student.parameters())
    norms = norm_parameters(student)  # before LoRA wraps the layers holding added biases
    adapters = None
    try:  # a failure before training must not leave adapters, flags or fp32 behind
        adapters = heal_lora.Adapters(student, o.lora) if train == "lora" else None
        chosen, lrs = to_train(student, train, norms, adapters, o.lora.norms, lr)
        if not chosen:
            raise NormswapError("the model has no norm parameters to train: use `train='all'`")
        for p in student.parameters():
            p.requires_grad_(False)
        for p in chosen.values():
            p.requires_grad_(True)
        trainable = sum(p.numel() for p in student.parameters() if p.requires_grad)
        student.eval()  # no dropout: match the teacher's deterministic function
        # FSDP: the optimizer must hold the shards (DTensors), so it is made after sharding
        model, units = heal_fsdp.shard(student, accelerator.device) if sharded else (student, 0)
        optimizer = torch.optim.AdamW(optimizer_groups(model, lrs), lr=lr, weight_decay=0.0)
        if not sharded:
            model, optimizer = accelerator.prepare(model, optimizer)
        # The scheduler stays unprepared: Accelerate would step it once per process per step, which with a
        # global batch split over processes would decay the learning rate N times too fast.
        schedule = _schedule(int(steps))
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        if teacher is not None:
            teacher.eval().to(accelerator.device)
        lora_info = None if adapters is None else {"rank": o.lora.rank, "alpha": o.lora.scale * o.lora.rank,
                                                   "targets": adapters.targets, "norms": o.lora.norms}
        monitor = tracking.Monitor(accelerator, o, held, teacher, objective, hparams={
            "steps": int(steps), "lr": lr, "train": train, "objective": objective, "seq_len": seq_len,
            "batch_size": batch_size, "seed": seed, "trainable": trainable, "processes": ranks,
            **({"lora_rank": o.lora.rank, "lora_alpha": lora_info["alpha"]} if lora_info else {})})
    except BaseException:
        _restore(student, adapters, grad_before, dtype)
        raise

    losses: list[float] = []
    stop = {"requested": False, "updating": False, "torn": False, "signum": None, "diverged": None,
            "ended": False}

    def on_signal(signum, frame):   # Ctrl-C or SIGTERM: stop after this step; a second one: at once
        if stop["requested"]:
            raise KeyboardInterrupt(signum)
        stop["requested"], stop["signum"] = True, signum

    main_thread = threading.current_thread() is threading.main_thread()
    handled = (signal.SIGINT, signal.SIGTERM)
    old_handlers = {s: signal.signal(s, on_signal) for s in handled} if main_thread else {}
    bar = tqdm(total=int(steps), desc="heal", disable=not progress or not accelerator.is_local_main_process)
    start = time.perf_counter()
    try:
        monitor.start(model)
        for _ in range(int(steps)):
            starts = torch.randint(0, len(ids) - seq_len + 1, (batch_size,), generator=gen)
            mine = starts[rank * local:(rank + 1) * local]
            x = torch.stack([ids[s:s + seq_len] for s in mine.tolist()])
            x = (x if causal else wrap_special(tokenizer, x)).to(accelerator.device)
            loss = window_losses(model, teacher, x, objective).mean()
            value = accelerator.reduce(loss.detach(), "mean").item()  # the global batch's loss
            if not math.isfinite(value):   # every process sees the same value: all stop here
                stop["diverged"] = f"at step {len(losses) + 1}/{int(steps)} (loss {value})"
                break
            accelerator.backward(loss)
            stop["updating"] = True
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            stop["updating"] = False
            losses.append(value)
            early = monitor.step(model, len(losses), value, lr * schedule(len(losses) - 1))  # same everywhere
            bar.update()
            bar.set_postfix(loss=f"{losses[-1]:.4g}")
            if callback is not None:
                callback(len(losses), losses[-1])
            if stop["requested"]:
                accelerator.set_trigger()
            if accelerator.check_trigger() or early:  # any process interrupted: all stop at the same step
                break
        stop["ended"] = True
    except KeyboardInterrupt as e:
        stop["requested"], stop["torn"], stop["ended"] = True, stop["updating"], True
        stop["signum"] = stop["signum"] or (e.args[0] if e.args and isinstance(e.args[0], int) else signal.SIGINT)
    finally:
        bar.close()
        try:
            if stop["ended"] and not stop["torn"]:  # collectives: every process gets here at the same step
                if not stop["diverged"]:
                    monitor.finish(model, len(losses))  # last evaluation; early_stop: the best weights back
                # FSDP: the trained shards go back into `student` (a torn update leaves it as it was before
                # heal). Signals are held off: one process leaving early would hang the others.
                if sharded:
                    with _signals_held(main_thread):
                        heal_fsdp.gather_into(model, student)
        finally:
            monitor.end()
            for s, handler in old_handlers.items():
                signal.signal(s, handler if handler is not None else signal.SIG_DFL)
            student = student if sharded else accelerator.unwrap_model(model)
            _restore(student, adapters, grad_before, dtype)
    # adapters are merged by now: check the weights they went into, and every trained one
    bad = [n for n, p in student.named_parameters() if p.is_floating_point() and not bool(torch.isfinite(p).all())]
    if stop["diverged"] or (bad and not stop["torn"]):
        why = stop["diverged"] or f"after {len(losses)} steps ({len(bad)} trained tensors not finite, {bad[0]} first)"
        raise NormswapError(f"training diverged {why}: nothing was saved; use a lower `lr` (this run: {lr:g})")

    report = HealReport(int(steps), len(losses), train, objective, trainable, lr, seq_len, batch_size, seed,
                        losses[0] if losses else None, sum(losses[-10:]) / len(losses[-10:]) if losses else None,
                        time.perf_counter() - start, "fsdp" if sharded else "ddp" if ranks > 1 else "none", ranks,
                        units, interrupted=len(losses) < int(steps) and not monitor.stopped_early,
                        signum=int(stop["signum"]) if stop["signum"] else None,
                        parameters=parameters, lora=lora_info, eval_metric=monitor.metric,
                        eval_first=monitor.evals[0][1] if monitor.evals else None,
                        eval_best=monitor.best[1] if monitor.best else None,
                        best_step=monitor.best[0] if monitor.best else None, restored_step=monitor.restored_step,
                        stopped_early=monitor.stopped_early, losses=losses, evals=monitor.evals,
                        history=monitor.history)
    if out is not None and not stop["torn"] and losses:
        if accelerator.is_main_process:
            _save_keeping_work(student, tokenizer, out, overwrite, report, main_thread, partial)
        accelerator.wait_for_everyone()
    return report


def _restore(student: nn.Module, adapters, grad_before: dict, dtype: torch.dtype) -> None:
    """The student as heal found it but for the trained values: adapters merged (in fp32, before the cast
    back; the layers are the model's own again), requires_grad flags and dtype as they were."""
    if adapters is not None:
        adapters.merge()
    for p, before in grad_before.items():
        p.requires_grad_(before)
    student.to(dtype)


def _save_keeping_work(student, tokenizer, out, overwrite: bool, report: HealReport, main_thread: bool,
                       partial: Path) -> None:
    """Save to `out` (or `out`.partial if interrupted); a Ctrl-C during the final save must not lose the
    finished steps, so it falls back to `out`.partial, written with further signals held off (a torn
    partial checkpoint would be worse than a few seconds' wait)."""
    def info():
        return {k: getattr(report, k) for k in ("steps", "steps_done", "train", "objective", "lr", "seq_len",
                                                "batch_size", "seed", "interrupted")}
    if not report.interrupted:
        try:
            report.saved_to = _save(student, tokenizer, out, overwrite, info(), report.log(), partial)
            return
        except KeyboardInterrupt:  # the atomic save leaves `out` as it was; keep the work in .partial
            report.interrupted, report.save_interrupted = True, True
    with _signals_held(main_thread):
        report.saved_to = _save(student, tokenizer, out, overwrite, info(), report.log(), partial)


@contextlib.contextmanager
def _signals_held(main_thread: bool):
    """Ctrl-C and SIGTERM ignored inside the block (only the main thread may set signal handlers), then as
    before."""
    held = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)} if main_thread else {}
    try:
        yield
    finally:
        for s, handler in held.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
