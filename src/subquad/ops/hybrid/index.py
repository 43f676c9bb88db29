"""hybrid's key index: the key tree (leaves of ``block_size`` slots, split by position or by
similarity) and the summary of every node the descent scores (count, mean key, principal part).

Levels ``0 .. depth``; level ``l`` has ``2**l`` nodes, each a contiguous run of ``slots >> l``
slots. A node at a level at or below ``chunk_level`` is split at the median of its keys'
projections on their top principal direction (power iteration from the key farthest from the
mean); above it, by position (its slots are key ranks). Causal calls split by similarity only
inside sealed chunks of ``chunk_size`` keys, so no node mixes a chunk's keys with later ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from .._common import modes_active
from .options import HybridPlan

__all__ = ["KeyIndex", "build_index", "rows", "flat_rows", "numpy_path", "largest", "halves", "node_stats"]


def rows(x: Tensor, idx: Tensor, out: Tensor | None = None) -> Tensor:
    """Rows of ``x`` ``(B, H, M, D)`` picked per head by ``idx`` ``(B, H, *shape)`` (values in
    ``[0, M)``): ``(B, H, *shape, D)``, written into ``out`` when given (no autograd). Copies
    whole rows (``index_select``), many times faster than an elementwise ``gather`` with an
    expanded index."""
    B, H, M, D = x.shape
    flat = flat_rows(x, idx)
    if out is None:
        return x.reshape(B * H * M, D).index_select(0, flat).view(*idx.shape, D)
    return torch.index_select(x.reshape(B * H * M, D), 0, flat, out=out.view(-1, D)).view(*idx.shape, D)


def flat_rows(x: Tensor, idx: Tensor) -> Tensor:
    """Per-head row indices ``idx`` ``(B, H, *shape)`` into ``x`` ``(B, H, M, D)`` as one vector of
    rows of ``x`` viewed ``(B H M, D)``."""
    B, H, M = x.shape[:3]
    return (idx + (torch.arange(B * H, device=x.device) * M).view(B, H, *([1] * (idx.dim() - 2)))).flatten()


def numpy_path(x: Tensor) -> bool:
    """Whether a selection step on ``x`` may run in numpy: a float32/float64 CPU tensor without
    autograd, outside ``torch.compile`` and outside dispatch and function modes (which numpy would
    bypass)."""
    return (x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and not x.requires_grad
            and not torch.compiler.is_compiling() and not modes_active())


def largest(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The ``k`` largest entries of each row of ``x`` (last dimension) and their indices, in no
    particular order. On CPU numpy's ``argpartition`` (a selection, no sort): 5 ms against 17 ms
    for ``torch.topk`` on 16384 rows of 128, one thread, torch 2.13."""
    n = x.shape[-1]
    if k == 0 or k >= n or not numpy_path(x):
        return x.topk(min(k, n), dim=-1, sorted=False)
    idx = torch.from_numpy(np.ascontiguousarray(np.argpartition(x.contiguous().numpy(), n - k, axis=-1)[..., n - k:]))
    return x.gather(-1, idx), idx


def halves(proj: Tensor) -> Tensor:
    """A permutation of each row of ``proj`` (last dimension, even length ``m``) whose first
    ``m / 2`` entries index its ``m / 2`` smallest values: a median split. On CPU numpy's
    ``argpartition`` (linear time; the order within each half is arbitrary), elsewhere a stable
    sort."""
    m = proj.shape[-1]
    if not numpy_path(proj):
        return proj.argsort(dim=-1, stable=True)
    return torch.from_numpy(np.argpartition(proj.contiguous().numpy(), m // 2 - 1, axis=-1))


def node_stats(x: Tensor, valid: Tensor, iterations: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Summary of each node of keys ``x`` ``(..., n, D)`` (``valid`` ``(..., n)``): key count
    ``(...)``, mean ``(..., D)``, the top principal direction ``u`` of the centred valid keys
    (unit; power iteration from the key farthest from the mean) ``(..., D)``, the largest and the
    smallest projection on it ``(..., 2)``, and the projections ``(..., n)``, +inf at invalid
    keys. The deviations are never formed: ``(x - mean) u = x u - mean . u``."""
    w = valid.to(x.dtype)
    count = w.sum(-1)
    mean = (w.unsqueeze(-2) @ x) / count.clamp_min(1)[..., None, None]  # (..., 1, D)

    # products with x as row vector times x^T: (1, D) @ (D, n) runs several times faster on CPU
    # than (n, D) @ (D, 1)
    def centred(u):  # (x_j - mean) . u, zero at invalid rows
        return ((u.unsqueeze(-2) @ x.mT).squeeze(-2) - (mean @ u.unsqueeze(-1)).squeeze(-1)) * w

    dist = (torch.linalg.vector_norm(x, dim=-1).square() - 2 * (mean @ x.mT).squeeze(-2)
            + mean.square().sum(-1)) * w
    far = dist.argmax(-1, keepdim=True)
    u = (x.gather(-2, far.unsqueeze(-1).expand(*far.shape, x.shape[-1])) - mean).squeeze(-2)
    for _ in range(iterations):
        xu = centred(u)
        u = (xu.unsqueeze(-2) @ x).squeeze(-2) - mean.squeeze(-2) * xu.sum(-1, keepdim=True)
        u = u / u.norm(dim=-1, keepdim=True).clamp_min(1e-30)
    proj = centred(u)  # zero at invalid keys, so the ends are >= 0 and <= 0
    ends = torch.stack([proj.amax(-1), proj.amin(-1)], -1)
    return count, mean.squeeze(-2), u, ends, proj.masked_fill(~valid, math.inf)


@dataclass
class KeyIndex:
    """The tree of one call's keys. ``order`` ``(B, H, S)``: the key rank in each slot (``>= M``:
    an empty slot); ``slot_valid`` ``(B, H, S)``; ``count``, ``mean``, ``direction``, ``ends``:
    the node summaries (:func:`node_stats`) in heap layout (node ``j`` of level ``l`` at
    ``2**l + j``; filled for the levels the descent scores, ``start_level + 1 .. final_level``),
    ``(B, H, 2**(final_level + 1))`` and ``(B, H, 2**(final_level + 1), D)``."""

    order: Tensor
    slot_valid: Tensor
    count: Tensor
    mean: Tensor
    direction: Tensor
    ends: Tensor


def build_index(k: Tensor, p: HybridPlan) -> KeyIndex:
    """The key tree of keys ``k`` ``(B, H, M, D)`` (every one real, in rank order) for plan ``p``:
    level by level, each node's summary when the descent scores its level, and its split, by
    the median of its keys' principal projections (:func:`halves`; empty slots count as +inf,
    so they go to the upper half) at levels from ``p.chunk_level``, else by position."""
    B, H, M, D = k.shape
    S = p.slots
    order = torch.arange(S, device=k.device).expand(B, H, S).contiguous()
    slot_valid = (order < M).contiguous()
    heap = 1 << (p.final_level + 1)
    count, ends = k.new_zeros(B, H, heap), k.new_zeros(B, H, heap, 2)
    mean, direction = k.new_zeros(B, H, heap, D), k.new_zeros(B, H, heap, D)
    x = F.pad(k, (0, 0, 0, S - M))  # keys in slot order, kept in step with ``order``
    for level in range(p.depth + 1):
        scored = p.start_level < level <= p.final_level
        split = p.chunk_level <= level < p.depth
        if not (scored or split):
            continue
        nodes = 1 << level
        sv = slot_valid.view(B, H, nodes, S // nodes)
        c, m, u, e, proj = node_stats(x.view(B, H, nodes, S // nodes, D), sv, p.tree_iterations)
        if scored:
            at = slice(nodes, 2 * nodes)
            count[:, :, at], mean[:, :, at], direction[:, :, at], ends[:, :, at] = c, m, u, e
        if split:
            rank = halves(proj)
            order = order.view(B, H, nodes, -1).gather(-1, rank).view(B, H, S)
            slot_valid = sv.gather(-1, rank).view(B, H, S)
            # rows move within their node only: a local gather, cache-friendly at the deep levels
            x = rows(x, (rank + torch.arange(0, S, S // nodes, device=k.device)[:, None]).view(B, H, S))
    return KeyIndex(order, slot_valid, count, mean, direction, ends)
