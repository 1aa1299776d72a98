"""FSDP2 (`torch.distributed.fsdp.fully_shard`) for `heal`: the student's parameters sharded over the processes.

heal shards the student itself instead of handing it to Accelerate's FSDP plugin: Accelerate (1.15) turns
FSDP on only for GPU-like devices and silently runs DDP on CPU processes, so its path could not be tested
without GPUs. `fully_shard` is the same code over gloo (CPU) and NCCL (GPU), and the CPU run is what CI checks.

The sharded model is a shallow copy of the student whose parameters start as aliases of the student's:
`fully_shard` changes a module's class and swaps its parameters for DTensors, which would leave the caller's
model unusable (and unsavable as its own class). At the end the trained values are gathered back into the
student, on every process, so `heal` still trains `student` in place and saves it with the usual path.
"""
from __future__ import annotations

import copy
import os
import warnings
from collections import defaultdict

import torch
from torch import nn

from normswap.errors import NormswapError
from normswap.folder.shipped import original_class


def requested(accelerator, fsdp: bool | None) -> bool:
    """fsdp=None follows the launcher: an FSDP config / `accelerate launch --use_fsdp` (on CPU Accelerate
    reports MULTI_CPU, so its environment variable is what says FSDP was asked for)."""
    from accelerate.utils import DistributedType
    if fsdp is False and accelerator.distributed_type == DistributedType.FSDP:  # prepare() would wrap it in FSDP
        raise NormswapError("fsdp=False under an FSDP launch: launch with DDP (accelerate launch --multi_gpu)")
    if fsdp is None:
        fsdp = (accelerator.distributed_type == DistributedType.FSDP
                or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true")
    if fsdp and accelerator.num_processes < 2:
        raise NormswapError("FSDP shards the model over processes: launch 2 or more (accelerate launch "
                            "--config_file examples/accelerate_fsdp.yaml --num_processes N -m normswap heal ...)")
    return bool(fsdp)


def blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks, each one FSDP unit: `_no_split_modules` (which HF models name), else the children
    of the largest ModuleList. A block holding a parameter that is also used outside it (tied embeddings) is
    left to the root's unit, because FSDP keeps parameters tied only within one unit."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    found = [m for m in model.modules() if m is not model and type(m).__name__ in names]
    if not found:
        lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
        found = list(max(lists, key=len)) if lists else []
    inner = {id(s) for m in found for s in m.modules() if s is not m}
    found = [m for m in found if id(m) not in inner]  # outermost only: a block inside a block is one unit
    if not found:
        raise NormswapError(f"FSDP: {original_class(model).__name__} has no list of transformer blocks to shard")
    users = defaultdict(set)  # parameter -> modules holding it
    for m in model.modules():
        for p in m._parameters.values():
            if p is not None:
                users[id(p)].add(id(m))

    def alone(b):  # no parameter of b is used outside b
        inside = {id(s) for s in b.modules()}
        return all(users[id(p)] <= inside for p in b.parameters())
    return [b for b in found if alone(b)]


def shard(student: nn.Module, device: torch.device) -> tuple[nn.Module, int]:
    """(sharded copy of `student`, number of FSDP units in it). The copy's parameters alias the student's until
    `fully_shard` replaces them by this process's shard (it never writes into the student's storage)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.tensor import DTensor
    if any(p.is_meta for p in student.parameters()):  # transformers loads so on ranks > 0 when asked to
        raise NormswapError("FSDP: the student has no weights on this process: set fsdp_cpu_ram_efficient_loading "
                            "to false in the accelerate config")
    alias = {id(t): (nn.Parameter(t.detach(), t.requires_grad) if isinstance(t, nn.Parameter) else t.detach())
             for t in [*student.parameters(), *student.buffers()]}
    model = copy.deepcopy(student, alias)  # same ids -> same alias: tied weights stay tied in the copy
    # FSDP warns that the root returns views, in case the caller changes them in place; heal's loss never does
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    units = blocks(model)
    for b in units:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)  # the root last: the embeddings, final norm and tied head live here
    # counted, not assumed: the report's fsdp_units is what a test checks against a silent fallback to DDP
    if not all(isinstance(p, DTensor) for p in model.parameters()):
        raise NormswapError("FSDP: some parameters were not sharded")
    return model, sum(isinstance(m, FSDPModule) for m in model.modules())


def gather_into(model: nn.Module, student: nn.Module) -> None:
    """Copy the trained (sharded) parameters back into `student`; a collective, so every process calls it."""
    from torch.distributed.tensor import DTensor
    mine = dict(student.named_parameters())
    with torch.no_grad():
        for name, p in model.named_parameters():  # the same names and order on every process
            if p.requires_grad:  # frozen parameters did not change
                mine[name].copy_(p.full_tensor() if isinstance(p, DTensor) else p)

