"""Endless, resumable streams of training batches, sharded over processes.

:class:`ShardedBatchSampler` draws batches uniformly (every batch padded to one length);
:class:`BucketBatchSampler` groups samples of similar length so that each batch can be padded
to its own longest sample.

For :class:`ShardedBatchSampler`, epoch ``e`` is
``torch.utils.data.DistributedSampler(shuffle=True, seed=seed, drop_last=True)`` after
``set_epoch(e)``: one permutation of the data set seeded by ``seed + e``, of which process
``rank`` takes every ``world_size``-th index. Consecutive runs of ``batch_size`` of those indices
are the batches (an incomplete last batch is dropped). So with the same seed, batch ``j`` of a
single process with batch ``world_size * b`` holds exactly the samples of batch ``j`` of all
``world_size`` processes with batch ``b``.

The position (epoch, batch) is the whole state: :meth:`state_dict` / :meth:`load_state_dict`.
"""

from __future__ import annotations

import numpy as np
from torch.utils.data import DistributedSampler

__all__ = ["ShardedBatchSampler", "BucketBatchSampler"]


class _Sized:
    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n


class _EpochStream:
    """An endless stream of batches, epoch after epoch, whose position (epoch, batch) is its whole
    state. A subclass sets ``batches_per_epoch`` and returns batch ``b`` of the current epoch from
    :meth:`_batch`, caching per-epoch work in ``self._epoch_cache`` (cleared at each new epoch)."""

    batches_per_epoch: int

    def __init__(self):
        self.epoch = 0
        self.batch = 0
        self._epoch_cache = None

    def _batch(self, b: int) -> list[int]:
        raise NotImplementedError

    def __iter__(self):
        return self

    def __next__(self) -> list[int]:
        if self.batch >= self.batches_per_epoch:
            self.epoch += 1
            self.batch = 0
            self._epoch_cache = None
        out = self._batch(self.batch)
        self.batch += 1
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch": self.batch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch = int(state["epoch"])
        self.batch = int(state["batch"])
        self._epoch_cache = None


class ShardedBatchSampler(_EpochStream):
    """``next(sampler)`` -> list of ``batch_size`` indices for this process."""

    def __init__(self, num_samples: int, batch_size: int, *, world_size: int = 1, rank: int = 0,
                 seed: int = 0):
        if num_samples < world_size * batch_size:
            raise ValueError(
                f"the training set has {num_samples} samples, fewer than one global batch "
                f"({world_size} x {batch_size})"
            )
        super().__init__()
        self.batch_size = batch_size
        self.sampler = DistributedSampler(_Sized(num_samples), num_replicas=world_size, rank=rank,
                                          shuffle=True, seed=seed, drop_last=True)
        self.batches_per_epoch = len(self.sampler) // batch_size

    def _batch(self, b: int) -> list[int]:
        if self._epoch_cache is None:
            self.sampler.set_epoch(self.epoch)
            self._epoch_cache = list(iter(self.sampler))
        return self._epoch_cache[b * self.batch_size:(b + 1) * self.batch_size]



class BucketBatchSampler(_EpochStream):
    """``next(sampler)`` -> list of ``batch_size`` indices of samples of similar length.

    Epoch ``e`` draws one permutation of the data set from ``numpy.random.default_rng([seed, e])``
    and drops the tail that does not fill a global batch (``world_size * batch_size``). The
    permutation is cut into pools of ``pool_batches`` global batches; each pool is sorted by
    length (capped at ``cap``, stable) and cut into global batches, and the order of all
    batches of the epoch is shuffled. Every sample appears at most once per epoch, and a batch
    holds samples of nearly equal length, so padding each batch to its own longest sample
    wastes little. Process ``rank`` takes every ``world_size``-th index of each global batch,
    so batch ``j`` of one process with batch ``world_size * b`` holds exactly the samples of
    batch ``j`` of all processes with batch ``b``.

    The position (epoch, batch) is the whole state, as for :class:`ShardedBatchSampler`.
    """

    def __init__(self, lengths, batch_size: int, *, world_size: int = 1, rank: int = 0, seed: int = 0,
                 pool_batches: int = 64, cap: int | None = None):
        lengths = np.asarray(lengths, dtype=np.int64)
        if lengths.ndim != 1:
            raise ValueError(f"lengths must be 1-D, got shape {lengths.shape}")
        for name, value in (("batch_size", batch_size), ("world_size", world_size),
                            ("pool_batches", pool_batches)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")
        global_batch = world_size * batch_size
        if len(lengths) < global_batch:
            raise ValueError(f"the training set has {len(lengths)} samples, fewer than one global batch "
                             f"({world_size} x {batch_size})")
        super().__init__()
        self.lengths = lengths if cap is None else np.minimum(lengths, cap)
        self.batch_size, self.world_size, self.rank = batch_size, world_size, rank
        self.seed, self.pool_batches = seed, pool_batches
        self.batches_per_epoch = len(lengths) // global_batch

    def epoch_batches(self, epoch: int) -> np.ndarray:
        """``(batches_per_epoch, world_size * batch_size)``: the global batches of ``epoch``."""
        rng = np.random.default_rng([self.seed, epoch])
        global_batch = self.world_size * self.batch_size
        order = rng.permutation(len(self.lengths))[: self.batches_per_epoch * global_batch]
        pool = self.pool_batches * global_batch
        pools = [p[np.argsort(self.lengths[p], kind="stable")]
                 for p in np.split(order, range(pool, len(order), pool))]
        batches = np.concatenate(pools).reshape(self.batches_per_epoch, global_batch)
        return batches[rng.permutation(self.batches_per_epoch)]

    def _batch(self, b: int) -> list[int]:
        if self._epoch_cache is None:
            self._epoch_cache = self.epoch_batches(self.epoch)
        return self._epoch_cache[b, self.rank::self.world_size].tolist()
