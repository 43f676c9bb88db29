"""torch.distributed set-up for the trainer: one process per device, started by ``torchrun``.

Without ``WORLD_SIZE`` > 1 in the environment everything is a single process and no process
group is created. Under ``torchrun --nproc_per_node=N`` (``--nnodes`` for several machines) the
environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) selects
the process group; the backend is ``nccl`` on CUDA and ``gloo`` on CPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["DistributedContext", "setup"]


@dataclass
class DistributedContext:
    """Where this process stands: ``rank`` of ``world_size`` (``local_rank`` on its machine),
    the device it trains on, and whether it created the process group."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    backend: str | None = None
    owns_group: bool = False
    context_parallel: int = 1
    sequence_group: Any = None  # the processes that share one sequence (context_parallel > 1)

    @property
    def data_rank(self) -> int:
        """This process's data-parallel replica: the processes of one sequence group share it."""
        return self.rank // self.context_parallel

    @property
    def data_size(self) -> int:
        """How many data-parallel replicas the run has (each reads its own samples)."""
        return self.world_size // self.context_parallel

    @property
    def sequence_rank(self) -> int:
        """Which shard of each sequence this process holds (0 without context parallelism)."""
        return self.rank % self.context_parallel

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        """Sum a few numbers over all processes (float64)."""
        if not self.distributed:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.tolist()

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every process's ``obj``, in rank order."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every process."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.distributed:
            if self.backend == "nccl":
                dist.barrier(device_ids=[self.device.index])
            else:
                dist.barrier()

    def cleanup(self, synchronize: bool = False) -> None:
        """Destroy the process group this context created. ``synchronize`` (after a run that ended
        normally): first wait for every process, so that none tears its transport down while another
        is still talking to it (gloo can abort at exit otherwise)."""
        if self.owns_group and dist.is_initialized():
            if synchronize:
                self.barrier()
            dist.destroy_process_group()
            self.owns_group = False


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an int, got {value!r}") from None


def setup(device: str = "auto", context_parallel: int = 1) -> DistributedContext:
    """Create the context (and the process group under ``torchrun``).

    ``device``: ``"auto"`` (CUDA when available, else CPU), ``"cpu"`` or ``"cuda"``. With
    several processes on CUDA, process ``LOCAL_RANK`` uses ``cuda:LOCAL_RANK``.
    ``context_parallel``: processes that split each sequence between them (consecutive ranks,
    :mod:`subquad.distributed`); the world size must be a multiple of it, and the groups of
    ``world_size / context_parallel`` replicas train by data parallelism. Each sequence group gets
    a process group of its own, so its collectives never queue behind DDP's gradient all-reduce.
    """
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but CUDA is not available; use device='cpu'")
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    world_size = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"bad torch.distributed environment: RANK={rank}, WORLD_SIZE={world_size}")
    if use_cuda:
        dev = torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    ctx = DistributedContext(rank=rank, world_size=world_size, local_rank=local_rank, device=dev)
    if world_size > 1:
        ctx.backend = "nccl" if use_cuda else "gloo"
        if not dist.is_initialized():
            kwargs = {"device_id": dev} if use_cuda else {}
            dist.init_process_group(backend=ctx.backend, **kwargs)
            ctx.owns_group = True
        if dist.get_world_size() != world_size or dist.get_rank() != rank:
            raise RuntimeError("the process group does not match RANK / WORLD_SIZE in the environment")
    if context_parallel > 1:
        _sequence_groups(ctx, context_parallel)
    return ctx


def _sequence_groups(ctx: DistributedContext, size: int) -> None:
    """One process group per ``size`` consecutive ranks (every rank creates every group, in order)."""
    if ctx.world_size % size:
        ctx.cleanup()
        raise ValueError(f"context parallelism over {size} processes needs a multiple of {size} processes "
                         f"(torchrun --nproc_per_node), this run has {ctx.world_size}")
    ctx.context_parallel = size
    for first in range(0, ctx.world_size, size):
        group = dist.new_group(list(range(first, first + size)))
        if first <= ctx.rank < first + size:
            ctx.sequence_group = group
