"""hybrid's key index on CPU as compiled code (numba): the tree of :func:`.index.build_index`
(same splits, same node summaries, to rounding), built level by level with the nodes of all
heads spread over threads (:func:`parallel`), each node's keys moved once per level so that every
pass over a node reads contiguous rows. Used by :mod:`.kernel`; no autograd."""

from __future__ import annotations

import functools
import itertools
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from numba import njit

from .index import KeyIndex
from .options import HybridPlan

__all__ = ["build_index_compiled", "parallel", "reused"]

_FAST = {"nsz", "arcp", "contract", "afn", "reassoc"}


@njit(fastmath=_FAST, cache=True, inline="always")
def _centred(x, w, mean, u, out):
    """``out[j] = ((x_j - mean) . u) w_j`` for the rows of ``x``."""
    zero = x.dtype.type(0)
    mu = zero
    for d in range(x.shape[1]):
        mu += mean[d] * u[d]
    for j in range(x.shape[0]):
        acc = zero
        for d in range(x.shape[1]):
            acc += x[j, d] * u[d]
        out[j] = (acc - mu) * w[j]


@njit(fastmath=_FAST, cache=True)
def _node_stats(x, w, iterations, mean, u, acc, proj):
    """Summary of one node (:func:`.index.node_stats`): rows ``x`` ``(m, D)``, validity ``w``
    (1/0). Writes the mean, the unit principal direction ``u`` (power iteration from the key
    farthest from the mean) and the projections ``proj`` (0 at invalid rows); returns the count.
    ``acc``: scratch of ``D``."""
    m, D = x.shape
    zero = x.dtype.type(0)
    count = 0.0
    mean[:] = 0.0
    for j in range(m):
        if w[j] > 0:
            count += 1.0
            for d in range(D):
                mean[d] += x[j, d]
    for d in range(D):
        mean[d] /= max(count, 1.0)
    far, best = 0, -1.0
    for j in range(m):
        dist = zero
        for d in range(D):
            dist += (x[j, d] - mean[d]) ** 2
        dist *= w[j]
        if dist > best:
            far, best = j, dist
    for d in range(D):
        u[d] = x[far, d] - mean[d]
    for _ in range(iterations):  # u <- sum_j ((x_j - mean) . u) w_j (x_j - mean), one pass over the rows
        mu = zero
        for d in range(D):
            mu += mean[d] * u[d]
        acc[:] = 0.0
        total = zero
        for j in range(m):
            pj = zero
            for d in range(D):
                pj += x[j, d] * u[d]
            pj = (pj - mu) * w[j]
            total += pj
            for d in range(D):
                acc[d] += pj * x[j, d]
        norm = 0.0
        for d in range(D):
            u[d] = acc[d] - mean[d] * total
            norm += u[d] * u[d]
        norm = max(math.sqrt(norm), 1e-30)
        for d in range(D):
            u[d] /= norm
    _centred(x, w, mean, u, proj)
    return count


@njit(cache=True)
def _select_half(val, idx, m):
    """Reorder ``idx[:m]`` (with ``val``, its keys) so that its first ``m / 2`` entries are the
    ones with the ``m / 2`` smallest values (quickselect; the order within each half arbitrary)."""
    lo, hi, k = 0, m - 1, m // 2 - 1
    while lo < hi:
        pivot = val[(lo + hi) // 2]
        i, j = lo, hi
        while i <= j:
            while val[i] < pivot:
                i += 1
            while val[j] > pivot:
                j -= 1
            if i <= j:
                val[i], val[j] = val[j], val[i]
                idx[i], idx[j] = idx[j], idx[i]
                i += 1
                j -= 1
        if k <= j:
            hi = j
        elif k >= i:
            lo = i
        else:
            break


@njit(fastmath=_FAST, cache=True, nogil=True)
def _level(level, per_task, scored, split, iterations, x, valid, order, xn, vn, on, count, mean, direction, ends,
           proj, idx, first, last):
    """Tasks ``[first, last)`` of one level of every head's tree, ``per_task`` nodes each. A node
    (slots ``[a, a + m)`` of head ``h``, heap id ``hp``): its summary (into the heap when
    ``scored``) and, when ``split``, its keys reordered into ``xn``/``vn``/``on`` with the half of
    smaller projections first (empty slots project to +inf). One function with its loop: numba
    re-optimises a callee's code inside its caller."""
    BH, S, D = x.shape
    nodes = 1 << level
    m = S // nodes
    tasks = nodes // per_task
    mu, u, acc = np.empty(D, x.dtype), np.empty(D, x.dtype), np.empty(D, x.dtype)
    for t in range(first, last):
        h, first_node = t // tasks, (t % tasks) * per_task
        for nd in range(first_node, first_node + per_task):
            a, hp = nd * m, nodes + nd
            xs, ws, pr = x[h, a: a + m], valid[h, a: a + m], proj[h, a: a + m]
            c = _node_stats(xs, ws, iterations, mu, u, acc, pr)
            if scored:
                count[h, hp] = c
                for d in range(D):  # a loop, not a row copy: that compiles numba's shape-error message (5 s)
                    mean[h, hp, d], direction[h, hp, d] = mu[d], u[d]
                top, bottom = pr[0], pr[0]
                for j in range(1, m):  # a loop: numpy's max and min compile for a second (0.9 s)
                    top, bottom = max(top, pr[j]), min(bottom, pr[j])
                ends[h, hp, 0], ends[h, hp, 1] = top, bottom
            if split:
                ix = idx[h, a: a + m]
                for j in range(m):
                    ix[j] = j
                    if ws[j] == 0:
                        pr[j] = np.inf
                _select_half(pr, ix, m)
                for j in range(m):
                    src = a + ix[j]
                    for d in range(D):
                        xn[h, a + j, d] = x[h, src, d]
                    vn[h, a + j] = valid[h, src]
                    on[h, a + j] = order[h, src]


_local = threading.local()
# arrays up to this size are kept for the thread's next call: fresh memory costs page faults, and
# taken by the kernel's threads at once they cost more than the work (measured: the first level of
# 8 heads x 16384 keys, 62 ms in fresh arrays, 9 ms in reused ones)
REUSE_BYTES = 1 << 26


_pool: dict[tuple[int, int], ThreadPoolExecutor] = {}  # by (process, threads): the last one asked for


def parallel(work, total: int, threads: int) -> None:
    """``work(first, last)`` over ``[0, total)`` in chunks on ``threads`` threads (this one and a
    shared pool's), each taking the next chunk as it frees up: a thread the OS deschedules holds
    back only its chunk. ``work`` runs compiled code that releases the GIL (``nogil=True``). Python
    threads rather than numba's ``prange``: a parallel function's compile took a quarter of the
    kernel's cold start, and the forward loads no second OpenMP runtime beside torch's."""
    threads = max(1, min(threads, total))
    if threads == 1:
        work(0, total)
        return
    chunk = max(1, total // (8 * threads))
    counter = itertools.count()

    def loop():
        while (first := next(counter) * chunk) < total:
            work(first, min(first + chunk, total))

    key = (os.getpid(), threads - 1)  # a forked child has none of its parent's pool threads
    if key not in _pool:
        for (pid, _), old in _pool.items():
            if pid == key[0]:
                old.shutdown(wait=False)
        _pool.clear()
        _pool[key] = ThreadPoolExecutor(threads - 1, thread_name_prefix="subquad")
    futures = [_pool[key].submit(loop) for _ in range(threads - 1)]
    try:
        loop()
    finally:
        for f in futures:
            f.result()


def reused(name: str, shape: tuple[int, ...], dtype) -> np.ndarray:
    """An uninitialised array for this thread, the same memory as the last call's ``name`` when
    the shape and dtype match (arrays of at most ``REUSE_BYTES``)."""
    store = _local.__dict__.setdefault("arrays", {})
    a = store.get(name)
    if a is None or a.shape != shape or a.dtype != dtype:
        a = np.empty(shape, dtype)
        if a.nbytes <= REUSE_BYTES:
            store[name] = a
    return a


def build_index_compiled(k: torch.Tensor, p: HybridPlan) -> tuple[KeyIndex, torch.Tensor]:
    """:func:`.index.build_index` of keys ``k`` ``(B, H, M, D)`` (float32/float64, CPU), and the
    keys in slot order ``(B, H, S, D)`` (zero at empty slots). The slot order, validity and keys
    live in :func:`reused` arrays: valid until this thread's next call."""
    B, H, M, D = k.shape
    BH, S = B * H, p.slots
    dt = k.numpy().dtype
    x, xn = reused("x", (BH, S, D), dt), reused("xn", (BH, S, D), dt)
    x[:, :M] = k.reshape(BH, M, D).numpy()
    x[:, M:] = 0
    order, on = reused("order", (BH, S), np.int64), reused("on", (BH, S), np.int64)
    order[:] = np.arange(S)
    valid, vn = reused("valid", (BH, S), dt), reused("vn", (BH, S), dt)
    valid[:] = order < M
    heap = 1 << (p.final_level + 1)
    count, ends = np.zeros((BH, heap), dt), np.zeros((BH, heap, 2), dt)
    mean, direction = np.zeros((BH, heap, D), dt), np.zeros((BH, heap, D), dt)
    proj, idx = reused("proj", (BH, S), dt), reused("idx", (BH, S), np.int64)
    for level in range(p.depth + 1):
        scored = p.start_level < level <= p.final_level
        split = p.chunk_level <= level < p.depth
        if scored or split:
            nodes = 1 << level
            per_task = max(1, min(nodes, 1024 // (S // nodes)))  # tasks of at least 1024 slots
            parallel(functools.partial(_level, level, per_task, scored, split, p.tree_iterations, x, valid, order,
                                       xn, vn, on, count, mean, direction, ends, proj, idx),
                     BH * nodes // per_task, torch.get_num_threads())
        if split:
            x, xn, valid, vn, order, on = xn, x, vn, valid, on, order

    def t(a):
        return torch.from_numpy(a).view(B, H, *a.shape[1:])

    index = KeyIndex(t(order), t(valid > 0), t(count), t(mean), t(direction), t(ends))
    return index, t(x)
