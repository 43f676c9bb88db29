"""The collectives of the ops' context-parallel forms (:func:`subquad.distributed.attention`): a
sequence split over the processes of a ``torch.distributed`` group, each holding one contiguous
shard, the shards in rank order.

:class:`Shards` names the group and this process's place in it and runs what the forms need,
through torch.distributed's own collectives, so any backend that has them works (gloo on CPU,
NCCL on GPU):

- :meth:`Shards.gather`: every rank's tensor of one shape, stacked, differentiable (its backward
  all-reduces the gradient and each rank keeps its own slice);
- :meth:`Shards.max`, :meth:`Shards.broadcast`, :meth:`Shards.gather_ints`: without gradient;
- :meth:`Shards.exchange`: send to one rank and receive from another at once (a ring's step).

Every rank must make the same calls in the same order, forward and backward: a rank that skips
a backward leaves the others waiting.

:data:`TRAFFIC` counts what this process hands the collectives (bytes of each all-gather's
output, all-reduce's tensor, broadcast's tensor and of every send), for
:func:`subquad.distributed.traffic`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["LAYOUTS", "Shards", "TRAFFIC"]

#: bytes and calls of the collectives this process made (see the module docstring)
TRAFFIC = {"bytes": 0, "calls": 0}


def _count(*tensors: Tensor) -> None:
    TRAFFIC["bytes"] += sum(t.numel() * t.element_size() for t in tensors)
    TRAFFIC["calls"] += 1


LAYOUTS = ("contiguous", "zigzag")


@dataclass(frozen=True)
class Shards:
    """This process's place in ``group`` (None: the default group): ``rank`` and ``size`` are the
    group's own; ``layout``: which positions a rank holds, ``"contiguous"`` (rank ``r`` the
    ``r``-th of ``size`` parts of the sequence) or ``"zigzag"`` (the sequence in ``2 size`` parts,
    rank ``r`` holding parts ``r`` and ``2 size - 1 - r``, in that order)."""

    group: Any
    rank: int
    size: int
    layout: str = "contiguous"

    @classmethod
    def of(cls, group: Any = None, layout: str = "contiguous") -> Shards:
        """The shards of ``group`` (None: the default group); RuntimeError when torch.distributed
        is not initialised."""
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {list(LAYOUTS)}, got {layout!r}")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("subquad.distributed needs torch.distributed initialised first "
                               "(torch.distributed.init_process_group, as torchrun sets it up)")
        return cls(group, dist.get_rank(group), dist.get_world_size(group), layout)

    def need_contiguous(self, causal: bool, method: str) -> None:
        """NotImplementedError for a causal form that knows only the contiguous layout (the
        layout changes nothing without a causal mask: a rank's rows are its queries either way)."""
        if causal and self.layout != "contiguous":
            raise NotImplementedError(f"{method}: causal context parallelism runs on the contiguous layout only "
                                      f"(layout={self.layout!r} balances ring attention's work: softmax)")

    def split(self, x: Tensor, dim: int) -> Tensor:
        """This rank's positions of the whole ``x`` along ``dim`` in this layout (``tensor_split``
        into ``size`` or ``2 size`` parts: the first parts hold one position more)."""
        if self.layout == "contiguous":
            return x.tensor_split(self.size, dim)[self.rank]
        parts = x.tensor_split(2 * self.size, dim)
        return torch.cat([parts[self.rank], parts[2 * self.size - 1 - self.rank]], dim)

    def global_rank(self, rank: int) -> int:
        """The default group's rank of this group's ``rank``."""
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def gather(self, x: Tensor) -> Tensor:
        """``(size, *x.shape)``: every rank's ``x`` (of one shape on all ranks), differentiable."""
        return _Gather.apply(x, self)

    def max(self, x: Tensor) -> Tensor:
        """The elementwise maximum of ``x`` over the ranks (no gradient)."""
        x = x.detach().clone()
        _count(x)
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.group)
        return x

    def broadcast(self, x: Tensor) -> Tensor:
        """Rank 0's ``x`` on every rank (a copy; no gradient)."""
        x = x.detach().contiguous().clone()
        _count(x)
        dist.broadcast(x, src=self.global_rank(0), group=self.group)
        return x

    def gather_ints(self, values: list[int], device: torch.device) -> list[list[int]]:
        """Every rank's ``values`` (as many on every rank; a shard's length, a flag), in rank order."""
        out = torch.empty(self.size * len(values), dtype=torch.int64, device=device)
        _count(out)
        dist.all_gather_single(out, torch.tensor(values, dtype=torch.int64, device=device), group=self.group)
        return out.view(self.size, len(values)).tolist()

    def exchange(self, send: list[Tensor], to: int, recv: list[Tensor], source: int) -> list[Any]:
        """Start sending ``send`` to rank ``to`` and receiving ``recv`` from rank ``source`` (every
        rank calls it, so each send meets its receive); returns the requests to ``wait()`` on
        before ``recv`` is read or ``send`` changed."""
        ops = [dist.P2POp(dist.isend, t, self.global_rank(to), self.group) for t in send]
        ops += [dist.P2POp(dist.irecv, t, self.global_rank(source), self.group) for t in recv]
        _count(*send)
        return dist.batch_isend_irecv(ops)


class _Gather(torch.autograd.Function):
    """All-gather with a backward: rank ``r``'s gradient is the sum over ranks of the gradient of
    slice ``r`` (one all-reduce of the stacked gradient: the tensors gathered here are small
    states, and all-reduce is in every backend, where reduce-scatter is not in gloo)."""

    @staticmethod
    def forward(ctx, x: Tensor, shards: Shards) -> Tensor:
        ctx.shards = shards
        out = x.new_empty(shards.size * x.shape[0], *x.shape[1:]) if x.ndim else x.new_empty(shards.size)
        _count(out)
        dist.all_gather_single(out, x.contiguous(), group=shards.group)
        return out.view(shards.size, *x.shape)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous().clone()
        _count(grad)
        dist.all_reduce(grad, group=ctx.shards.group)
        return grad[ctx.shards.rank], None
