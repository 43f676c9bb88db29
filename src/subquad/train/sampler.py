"""An endless, resumable stream of training batches, sharded over processes.

Epoch ``e`` is ``torch.utils.data.DistributedSampler(shuffle=True, seed=seed, drop_last=True)``
after ``set_epoch(e)``: one permutation of the data set seeded by ``seed + e``, of which process
``rank`` takes every ``world_size``-th index. Consecutive runs of ``batch_size`` of those indices
are the batches (an incomplete last batch is dropped). So with the same seed, batch ``j`` of a
single process with batch ``world_size * b`` holds exactly the samples of batch ``j`` of all
``world_size`` processes with batch ``b``.

The position (epoch, batch) is the whole state: :meth:`state_dict` / :meth:`load_state_dict`.
"""

from __future__ import annotations

from torch.utils.data import DistributedSampler

__all__ = ["ShardedBatchSampler"]


class _Sized:
    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n


class ShardedBatchSampler:
    """``next(sampler)`` -> list of ``batch_size`` indices for this process."""

    def __init__(self, num_samples: int, batch_size: int, *, world_size: int = 1, rank: int = 0,
                 seed: int = 0):
        if num_samples < world_size * batch_size:
            raise ValueError(
                f"the training set has {num_samples} samples, fewer than one global batch "
                f"({world_size} x {batch_size})"
            )
        self.batch_size = batch_size
        self.sampler = DistributedSampler(_Sized(num_samples), num_replicas=world_size, rank=rank,
                                          shuffle=True, seed=seed, drop_last=True)
        self.batches_per_epoch = len(self.sampler) // batch_size
        self.epoch = 0
        self.batch = 0
        self._indices: list[int] | None = None

    def _epoch_indices(self) -> list[int]:
        if self._indices is None:
            self.sampler.set_epoch(self.epoch)
            self._indices = list(iter(self.sampler))
        return self._indices

    def __iter__(self):
        return self

    def __next__(self) -> list[int]:
        if self.batch >= self.batches_per_epoch:
            self.epoch += 1
            self.batch = 0
            self._indices = None
        start = self.batch * self.batch_size
        out = self._epoch_indices()[start:start + self.batch_size]
        self.batch += 1
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch": self.batch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch = int(state["epoch"])
        self.batch = int(state["batch"])
        self._indices = None

