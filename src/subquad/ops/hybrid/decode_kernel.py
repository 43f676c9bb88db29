"""One decoding step of :class:`~.decode.HybridDecodeState` on CPU as a compiled kernel (numba).

The torch path (``decode.py``) spends a decoding step in ~150 small tensor operations of a few
microseconds each, about as long as exact attention over 32k cached keys; the work itself (a
descent over a few hundred runs of leaves, 128 candidate leaves, a softmax over ~70 terms per
head) is tens of microseconds. This kernel does the same steps per head in one compiled call:
the same window, the same descent (runs of leaves by position, the Gaussian log-sum-exp
estimate), the same exact leaf selection and the same summaries, so its output equals the torch
path's to rounding (ties between equal scores may be broken differently). The same call first
appends the new token to the row (key, value, and the prefix and pyramid rows it completes), so
a step is one compiled call; the softmax is one online pass (no scratch rows per term). Heads are
spread over numba's threads (as many as torch's). Compiled on first use and cached on disk.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .kernel import _FAST

__all__ = ["decode_step"]


@njit(cache=True, fastmath=_FAST)
def _bound(offset, size, b, first, leaves):
    """Where the key part of the prefix row at leaf ``b`` is read: ``(True, row)`` in the pyramid
    level of run length ``size`` (``offset``: its first row) when ``b`` is one of its multiples,
    else ``(False, b)`` in ``ps``."""
    if b != first and b != leaves and b % size == 0:
        return True, offset + b // size
    return False, b


@njit(cache=True, fastmath=_FAST, inline="always")
def _run_score(lo, a, hi, e, h, n, q, scale):
    """Estimated log-sum-exp of the logits over a run of ``n`` keys whose prefix rows at its ends
    are ``lo[h, a]`` and ``hi[h, e]`` (each the pyramid or ``ps``: read in place, as a copy per
    run costs about as much as the score; see decode.run_scores). The key and squared-key parts
    are taken as 1-d slices first: indexing the 3-d rows inside the loop kept it scalar (2.6x
    slower, measured)."""
    D = q.shape[0]
    if n <= 0:
        return -np.inf
    lo_k, lo_s, hi_k, hi_s = lo[h, a, :D], lo[h, a, D: 2 * D], hi[h, e, :D], hi[h, e, D: 2 * D]
    mean_logit = second = square = q[0] * 0  # in the inputs' dtype (float32 sums vectorise)
    for d in range(D):
        w = (hi_k[d] - lo_k[d]) * q[d]
        mean_logit += w
        second += (hi_s[d] - lo_s[d]) * q[d] * q[d]
        square += w * w
    spread = max(second / n - square / (n * n), 0.0)
    return scale * mean_logit / n + 0.5 * scale * scale * spread + math.log(n)


@njit(cache=True, fastmath=_FAST)
def _top(scores, k):
    """Indices of the k largest scores (k <= len), in no particular order: a selection around the
    k-th largest (O(len), against a sort's O(len log len)), ties taken first come."""
    n = scores.shape[0]
    out = np.arange(k)  # what stays where nothing compares (NaN scores): still valid indices
    if k == 0 or k == n:
        return out
    kth = np.partition(scores, n - k)[n - k]
    c = 0
    for i in range(n):
        if scores[i] > kth:
            out[c] = i
            c += 1
    for i in range(n):
        if c == k:
            break
        if scores[i] == kth:
            out[c] = i
            c += 1
    return out


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
    while True:
        scores = np.empty(starts.shape[0])
        for i in range(starts.shape[0]):
            a, e = min(max(starts[i], first), leaves), min(max(starts[i] + size, first), leaves)
            in_a, ra = _bound(offsets[level], size, a, first, leaves)
            in_e, re = _bound(offsets[level], size, e, first, leaves)
            scores[i] = _run_score(pyramid if in_a else ps, ra, pyramid if in_e else ps, re, h, (e - a) * bs, q,
                                   scale)
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


@njit(cache=True, fastmath=_FAST, inline="always")
def _logit(k, h, t, q, scale):
    """``scale q . k[h, t]`` (the row as a 1-d slice, as in :func:`_run_score`)."""
    row = k[h, t]
    acc = q[0] * 0
    for d in range(q.shape[0]):
        acc += q[d] * row[d]
    return scale * acc


@njit(cache=True, fastmath=_FAST)
def _leaf_lse(k, h, leaf, bs, q, scale):
    """The log-sum-exp of the logits of leaf ``leaf``'s keys (online: no scratch array)."""
    top, total = -np.inf, 0.0
    for t in range(leaf * bs, (leaf + 1) * bs):
        x = _logit(k, h, t, q, scale)
        if x > top:
            total = total * math.exp(top - x) + 1.0
            top = x
        else:
            total += math.exp(x - top)
    return top + math.log(total)


@njit(cache=True, fastmath=_FAST)
def _selected(k, ps, pyramid, offsets, h, q, L, bs, scale, sinks, candidates, beam, num_selected, fanout):
    """The selected leaves of head h among the L leaves before its window: the sinks and the
    descent's candidates, scored exactly by the log-sum-exp of their keys' logits."""
    s = min(sinks, L)
    found = _candidates(ps, pyramid, offsets, h, q, s, L, candidates, beam, fanout, bs, scale)
    cand = np.concatenate((np.arange(s), found))
    lse = np.full(cand.shape[0], -np.inf)
    for i in range(cand.shape[0]):
        if cand[i] >= 0:
            lse[i] = _leaf_lse(k, h, cand[i], bs, q, scale)
    top = _top(lse, min(num_selected, cand.shape[0]))
    return cand[top[lse[top] > -np.inf]]


@njit(cache=True, fastmath=_FAST)
def _summary(ps, h, q, a, e, sel, bs, scale, value):
    """Leaves [a, e) without the selected ones as one term: its logit (returned) and mean value
    (into ``value`` ``(Dv,)``); -inf when every leaf is selected. Rows as 1-d slices (see
    :func:`_run_score`)."""
    D, Dv = q.shape[0], value.shape[0]
    n = (e - a) * bs
    hi, lo = ps[h, e], ps[h, a]
    acc = _run_dot(hi, lo, q)
    for c in range(Dv):
        value[c] = hi[2 * D + c] - lo[2 * D + c]
    for leaf in sel:  # the selected keys leave their run's summary
        if a <= leaf < e:
            hi, lo = ps[h, leaf + 1], ps[h, leaf]
            acc -= _run_dot(hi, lo, q)
            for c in range(Dv):
                value[c] -= hi[2 * D + c] - lo[2 * D + c]
            n -= bs
    if n <= 0:
        return -np.inf
    for c in range(Dv):
        value[c] /= n
    return scale * acc / n + math.log(n)


@njit(cache=True, fastmath=_FAST, inline="always")
def _run_dot(hi, lo, q):
    """``q . (hi - lo)`` over the key part of two prefix rows."""
    acc = q[0] * 0
    for d in range(q.shape[0]):
        acc += q[d] * (hi[d] - lo[d])
    return acc


@njit(cache=True, fastmath=_FAST, inline="always")
def _add_term(x, value, state, acc):
    """Online softmax: fold the term of logit x and value row ``value`` into the running maximum
    and weight sum ``state`` ``(2,)`` and the weighted value sum ``acc``."""
    if x == -np.inf:
        return
    if x > state[0]:
        shrink = math.exp(state[0] - x)
        state[1] *= shrink
        for c in range(acc.shape[0]):
            acc[c] *= shrink
        state[0] = x
    w = math.exp(x - state[0])
    state[1] += w
    for c in range(acc.shape[0]):
        acc[c] += w * value[c]


@njit(cache=True, fastmath=_FAST)
def _head(k, v, ps, pyramid, offsets, h, q, T, bs, scale, window, sinks, candidates, beam, num_selected,
          num_summaries, fanout, out):
    """Head h's output row: softmax over its window keys, selected keys and summaries, in one
    online pass."""
    w0 = max(0, T - window) // bs * bs
    L = w0 // bs
    sel = np.empty(0, dtype=np.int64)
    if L > 0:
        sel = _selected(k, ps, pyramid, offsets, h, q, L, bs, scale, sinks, candidates, beam, num_selected, fanout)
    state = np.array([-np.inf, 0.0])
    acc = np.zeros(v.shape[2])
    for t in range(w0, T):
        _add_term(_logit(k, h, t, q, scale), v[h, t], state, acc)
    for leaf in sel:
        for t in range(leaf * bs, (leaf + 1) * bs):
            _add_term(_logit(k, h, t, q, scale), v[h, t], state, acc)
    G = min(num_summaries, L)
    value = np.empty(v.shape[2])
    for g in range(G):
        _add_term(_summary(ps, h, q, g * L // G, (g + 1) * L // G, sel, bs, scale, value), value, state, acc)
    for c in range(v.shape[2]):
        out[h, c] = acc[c] / state[1]


@njit(cache=True, fastmath=_FAST)
def _append(k, v, ps, pyramid, offsets, h, kn, vn, t, bs, base, fanout):
    """Head h of :meth:`.decode._Row.extend` for one token at position t (room and no regrouping
    due): its key ``kn`` ``(D,)`` and value ``vn``, and when it completes a leaf, that leaf's
    prefix row and the pyramid rows at it (``offsets``: one per level, then a sentinel)."""
    D, Dv = k.shape[2], v.shape[2]
    k[h, t] = kn
    v[h, t] = vn
    if (t + 1) % bs:
        return
    leaf = (t + 1) // bs
    for d in range(D):
        total = square = k[h, t, d] * 0
        for j in range(t + 1 - bs, t + 1):
            total += k[h, j, d]
            square += k[h, j, d] * k[h, j, d]
        ps[h, leaf, d] = ps[h, leaf - 1, d] + total
        ps[h, leaf, D + d] = ps[h, leaf - 1, D + d] + square
    for c in range(Dv):
        total = v[h, t, c] * 0
        for j in range(t + 1 - bs, t + 1):
            total += v[h, j, c]
        ps[h, leaf, 2 * D + c] = ps[h, leaf - 1, 2 * D + c] + total
    size = base
    for level in range(offsets.shape[0] - 1):
        if leaf % size == 0:
            pyramid[h, offsets[level] + leaf // size] = ps[h, leaf, : 2 * D]
        size *= fanout


@njit(cache=True, fastmath=_FAST, parallel=True)
def decode_step(k, v, ps, pyramid, offsets, x, append, T, bs, scale, window, sinks, candidates, beam, num_selected,
                num_summaries, fanout):
    """The output ``(H, Dv)`` of the query at position ``T - 1`` over keys ``k[:, :T]`` ``(H, cap, D)``,
    values ``v``, leaf prefix sums ``ps`` and their ``pyramid`` with level ``offsets`` and a
    sentinel (see :class:`.decode._Row`). ``x`` ``(H, D)``: the query; with ``append``, ``(H, 2 D +
    Dv)``: the query, then the key and value to write at ``T - 1`` first (and the index rows they
    complete)."""
    D = k.shape[2]
    out = np.empty((x.shape[0], v.shape[2]), dtype=v.dtype)
    for h in prange(x.shape[0]):
        if append:
            _append(k, v, ps, pyramid, offsets, h, x[h, D: 2 * D], x[h, 2 * D:], T - 1, bs, candidates // beam, fanout)
        _head(k, v, ps, pyramid, offsets, h, x[h, :D], T, bs, scale, window, sinks, candidates, beam, num_selected,
              num_summaries, fanout, out)
    return out
