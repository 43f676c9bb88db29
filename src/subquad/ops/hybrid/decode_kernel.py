"""One decoding step of :class:`~.decode.HybridDecodeState` on CPU as a compiled kernel (numba).

The torch path (``decode.py``) spends a decoding step in ~150 small tensor operations of a few
microseconds each, about as long as exact attention over 32k cached keys; the work itself (a
descent over a few hundred runs of leaves, 128 candidate leaves, a softmax over ~70 terms per
head) is tens of microseconds. This kernel does the same steps per head in one compiled call:
the same window, the same descent (runs of leaves by position, the Gaussian log-sum-exp
estimate), the same exact leaf selection and the same summaries, so its output equals the torch
path's to rounding (ties between equal scores may be broken differently). Heads are spread over
numba's threads (as many as torch's). Compiled on first use and cached on disk.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .kernel import _FAST

__all__ = ["decode_step"]


@njit(cache=True, fastmath=_FAST)
def _load_bound(ps, pyramid, offset, size, h, b, first, leaves, out):
    """Copy into ``out`` ``(2 D,)`` the key part of the prefix row at leaf ``b``: from the pyramid
    level of run length ``size`` (``offset``: its first row) when ``b`` is one of its multiples,
    else from ``ps`` (indices, not views: a view costs a reference count per run)."""
    if b != first and b != leaves and b % size == 0:
        r = offset + b // size
        for d in range(out.shape[0]):
            out[d] = pyramid[h, r, d]
    else:
        for d in range(out.shape[0]):
            out[d] = ps[h, b, d]


@njit(cache=True, fastmath=_FAST)
def _run_score(lo, hi, n, q, scale):
    """Estimated log-sum-exp of the logits over a run of ``n`` keys whose prefix rows at its ends
    are ``lo`` and ``hi`` (see decode.run_scores)."""
    D = q.shape[0]
    if n <= 0:
        return -np.inf
    mean_logit = second = square = q[0] * 0  # in the inputs' dtype (float32 sums vectorise)
    for d in range(D):
        w = (hi[d] - lo[d]) * q[d]
        mean_logit += w
        second += (hi[D + d] - lo[D + d]) * q[d] * q[d]
        square += w * w
    spread = max(second / n - square / (n * n), 0.0)
    return scale * mean_logit / n + 0.5 * scale * scale * spread + math.log(n)


@njit(cache=True, fastmath=_FAST)
def _top(scores, k):
    """Indices of the k largest scores (k <= len), in no particular order."""
    return np.argsort(-scores)[:k]


@njit(cache=True, fastmath=_FAST)
def _candidates(ps, pyramid, offsets, h, q, first, leaves, candidates, beam, fanout, bs, scale):
    """The candidate leaves of head h in [first, leaves) (-1: none), as decode.candidate_leaves."""
    if leaves - first <= candidates:
        return np.arange(first, leaves)
    base = candidates // beam
    level = 0
    while (leaves + base * fanout**level - 1) // (base * fanout**level) - first // (base * fanout**level) > \
            fanout * beam:
        level += 1
    size = base * fanout**level
    starts = np.arange(first // size * size, leaves, size)
    lo, hi = np.empty(2 * q.shape[0], dtype=ps.dtype), np.empty(2 * q.shape[0], dtype=ps.dtype)
    while True:
        scores = np.empty(starts.shape[0])
        for i in range(starts.shape[0]):
            a, e = min(max(starts[i], first), leaves), min(max(starts[i] + size, first), leaves)
            _load_bound(ps, pyramid, offsets[level], size, h, a, first, leaves, lo)
            _load_bound(ps, pyramid, offsets[level], size, h, e, first, leaves, hi)
            scores[i] = _run_score(lo, hi, (e - a) * bs, q, scale)
        keep = starts[_top(scores, min(beam, starts.shape[0]))]
        if level == 0:
            break
        level -= 1
        size //= fanout
        starts = np.empty(keep.shape[0] * fanout, dtype=np.int64)
        for i in range(keep.shape[0]):
            for c in range(fanout):
                starts[i * fanout + c] = keep[i] + c * size
    out = np.empty(keep.shape[0] * base, dtype=np.int64)
    for i in range(keep.shape[0]):
        for j in range(base):
            leaf = keep[i] + j
            out[i * base + j] = leaf if first <= leaf < leaves else -1
    return out


@njit(cache=True, fastmath=_FAST)
def _logit(k, h, t, q, scale):
    acc = q[0] * 0
    for d in range(q.shape[0]):
        acc += q[d] * k[h, t, d]
    return scale * acc


@njit(cache=True, fastmath=_FAST)
def _selected(k, ps, pyramid, offsets, h, q, L, bs, scale, sinks, candidates, beam, num_selected, fanout):
    """The selected leaves of head h among the L leaves before its window: the sinks and the
    descent's candidates, scored exactly by the log-sum-exp of their keys' logits."""
    s = min(sinks, L)
    found = _candidates(ps, pyramid, offsets, h, q, s, L, candidates, beam, fanout, bs, scale)
    cand = np.concatenate((np.arange(s), found))
    lse = np.full(cand.shape[0], -np.inf)
    lg = np.empty(bs)
    for i in range(cand.shape[0]):
        if cand[i] >= 0:
            for j in range(bs):
                lg[j] = _logit(k, h, cand[i] * bs + j, q, scale)
            m = lg.max()
            lse[i] = m + math.log(np.exp(lg - m).sum())
    top = _top(lse, min(num_selected, cand.shape[0]))
    return cand[top[lse[top] > -np.inf]]


@njit(cache=True, fastmath=_FAST)
def _summary(ps, h, q, a, e, sel, bs, scale, values, j):
    """Term j: leaves [a, e) without the selected ones, as one logit (returned) and mean value."""
    D, Dv = q.shape[0], values.shape[1]
    n = (e - a) * bs
    acc = 0.0
    for d in range(D):
        acc += q[d] * (ps[h, e, d] - ps[h, a, d])
    for c in range(Dv):
        values[j, c] = ps[h, e, 2 * D + c] - ps[h, a, 2 * D + c]
    for leaf in sel:  # the selected keys leave their run's summary
        if a <= leaf < e:
            for d in range(D):
                acc -= q[d] * (ps[h, leaf + 1, d] - ps[h, leaf, d])
            for c in range(Dv):
                values[j, c] -= ps[h, leaf + 1, 2 * D + c] - ps[h, leaf, 2 * D + c]
            n -= bs
    if n <= 0:
        values[j] = 0.0
        return -np.inf
    for c in range(Dv):
        values[j, c] /= n
    return scale * acc / n + math.log(n)


@njit(cache=True, fastmath=_FAST)
def _head(k, v, ps, pyramid, offsets, h, q, T, bs, scale, window, sinks, candidates, beam, num_selected,
          num_summaries, fanout, out):
    """Head h's output row: softmax over its window keys, selected keys and summaries."""
    w0 = max(0, T - window) // bs * bs
    L = w0 // bs
    G = min(num_summaries, L)
    sel = np.empty(0, dtype=np.int64)
    if L > 0:
        sel = _selected(k, ps, pyramid, offsets, h, q, L, bs, scale, sinks, candidates, beam, num_selected, fanout)
    keys = np.empty(T - w0 + sel.shape[0] * bs, dtype=np.int64)
    keys[: T - w0] = np.arange(w0, T)
    for i in range(sel.shape[0]):
        keys[T - w0 + i * bs: T - w0 + (i + 1) * bs] = np.arange(sel[i] * bs, (sel[i] + 1) * bs)
    logits = np.empty(keys.shape[0] + G)
    values = np.empty((keys.shape[0] + G, v.shape[2]))
    for j in range(keys.shape[0]):
        logits[j] = _logit(k, h, keys[j], q, scale)
        for c in range(v.shape[2]):
            values[j, c] = v[h, keys[j], c]
    for g in range(G):
        j = keys.shape[0] + g
        logits[j] = _summary(ps, h, q, g * L // G, (g + 1) * L // G, sel, bs, scale, values, j)
    w = np.exp(logits - logits.max())
    w /= w.sum()
    for c in range(v.shape[2]):
        acc = 0.0
        for i in range(w.shape[0]):
            acc += w[i] * values[i, c]
        out[h, c] = acc


@njit(cache=True, fastmath=_FAST, parallel=True)
def decode_step(k, v, ps, pyramid, offsets, q, T, bs, scale, window, sinks, candidates, beam, num_selected,
                num_summaries, fanout):
    """The output ``(H, Dv)`` of query q ``(H, D)`` at position ``T - 1`` over keys ``k[:, :T]``
    ``(H, cap, D)``, values ``v``, leaf prefix sums ``ps`` and their ``pyramid`` with level
    ``offsets`` (see :class:`.decode._Row`)."""
    out = np.empty((q.shape[0], v.shape[2]), dtype=v.dtype)
    for h in prange(q.shape[0]):
        _head(k, v, ps, pyramid, offsets, h, q[h], T, bs, scale, window, sinks, candidates, beam, num_selected,
              num_summaries, fanout, out)
    return out
