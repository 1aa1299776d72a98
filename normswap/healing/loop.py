"""`heal`: a short distillation fine-tune that brings a converted model back to its original.

Loss: KL(teacher || student) on token distributions for models with logits, MSE on every hidden state
for encoders without a head ("kd"); or the plain causal-LM loss ("lm", no teacher needed). The loop runs
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
import math
import os
import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from normswap.atomic import check_output, check_replaceable
from normswap.checkpoint import safetensors
from normswap.errors import NormswapError
from normswap.healing import fsdp as heal_fsdp
from normswap.models import save
from normswap.models.introspect import is_causal_lm, norm_kind
from normswap.models.source import read_config
from normswap.textdata import max_positions, token_stream, wrap_special

DEFAULT_LR = {"norms": 1e-2, "all": 3e-4}


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
    loss_first: float | None   # loss of the first step
    loss_last: float | None    # mean loss of the last 10 steps
    seconds: float
    parallel: str = "none"     # none, ddp or fsdp
    processes: int = 1
    fsdp_units: int = 0        # FSDP-sharded modules (transformer blocks + the root)
    interrupted: bool = False
    signum: int | None = None        # the signal that interrupted the run (2: Ctrl-C, 15: SIGTERM)
    save_interrupted: bool = False   # Ctrl-C came during the final save: the work went to OUT.partial
    saved_to: str | None = None
    losses: list[float] = field(default_factory=list, repr=False)

    def to_dict(self, losses: bool = False) -> dict:
        d = asdict(self)
        return d if losses else {k: v for k, v in d.items() if k != "losses"}

    def __str__(self) -> str:
        loss = f"loss {self.loss_first:.4g} -> {self.loss_last:.4g}" if self.steps_done else "no step finished"
        s = (f"healed {self.steps_done}/{self.steps} steps ({self.train}, {self.trainable:,} params, "
             f"{self.objective}) in {self.seconds:.1f}s: {loss}")
        s += f" (FSDP over {self.processes} processes)" if self.parallel == "fsdp" else ""
        return s + (f"; saved to {self.saved_to}" if self.saved_to else "")


def check_lr(lr) -> None:
    """A learning rate must be a finite number > 0 (inf, nan or 0 train to NaN or not at all)."""
    finite = isinstance(lr, (int, float)) and not isinstance(lr, bool) and math.isfinite(lr)
    if lr is not None and not (finite and lr > 0):
        raise NormswapError(f"`lr` must be a finite number > 0, not {lr}")


def partial_path(out: str | Path) -> Path:
    """Where an interrupted heal saves by default: `<out>.partial` beside `out` (`out/` and `out` alike)."""
    return Path(os.path.normpath(os.path.expanduser(str(out))) + ".partial")


def norm_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """Parameters of norm modules, plus the biases a conversion method added (they hold folded norm biases)."""
    out = {}
    for mname, m in model.named_modules():
        if norm_kind(m) is not None:
            for pname, p in m.named_parameters(recurse=False):
                out[f"{mname}.{pname}" if mname else pname] = p
    for mname in (getattr(model.config, "normswap", None) or {}).get("added_biases", []):
        out[f"{mname}.bias"] = model.get_submodule(mname).bias
    return out


def _schedule(steps: int) -> Callable[[int], float]:
    """Linear warm-up over 10% of the steps, then cosine decay to zero."""
    warm = max(1, steps // 10)
    return lambda i: min(1.0, (i + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(i, steps) / steps))


def _loss(student, teacher, x: torch.Tensor, objective: str) -> torch.Tensor:
    if objective == "lm":
        return student(input_ids=x, labels=x).loss
    with torch.no_grad():
        t = teacher(input_ids=x, output_hidden_states=True)
    s = student(input_ids=x, output_hidden_states=True)
    if getattr(s, "logits", None) is not None:
        if s.logits.shape != t.logits.shape:
            raise NormswapError(f"teacher and student outputs differ: {tuple(t.logits.shape)} vs "
                                f"{tuple(s.logits.shape)} (different vocabularies?)")
        ls, lt = s.logits.float().log_softmax(-1), t.logits.float().log_softmax(-1)
        return F.kl_div(ls, lt, log_target=True, reduction="none").sum(-1).mean()
    if len(s.hidden_states) != len(t.hidden_states) or s.hidden_states[-1].shape != t.hidden_states[-1].shape:
        raise NormswapError("teacher and student hidden states differ in shape: not the same architecture")
    return sum(F.mse_loss(a.float(), b.float()) for a, b in zip(s.hidden_states, t.hidden_states)) / len(
        s.hidden_states)


def _check(student, teacher, texts, train, objective, steps, lr, seq_len, batch_size, out, overwrite, partial):
    if train not in DEFAULT_LR:
        raise NormswapError(f"unknown train mode '{train}': choose norms or all")
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


def _save(student, tokenizer, out, overwrite: bool, info: dict, partial: Path) -> str | None:
    student.config.normswap_heal = info
    if info["interrupted"]:
        if partial.exists():  # replace an earlier partial checkpoint, never anything else
            try:
                if not read_config(partial).get("normswap_heal", {}).get("interrupted"):
                    return None
            except (OSError, ValueError):
                return None
        return str(save.save_pretrained(student, partial, tokenizer, overwrite=True))
    return str(save.save_pretrained(student, out, tokenizer, overwrite=overwrite))


def heal(student: nn.Module, teacher: nn.Module | None, texts: list[str], tokenizer=None, steps: int = 200,
         lr: float | None = None, train: str = "norms", objective: str = "kd", seq_len: int = 128,
         batch_size: int = 8, seed: int = 0, out: str | Path | None = None, overwrite: bool = False,
         progress: bool = True, callback: Callable[[int, float], None] | None = None,
         cpu: bool | None = None, fsdp: bool | None = None, partial: str | Path | None = None) -> HealReport:
    """Fine-tune `student` in place towards `teacher` on random `seq_len` windows of `texts`.

    train: "norms" (only norm gains/biases; lr default 1e-2) or "all" (lr default 3e-4). AdamW, no
    weight decay, 10% warm-up then cosine; dropout off; batches drawn with `seed`, so runs repeat
    exactly. out: save the result there (atomically) at the end. callback(step, loss) runs after every
    step. cpu: train on the CPU even where CUDA is available (None: CUDA when available). Ctrl-C: see
    the module docstring. fsdp: shard the student over the processes (None: when the launch asked for FSDP).
    partial: where an interrupted run saves (default `<out>.partial`). Diverged training (a non-finite
    loss or weight) raises NormswapError, nothing saved; `student` then holds the last finite step.
    """
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm

    partial = Path(partial) if partial is not None else partial_path(out) if out is not None else None
    _check(student, teacher, texts, train, objective, steps, lr, seq_len, batch_size, out, overwrite, partial)
    lr = float(lr if lr is not None else DEFAULT_LR[train])
    ids = token_stream(tokenizer, texts)
    causal = is_causal_lm(student)
    limit = max_positions(student)
    if limit and not causal:
        limit -= 2  # room for [CLS] and [SEP]
    seq_len = min(int(seq_len), limit or seq_len, len(ids))
    if seq_len < 2:
        raise NormswapError("the training text has fewer than 2 tokens")

    # cpu=True without CUDA: under `accelerate launch`/torchrun that selects gloo (MULTI_CPU) instead of no
    # distribution at all.
    accelerator = Accelerator(cpu=not torch.cuda.is_available() if cpu is None else cpu)
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
    grad_before = {n: p.requires_grad for n, p in student.named_parameters()}
    chosen = dict(student.named_parameters()) if train == "all" else norm_parameters(student)
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
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    if not sharded:
        model, optimizer = accelerator.prepare(model, optimizer)
    # The scheduler stays unprepared: Accelerate would step it once per process per step, which with a
    # global batch split over processes would decay the learning rate N times too fast.
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule(int(steps)))
    if teacher is not None:
        teacher.eval().to(accelerator.device)

    losses: list[float] = []
    stop = {"requested": False, "updating": False, "torn": False, "signum": None, "diverged": None}

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
        for _ in range(int(steps)):
            starts = torch.randint(0, len(ids) - seq_len + 1, (batch_size,), generator=gen)
            mine = starts[rank * local:(rank + 1) * local]
            x = torch.stack([ids[s:s + seq_len] for s in mine.tolist()])
            x = (x if causal else wrap_special(tokenizer, x)).to(accelerator.device)
            loss = _loss(model, teacher, x, objective)
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
            bar.update()
            bar.set_postfix(loss=f"{losses[-1]:.4g}")
            if callback is not None:
                callback(len(losses), losses[-1])
            if stop["requested"]:
                accelerator.set_trigger()
            if accelerator.check_trigger():  # any process interrupted: all stop at the same step
                break
    except KeyboardInterrupt as e:
        stop["requested"], stop["torn"] = True, stop["updating"]
        stop["signum"] = stop["signum"] or (e.args[0] if e.args and isinstance(e.args[0], int) else signal.SIGINT)
    finally:
        bar.close()
        for s, handler in old_handlers.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        student = student if sharded else accelerator.unwrap_model(model)
        for n, p in student.named_parameters():
            p.requires_grad_(grad_before[n])
        student.to(dtype)
    # FSDP: the trained shards go back into `student` (a torn update leaves it as it was before heal). A
    # collective, so Ctrl-C is held off: one process leaving it early would hang the others.
    if sharded and not stop["torn"]:
        with _signals_held(main_thread):
            heal_fsdp.gather_into(model, student)
    trained = dict(student.named_parameters())
    bad = [n for n in chosen if not bool(torch.isfinite(trained[n]).all())]
    if stop["diverged"] or (bad and not stop["torn"]):
        why = stop["diverged"] or f"after {len(losses)} steps ({len(bad)} trained tensors not finite, {bad[0]} first)"
        raise NormswapError(f"training diverged {why}: nothing was saved; use a lower `lr` (this run: {lr:g})")

    report = HealReport(int(steps), len(losses), train, objective, trainable, lr, seq_len, batch_size, seed,
                        losses[0] if losses else None, sum(losses[-10:]) / len(losses[-10:]) if losses else None,
                        time.perf_counter() - start, "fsdp" if sharded else "ddp" if ranks > 1 else "none", ranks,
                        units, interrupted=len(losses) < int(steps), losses=losses,
                        signum=int(stop["signum"]) if stop["signum"] else None)
    if out is not None and not stop["torn"] and losses:
        if accelerator.is_main_process:
            _save_keeping_work(student, tokenizer, out, overwrite, report, main_thread, partial)
        accelerator.wait_for_everyone()
    return report


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
            report.saved_to = _save(student, tokenizer, out, overwrite, info(), partial)
            return
        except KeyboardInterrupt:  # the atomic save leaves `out` as it was; keep the work in .partial
            report.interrupted, report.save_interrupted = True, True
    with _signals_held(main_thread):
        report.saved_to = _save(student, tokenizer, out, overwrite, info(), partial)


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
