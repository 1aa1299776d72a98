"""`heal`'s setup: the token windows it trains on, the Accelerator, and what trains (requires_grad flags, the
optimizer and its schedule, the held-out monitor), gathered into one `Run`. `restore` undoes what the setup
changed on the student, all but the trained values."""
from __future__ import annotations

import atexit
import dataclasses
import math
from collections.abc import Callable

import torch
from torch import nn

from normswap.errors import NormswapError
from normswap.healing import fsdp as heal_fsdp
from normswap.healing import lora as heal_lora
from normswap.healing import tracking
from normswap.healing.options import HealOptions
from normswap.healing.params import DEFAULT_LR, norm_parameters, optimizer_groups, to_train
from normswap.models.introspect import is_causal_lm
from normswap.textdata import joined_ids, max_positions, wrap_special


@dataclasses.dataclass
class Windows:
    """The tokens heal draws its windows from, the held-out windows, and the window length."""
    ids: torch.Tensor
    held: torch.Tensor | None
    seq_len: int               # the requested one, clamped to the model's positions and the text
    causal: bool               # a causal LM: windows go in as they are (else wrapped in [CLS] ... [SEP])


@dataclasses.dataclass
class Run:
    """One heal run as set up; the step loop, the stopping and the report read it."""
    options: HealOptions
    student: nn.Module         # the model trained in place; once trained, unwrapped from Accelerate again
    teacher: nn.Module | None
    tokenizer: object
    windows: Windows
    lr: float                  # the base learning rate: options.lr, else the train mode's default
    accelerator: object
    sharded: bool              # the student is sharded with FSDP2
    gen: torch.Generator       # draws the batches
    dtype: torch.dtype         # the student's, restored at the end (it trains in fp32)
    grad_before: dict = dataclasses.field(default_factory=dict)   # by identity: LoRA renames layers
    parameters: int = 0
    adapters: heal_lora.Adapters | None = None
    model: nn.Module | None = None   # what trains: the student prepared by Accelerate, or sharded
    units: int = 0                   # FSDP-sharded modules
    optimizer: torch.optim.Optimizer | None = None
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    schedule: Callable[[int], float] | None = None
    trainable: int = 0
    lora_info: dict | None = None
    monitor: tracking.Monitor | None = None

    @property
    def steps(self) -> int:
        return int(self.options.steps)


def schedule(steps: int) -> Callable[[int], float]:
    """Linear warm-up over 10% of the steps, then cosine decay to zero."""
    warm = max(1, steps // 10)
    return lambda i: min(1.0, (i + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(i, steps) / steps))


def prepare(student: nn.Module, teacher: nn.Module | None, texts: list[str], tokenizer, o: HealOptions,
            cpu: bool | None, fsdp: bool | None) -> Run:
    """Everything before the first step; a failure leaves the student as it was."""
    lr = float(o.lr if o.lr is not None else DEFAULT_LR[o.train])
    windows = _windows(student, texts, tokenizer, o)
    accelerator, sharded = _accelerator(o, cpu, fsdp)
    # Every process draws the same global batch and trains on its slice: with gradients averaged across
    # processes, N processes follow the loss curve of one process (to rounding).
    gen = torch.Generator().manual_seed(o.seed)
    run = Run(o, student, teacher, tokenizer, windows, lr, accelerator, sharded, gen, next(student.parameters()).dtype)
    student.float()  # train in fp32 whatever the stored dtype; cast back at the end
    run.grad_before = {p: p.requires_grad for p in student.parameters()}
    run.parameters = sum(p.numel() for p in student.parameters())
    norms = norm_parameters(student)  # before LoRA wraps the layers holding added biases
    try:  # a failure before training must not leave adapters, flags or fp32 behind
        _to_train(run, norms)
        run.monitor = _monitor(run)
    except BaseException:
        restore(run)
        raise
    return run


def _windows(student: nn.Module, texts: list[str], tokenizer, o: HealOptions) -> Windows:
    ids = joined_ids(tokenizer, texts)
    causal = is_causal_lm(student)
    limit = max_positions(student)
    if limit and not causal:
        limit -= 2  # room for [CLS] and [SEP]
    seq_len = min(int(o.seq_len), limit or o.seq_len, len(ids))
    if seq_len < 2:
        raise NormswapError("the training text has fewer than 2 tokens")
    ids, held = tracking.hold_out(ids, o, tokenizer, seq_len)  # held-out windows leave the training tokens
    held = held if held is None or causal else wrap_special(tokenizer, held)
    return Windows(ids, held, seq_len, causal)


def _accelerator(o: HealOptions, cpu: bool | None, fsdp: bool | None):
    """The Accelerator, and whether the student is sharded with FSDP; the seed set."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    # cpu=True without CUDA: under `accelerate launch`/torchrun that selects gloo (MULTI_CPU) instead of no
    # distribution at all.
    ours = not _group_initialized()
    accelerator = Accelerator(cpu=not torch.cuda.is_available() if cpu is None else cpu,
                              **tracking.accelerator_kwargs(o))
    if ours and _group_initialized():
        # A group left to interpreter shutdown can abort a rank (gloo's worker threads still holding tensors
        # when Python is torn down: "terminate called without an active exception") after a heal that
        # succeeded. The group this heal created is destroyed at exit, while Python is still whole.
        atexit.register(_destroy_group)
    sharded = heal_fsdp.requested(accelerator, fsdp)
    ranks = accelerator.num_processes
    if o.batch_size % ranks:
        raise NormswapError(f"batch_size {o.batch_size} is the global batch: it must be divisible by the "
                            f"{ranks} processes")
    set_seed(o.seed)
    return accelerator, sharded


def _group_initialized() -> bool:
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized()


def _destroy_group() -> None:
    import torch.distributed as dist
    if _group_initialized():
        dist.destroy_process_group()


def _to_train(run: Run, norms) -> None:
    """The trained parameters chosen (adapters added for LoRA), the optimizer and its schedule made."""
    o, student = run.options, run.student
    run.adapters = heal_lora.Adapters(student, o.lora) if o.train == "lora" else None
    chosen, lrs = to_train(student, o.train, norms, run.adapters, o.lora.norms, run.lr)
    if not chosen:
        raise NormswapError("the model has no norm parameters to train: use `train='all'`")
    for p in student.parameters():
        p.requires_grad_(False)
    for p in chosen.values():
        p.requires_grad_(True)
    run.trainable = sum(p.numel() for p in student.parameters() if p.requires_grad)
    student.eval()  # no dropout: match the teacher's deterministic function
    # FSDP: the optimizer must hold the shards (DTensors), so it is made after sharding
    run.model, run.units = heal_fsdp.shard(student, run.accelerator.device) if run.sharded else (student, 0)
    run.optimizer = torch.optim.AdamW(optimizer_groups(run.model, lrs), lr=run.lr, weight_decay=0.0)
    if not run.sharded:
        run.model, run.optimizer = run.accelerator.prepare(run.model, run.optimizer)
    # The scheduler stays unprepared: Accelerate would step it once per process per step, which with a
    # global batch split over processes would decay the learning rate N times too fast.
    run.schedule = schedule(run.steps)
    run.scheduler = torch.optim.lr_scheduler.LambdaLR(run.optimizer, run.schedule)


def _monitor(run: Run) -> tracking.Monitor:
    """The held-out evaluation, early stopping and trackers, with the run's hyperparameters."""
    o = run.options
    if run.teacher is not None:
        run.teacher.eval().to(run.accelerator.device)
    run.lora_info = None if run.adapters is None else {
        "rank": o.lora.rank, "alpha": o.lora.scale * o.lora.rank, "targets": run.adapters.targets,
        "norms": o.lora.norms}
    return tracking.Monitor(run.accelerator, o, run.windows.held, run.teacher, o.objective, hparams={
        "steps": run.steps, "lr": run.lr, "train": o.train, "objective": o.objective,
        "seq_len": run.windows.seq_len, "batch_size": o.batch_size, "seed": o.seed, "trainable": run.trainable,
        "processes": run.accelerator.num_processes,
        **({"lora_rank": o.lora.rank, "lora_alpha": run.lora_info["alpha"]} if run.lora_info else {})})


def restore(run: Run) -> None:
    """The student as heal found it but for the trained values: adapters merged (in fp32, before the cast
    back; the layers are the model's own again), requires_grad flags and dtype as they were."""
    if run.adapters is not None:
        run.adapters.merge()
    for p, before in run.grad_before.items():
        p.requires_grad_(before)
    run.student.to(run.dtype)
