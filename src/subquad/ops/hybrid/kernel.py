"""hybrid's forward on CPU as one compiled kernel (numba): for each (head, block of
:data:`~.options.QUERY_BLOCK` queries), in one pass over cache-resident rows, the beam descent
of the key tree, the candidate leaves, one matrix product that gives every logit the block needs
(window, candidate keys, summaries), and per query its own descent (``query_beam``: the first
level for the whole block in one product, then a few nodes per level; its extra leaves' logits
from the keys in slot order), the leaf scores, the top leaves, the summaries without the exact
keys and one softmax. Tasks are spread over threads (:func:`.kernel_tree.parallel`); the
matrix products call BLAS (scipy's, limited to one thread inside the kernel so that the two
thread pools do not fight). Each function binds the scratch's arrays to locals once, before its
loops: reading a tuple field or taking a row view inside a loop costs numba an atomic
reference-count pair each time. What LLVM vectorises here (measured, numba 0.68): a loop with one
store whose indices are bound before it (:func:`_copy_row`; two rows copied in one loop ran 5x
slower); long passes over a whole block (the descent scores all (child, query) pairs in passes
over the queries, where per query the 64-entry loops cost more to set up than to run); not a
maximum, running (``m = max(m, x[i])``) or entry by entry over a row of run-time length (both
stay scalar).

It computes what :func:`.attend.hybrid_core` computes (the same selection; values equal to
rounding) from the same key index (:func:`.index.build_index`), without autograd: the torch path
stays for gradients, other devices, ``torch.compile`` and dispatch modes. Ties between equal
scores may be broken differently. The first call compiles (43-45 s on 2 x86 cores, 55 s before
the third rule below; once per machine and dtype); the result is cached on disk (``cache=True``:
beside this file, or in the user's cache directory when that is read-only). Four rules keep that
compile short: the task loop and its body are one function (numba re-optimises every callee's
code inside its caller); large steps are written in that loop rather than in an
``inline="always"`` function (numba inlines by copying the callee's IR block by block, with its
whole scope each time); no inlined function inlines another (the copies multiply: the leaf
scores inside the exact keys' step cost 10 s of inlining, called from the loop 3 s); arrays are
copied with loops, not slice assignments (those compile numba's shape-error messages).
"""

from __future__ import annotations

import functools
import math
from collections import namedtuple

import numpy as np
import torch
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.core.extending import intrinsic

from . import options as _options
from .index import KeyIndex
from .kernel_tree import build_index_compiled, parallel, reused
from .options import HybridPlan
from .select import node_priors, sealed_ends
from .summaries import causal_group_size

__all__ = ["hybrid_kernel"]

# numba's fastmath=True assumes no infinities and turns the -inf markers into NaN: only the flags
# that keep them
_FAST = {"nsz", "arcp", "contract", "afn", "reassoc"}
_NEG = -np.inf
_AHEAD = 8  # rows prefetched ahead in a gather


@intrinsic
def _prefetch(typingctx, arr, i, j):
    """Ask the CPU to bring the cache line of ``arr[i, j]`` (a 2-D array) into cache: a hint
    (LLVM's ``llvm.prefetch``, read, high locality), never a fault."""

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, sig.args[0], ary, args[1:], wraparound=False)
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                            "llvm.prefetch.p0i8")
        builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(3), i32(1)])
        return context.get_dummy_value()

    return types.none(arr, i, j), codegen


@njit(cache=True, inline="always")
def _prefetch_row(a, i):
    """Prefetch row ``i`` of the 2-D ``a`` (every 64-byte line)."""
    for d in range(0, a.shape[1], 64 // a.itemsize):
        _prefetch(a, i, d)


@njit(fastmath=_FAST, cache=True, inline="always")
def _exp(x, out, n, bits):
    """``out[:n] = exp(x[:n])`` for ``x <= 88`` (-inf -> 0). float32: a vectorised exp (Cody-Waite
    reduction, degree-7 polynomial, the power of two built in ``bits``, an int32 scratch; relative
    error < 3e-7), about 7x libm's scalar exp on AVX2; float64: libm's. The float32 view of
    ``bits`` is taken here: passed in as a second array, the forward ran 10 % slower."""
    if x.itemsize != 4:
        for i in range(n):
            out[i] = math.exp(x[i])
        return
    for i in range(n):
        xi = max(x[i], np.float32(-87.0))
        k = np.floor(xi * np.float32(1.4426950408889634) + np.float32(0.5))
        r = (xi - k * np.float32(0.693145751953125)) - k * np.float32(1.428606765330187e-06)
        p = np.float32(1 / 5040)
        for c in (1 / 720, 1 / 120, 1 / 24, 1 / 6, 1 / 2, 1.0, 1.0):
            p = p * r + np.float32(c)
        out[i] = p if x[i] > np.float32(-87.0) else np.float32(0.0)
        bits[i] = (np.int32(k) + np.int32(127)) << np.int32(23)
    scale = bits.view(np.float32)
    for i in range(n):
        out[i] *= scale[i]


@njit(fastmath=_FAST, cache=True, inline="always")
def _top(x, n, k, idx, val):
    """The (at most) ``k`` largest finite-or-+inf entries of ``x[:n]``, best first, into ``idx``
    and ``val``; returns how many (entries at -inf are never taken). Equal scores: the earlier."""
    m = 0
    for i in range(n):
        s = x[i]
        if not s > _NEG:
            continue
        if m < k:
            pos = m
            m += 1
        elif s > val[m - 1]:
            pos = m - 1
        else:
            continue
        while pos > 0 and val[pos - 1] < s:
            val[pos] = val[pos - 1]
            idx[pos] = idx[pos - 1]
            pos -= 1
        val[pos] = s
        idx[pos] = i
    return m


@njit(fastmath=_FAST, cache=True, inline="always")
def _top_many(x, n, k, idx, val, ci, cv):
    """:func:`_top` (the same entries, the same order) for ``n`` of at least ``4 k``: the smallest
    of ``k`` strided maxima bounds the ``k``-th largest from below (``k`` distinct entries reach
    it), so only the entries at or above it (``ci``, ``cv``: scratch of ``n``) go through the
    insertion, whose mispredicted branches cost more than the vectorised passes (about 30 %
    faster at 12 of 128)."""
    if k < 1 or n < 4 * k:
        return _top(x, n, k, idx, val)
    bound = x.dtype.type(np.inf)
    for lane in range(k):
        m = x.dtype.type(_NEG)
        for g in range(n // k):
            y = x[g * k + lane]
            m = y if y > m else m
        bound = min(bound, m)
    c = 0
    for i in range(n):
        y = x[i]
        ci[c], cv[c] = i, y
        c += (y >= bound) & (y > _NEG)
    m = _top(cv, c, k, idx, val)
    for a in range(m):
        idx[a] = ci[idx[a]]
    return m


@njit(fastmath=_FAST, cache=True)
def _children(node, score, n, level, sealed, cfg, prior, child, base, straddle):
    """The ``2 n`` children of the kept nodes, their ``prior`` (:func:`.select.node_priors`, once
    per call rather than a logarithm per child; -inf where dead or, causal, outside the sealed
    chunks) and whether each straddles the sealed end (a node split by position that must be
    opened)."""
    slots, chunk_level, chunk, causal = cfg[14], cfg[8], cfg[9], cfg[11]
    size = slots >> level
    for c in range(2 * n):
        nd = 2 * node[c // 2] + (c & 1)
        child[c] = nd
        usable = score[c // 2] > _NEG
        straddle[c] = False
        if causal:
            st = (nd - (1 << level)) * size
            en = st + size
            if level >= chunk_level:
                st = st // chunk * chunk
                en = st + chunk
            elif st < sealed < en:
                straddle[c] = usable
            usable = usable and en <= sealed
        base[c] = prior[nd] if usable else _NEG


@njit(fastmath=_FAST, cache=True)
def _descend(qd, nqd, sealed, cfg, prior, mean, direction, ends, s):
    """The beam descent of one block (:func:`.select.descend`): ``qd`` ``(64, D)`` scaled
    queries, the first ``nqd`` scored. Leaves the final nodes (heap ids) in ``s.node`` and their
    scores in ``s.score``; returns how many. ``s``: the worker's scratch."""
    start, final, keep, mass = cfg[5], cfg[6], cfg[10], cfg[12]
    node, score = s.node, s.score
    n = 1 << start
    for j in range(n):
        node[j] = n + j
        score[j] = 0.0
    child, base, straddle, vbuf, cs, tmp = s.child, s.base, s.straddle, s.vbuf, s.cs, s.tmp
    ex, bits, topi, topv, qmax, qsum = s.ex, s.bits, s.topi, s.topv, s.qmax, s.qsum
    zero, neg, Q = qd.dtype.type(0), qd.dtype.type(_NEG), qd.shape[0]
    for level in range(start + 1, final + 1):
        K = 2 * n
        _children(node, score, n, level, sealed, cfg, prior, child, base, straddle)
        for c in range(K):
            if c + _AHEAD < K:
                _prefetch_row(mean, child[c + _AHEAD])
                _prefetch_row(direction, child[c + _AHEAD])
            _copy_row(mean, child[c], vbuf, c)
            _copy_row(direction, child[c], vbuf, K + c)
        rows = 2 * K if mass else K
        proj = s.pflat[: rows * Q].reshape(rows, Q)  # child-major, so that each pass below runs over queries
        np.dot(vbuf[:rows], qd.T, proj)
        for j in range(Q):
            qmax[j], qsum[j] = neg, zero
        # every query's child scores (tmp, child-major), each query's log-sum-exp over the children,
        # the children's best relative score: one pass per step over all (child, query) pairs, those
        # without a maximum vectorised over the queries (per query, too short to pay their set-up)
        for c in range(K):
            b, a0, a1, o = base[c], ends[child[c], 0], ends[child[c], 1], c * Q
            for j in range(Q):
                x = b + proj[c, j]
                if mass:
                    x += max(proj[K + c, j] * a0, proj[K + c, j] * a1)
                tmp[o + j] = x
        for c in range(K):
            for j in range(Q):
                qmax[j] = max(qmax[j], tmp[c * Q + j])
        for c in range(K):
            for j in range(Q):
                ex[c * Q + j] = tmp[c * Q + j] - qmax[j] if qmax[j] > neg else neg
        _exp(ex, ex, K * Q, bits)
        for c in range(K):
            for j in range(Q):
                qsum[j] += ex[c * Q + j]
        for j in range(nqd):
            qsum[j] = qmax[j] + qd.dtype.type(math.log(qsum[j])) if qmax[j] > neg else zero
        for c in range(K):
            m = neg
            for j in range(nqd):
                m = max(m, tmp[c * Q + j] - qsum[j])
            cs[c] = m
        for c in range(K):
            if straddle[c]:
                cs[c] = np.inf
        n = _top(cs, K, keep, topi, topv)
        for a in range(n):
            node[a] = child[topi[a]]
            score[a] = topv[a]
    return n


@njit(fastmath=_FAST, cache=True)
def _candidates(node, score, nfin, sealed, lo_last, M, order, slot_valid, cfg, rank, ok):
    """The candidate keys of one block, slot-major (key ``t`` of leaf ``l`` at ``t * L + l``, so
    that a pass over a leaf's keys is a pass over whole rows): the sink leaves, the recent leaves
    (causal: by rank from ``sealed``) and the leaves of the final nodes. ``rank``: clamped into
    ``[0, M)``; ``ok``: whether it may be chosen (a sink key only through its sink leaf).
    Returns the number of leaves ``L``."""
    bs, sinks, final, depth, chunk, causal = cfg[1], cfg[4], cfg[6], cfg[7], cfg[9], cfg[11]
    sink_keys = sinks * bs
    recent = (max(lo_last - sealed, 0) + bs - 1) // bs if causal else 0
    per_node = 1 << (depth - final)
    L = sinks + recent + nfin * per_node
    for t in range(bs):
        for leaf in range(sinks + recent):
            r = leaf * bs + t if leaf < sinks else sealed + (leaf - sinks) * bs + t
            rank[t * L + leaf] = min(r, M - 1)
            ok[t * L + leaf] = r < M and (leaf < sinks or r >= sink_keys)
    leaf = sinks + recent
    for a in range(nfin):
        first = (node[a] - (1 << final)) * per_node * bs
        for slot0 in range(first, first + per_node * bs, bs):
            leaf_ok = score[a] > _NEG and (not causal or (slot0 // chunk + 1) * chunk <= sealed)
            for t in range(bs):
                r = order[slot0 + t]
                rank[t * L + leaf] = min(r, M - 1)
                ok[t * L + leaf] = leaf_ok and slot_valid[slot0 + t] and r >= sink_keys
            leaf += 1
    return L


@njit(fastmath=_FAST, cache=True, inline="always")
def _leaf_mass(x, L, off, top, bs, s):
    """``s.lscore[off + l] = sum_t exp(x[t * L + l] - top)`` for the ``L`` leaves of ``x``."""
    ex, sc = s.ex, s.lscore
    for e in range(bs * L):
        ex[e] = x[e] - top
    _exp(ex, ex, bs * L, s.bits)
    for leaf in range(L):
        sc[off + leaf] = ex[leaf]
    for t in range(1, bs):
        for leaf in range(L):
            sc[off + leaf] += ex[t * L + leaf]


@njit(fastmath=_FAST, cache=True, inline="always")
def _leaf_mean(x, L, off, bs, s):
    """``s.lscore[off + l]``: the mean of leaf ``l``'s allowed logits in ``x`` (-inf: none)."""
    sc = s.lscore
    for leaf in range(L):
        acc, n = x.dtype.type(0), 0
        for t in range(bs):
            if x[t * L + leaf] > _NEG:
                acc += x[t * L + leaf]
                n += 1
        sc[off + leaf] = acc / n if n else _NEG


@njit(fastmath=_FAST, cache=True, inline="always")
def _leaf_top(x, nleaf, xo, nown, cfg, s):
    """The ``num_selected`` best candidate leaves of one query, into ``s.topi``, from its
    candidate keys' logits: the block's ``x`` (``nleaf`` leaves) then its own ``xo`` (``nown``;
    both slot-major, -inf where the query may not select the key); returns how many. Score
    (:func:`.select.leaf_scores`): the log-sum-exp (``mass``; ranked by ``exp(score - best key's
    logit)``, the same order without a log per leaf; a leaf more than 87 below the best key,
    where that underflows, is not taken) or the mean of the allowed keys' logits."""
    bs, ns, mass = cfg[1], cfg[2], cfg[12]
    n = nleaf + nown
    sc = s.lscore
    if mass:
        top = x.dtype.type(_NEG)
        for e in range(bs * nleaf):
            top = max(top, x[e])
        for e in range(bs * nown):
            top = max(top, xo[e])
        if not top > _NEG:
            return 0
        _leaf_mass(x, nleaf, 0, top, bs, s)
        _leaf_mass(xo, nown, nleaf, top, bs, s)
        for leaf in range(n):  # exp(score - top): the same order as the score; 0 -> never taken
            sc[leaf] = sc[leaf] if sc[leaf] > 0 else _NEG
    else:
        _leaf_mean(x, nleaf, 0, bs, s)
        _leaf_mean(xo, nown, nleaf, bs, s)
    return _top_many(sc, n, ns, s.topi, s.topv, s.ci, s.cv)


@njit(fastmath=_FAST, cache=True, inline="always")
def _exact(p, lo, lo_first, M, nleaf, nown, m, rank, v, cfg, s):
    """One query's exact keys: its window (logits at ``p[r - lo_first]``) and the allowed keys of
    its ``m`` best candidate leaves ``s.topi`` (the block's: logits at ``p[U + e]``, -inf where not
    allowed; its own: ``s.xo``, ranks ``s.ro``, their values copied from ``v`` into ``s.vb`` past
    the block's rows), into ``s.xl`` (logits), ``s.xr`` (ranks) and ``s.xv`` (rows of ``s.vb``).
    Returns (number of exact keys, number of window keys)."""
    w, bs = cfg[0], cfg[1]
    U, C = s.dims[0], s.dims[1]
    x, xo, ro, xl, xr, xv, vb, topi = p[U:], s.xo, s.ro, s.xl, s.xr, s.xv, s.vb, s.topi
    nx = 0
    for r in range(max(lo, 0), min(lo + w, M)):
        xl[nx], xr[nx], xv[nx] = p[r - lo_first], r, r - lo_first
        nx += 1
    nwin = nx
    row = U + C  # the next free row of vb for an own key's value
    for a in range(m):
        leaf = topi[a]
        for t in range(bs):
            if leaf < nleaf:
                e = t * nleaf + leaf
                if x[e] > _NEG:
                    xl[nx], xr[nx], xv[nx] = x[e], rank[e], U + e
                    nx += 1
            else:
                e = t * nown + leaf - nleaf
                if xo[e] > _NEG:
                    xl[nx], xr[nx], xv[nx] = xo[e], ro[e], row
                    _copy_row(v, ro[e], vb, row)
                    row += 1
                    nx += 1
    return nx, nwin


@njit(fastmath=_FAST, cache=True, inline="always")
def _columns(p, q, lo, M, nx, nwin, cfg, h, hd, s):
    """One query's summary columns: logit sum ``s.cq`` and count ``s.cn`` of each coarse group
    without the query's exact keys (non-causal: every exact key leaves its group; causal: the
    groups before the one holding the window start ``a``, then that group's part before ``a``,
    from prefix sums, and only selected keys leave), and each exact key's column ``s.xg`` (-1:
    none). Returns the number of columns."""
    G, causal, gs = cfg[3], cfg[11], cfg[13]
    base = s.dims[0] + s.dims[1]  # the groups' rows in p
    cq, cn, xg, xl, xr, gcnt = s.cq, s.cn, s.xg, s.xl, s.xr, hd.gcnt
    if not causal:
        group_of = hd.group_of
        for c in range(G):
            cq[c], cn[c] = p[base + c], gcnt[h, c]
        for x in range(nx):
            g = group_of[h, xr[x]]
            xg[x] = g
            cq[g] -= xl[x]
            cn[g] -= 1.0
        return G
    a = max(lo, 0)
    ga = min(a // gs, G - 1)
    for c in range(G):
        cq[c] = p[base + c] if c < ga else 0.0
        cn[c] = gcnt[h, c] if c < ga else 0.0
    part = hd.prek[h, ga, a - ga * gs]
    acc = q.dtype.type(0)
    for d in range(q.shape[0]):
        acc += q[d] * part[d]
    cq[G] = acc
    cn[G] = a - ga * gs
    for x in range(nx):
        xg[x] = -1
    for x in range(nwin, nx):
        g = xr[x] // gs
        g = G if g == ga else g
        xg[x] = g
        cq[g] -= xl[x]
        cn[g] -= 1.0
    return G + 1


@njit(fastmath=_FAST, cache=True, inline="always")
def _softmax_row(vb, nx, ncol, lo, cfg, h, hd, s, out):
    """One query's output (:func:`.summaries.combine`): softmax over its exact keys (values: rows
    ``s.xv`` of ``vb``) and its summary columns (logit: mean logit of what is left in the group,
    weight: its count)."""
    G, causal, gs = cfg[3], cfg[11], cfg[13]
    zero, one, neg = vb.dtype.type(0), vb.dtype.type(1), vb.dtype.type(_NEG)
    xl, xg, xv, lcs, cn, cq, ex, gv = s.xl, s.xg, s.xv, s.lc, s.cn, s.cq, s.ex, hd.gv
    mx = neg
    nan = False  # a NaN logit (NaN in q or k) makes the row NaN, as in exact attention
    for x in range(nx):
        mx = max(mx, xl[x])
        nan |= xl[x] != xl[x]
    for c in range(ncol):
        lc = neg
        if cn[c] >= 0.5:
            lc = cq[c] / max(cn[c], one)
        lcs[c] = lc
        mx = max(mx, lc)
        nan |= lc != lc
    if nan:
        out[:] = np.nan
        return
    if not (mx > neg and mx < np.inf):
        mx = zero
    for x in range(nx):
        ex[x] = xl[x] - mx
    for c in range(ncol):
        ex[nx + c] = lcs[c] - mx
    _exp(ex, ex, nx + ncol, s.bits)
    den = zero
    for c in range(ncol):
        lcs[c] = ex[nx + c]
        den += lcs[c] * max(cn[c], zero)
    Dv = out.shape[0]
    for d in range(Dv):
        out[d] = zero
    for x in range(nx):  # each exact key's weight, less its group's (the key left that group)
        den += ex[x]
        g = xg[x]
        ex[x] -= lcs[g] if g >= 0 else zero
    for x in range(0, nx - 1, 2):  # two rows per pass over out: a third less time than one
        w0, w1, r0, r1 = ex[x], ex[x + 1], xv[x], xv[x + 1]
        for d in range(Dv):
            out[d] += w0 * vb[r0, d] + w1 * vb[r1, d]
    if nx % 2:
        w0, r0 = ex[nx - 1], xv[nx - 1]
        for d in range(Dv):
            out[d] += w0 * vb[r0, d]
    for c in range(G):
        if lcs[c] > 0.0:
            for d in range(Dv):
                out[d] += lcs[c] * gv[h, c, d]
    if causal and lcs[G] > 0.0:
        a = max(lo, 0)
        ga = min(a // gs, G - 1)
        row = hd.prev[h, ga, a - ga * gs]
        for d in range(Dv):
            out[d] += lcs[G] * row[d]
    if den > 0.0:
        for d in range(Dv):
            out[d] /= den


@njit(fastmath=_FAST, cache=True)
def _mask_static(logits, U, C, lo_first, lo_last, cfg, s):
    """Set to -inf the logits of the candidate keys no query of the block may select, and list
    in ``s.dirty`` the keys some may and some may not (non-causal: in a window of the block,
    ranks ``[lo_first, lo_last + w)``; causal: at or after the first window start). Returns how
    many are dirty."""
    w, causal = cfg[0], cfg[11]
    rank, ok, dirty = s.rank, s.ok, s.dirty
    nd = 0
    for e in range(C):
        r = rank[e]
        if not ok[e]:
            for j in range(logits.shape[0]):
                logits[j, U + e] = _NEG
        elif r >= lo_first and (causal or r < lo_last + w):
            dirty[nd] = e
            nd += 1
    return nd


@njit(fastmath=_FAST, cache=True)
def _gather_rows(k, v, gk, lo_first, U, C, s):
    """The block's rows, so that every later pass reads them from cache: keys ``s.kb`` (window
    ranks from ``lo_first``, candidate keys, then the coarse groups' key sums) and values ``s.vb``
    (window, candidates)."""
    M, D, Dv = k.shape[0], k.shape[1], v.shape[1]
    kb, vb, rank = s.kb, s.vb, s.rank
    for u in range(U + C):
        r = min(max(lo_first + u, 0), M - 1) if u < U else rank[u - U]
        if U <= u + _AHEAD < U + C:  # the candidates are scattered rows: fetch a few ahead
            _prefetch_row(k, rank[u + _AHEAD - U])
            _prefetch_row(v, rank[u + _AHEAD - U])
        for d in range(D):
            kb[u, d] = k[r, d]
        for d in range(Dv):
            vb[u, d] = v[r, d]
    for c in range(gk.shape[0]):
        for d in range(D):
            kb[U + C + c, d] = gk[c, d]
    s.dims[0], s.dims[1] = U, C


@njit(fastmath=_FAST, cache=True, inline="always")
def _copy_row(src, i, dst, j):
    """``dst[j] = src[i]``. Written as its own loop over one row with the indices bound first:
    copying two rows in one loop (or reading the index inside it) is not vectorised by numba
    (measured: 5x slower for the descent's gather)."""
    for d in range(src.shape[1]):
        dst[j, d] = src[i, d]


@njit(fastmath=_FAST, cache=True)
def _dot(q, rows, r):
    """``q . rows[r]``: one row's dot product."""
    acc = q.dtype.type(0)
    for d in range(q.shape[0]):
        acc += q[d] * rows[r, d]
    return acc


@njit(fastmath=_FAST, cache=True)
def _first_level(qb, sealed, cfg, prior, mean, direction, ends, s):
    """For the queries' own descents: the children of every start node (the same for each query
    of the block) into ``s.fchild`` / ``s.fbase`` / ``s.fstraddle`` / ``s.fends``, and every
    query's products with their vectors in one matrix product, ``s.fproj`` ``(QB, rows)``."""
    start, mass = cfg[5], cfg[12]
    node, score, fchild, vbuf, fends = s.node, s.score, s.fchild, s.vbuf, s.fends
    n = 1 << start
    for j in range(n):
        node[j] = n + j
        score[j] = 0.0
    K = 2 * n
    _children(node, score, n, start + 1, sealed, cfg, prior, fchild, s.fbase, s.fstraddle)
    for c in range(K):
        _copy_row(mean, fchild[c], vbuf, c)
        _copy_row(direction, fchild[c], vbuf, K + c)
        fends[c, 0], fends[c, 1] = ends[fchild[c], 0], ends[fchild[c], 1]
    rows = 2 * K if mass else K
    np.dot(qb, vbuf[:rows].T, s.fproj[: qb.shape[0] * rows].reshape(qb.shape[0], rows))


@njit(fastmath=_FAST, cache=True, inline="always")
def _own_descend(j, qv, sealed, cfg, prior, mean, direction, ends, s):
    """Query ``j``'s own descent (beam ``cfg[15]``, from the start level's children scored by
    :func:`_first_level`): the final nodes in ``s.node`` / ``s.score``; returns how many. One
    query's scores rank as its relative ones (:func:`.select.descend`), so none is normalised."""
    start, final, keep, mass = cfg[5], cfg[6], cfg[15], cfg[12]
    node, score, cs, topi, topv = s.node, s.score, s.cs, s.topi, s.topv
    child, base, straddle = s.child, s.base, s.straddle
    fbase, fends, fstraddle, fchild, fproj = s.fbase, s.fends, s.fstraddle, s.fchild, s.fproj
    K = 2 << start
    rows = 2 * K if mass else K
    o = j * rows
    for c in range(K):
        x = fbase[c] + fproj[o + c]
        if mass:
            x += max(fproj[o + K + c] * fends[c, 0], fproj[o + K + c] * fends[c, 1])
        cs[c] = np.inf if fstraddle[c] else x
    n = _top(cs, K, keep, topi, topv)
    for a in range(n):
        node[a], score[a] = fchild[topi[a]], topv[a]
    for level in range(start + 2, final + 1):
        K = 2 * n
        _children(node, score, n, level, sealed, cfg, prior, child, base, straddle)
        for c in range(K):
            nd, x = child[c], base[c]
            if x > _NEG:
                x += _dot(qv, mean, nd)
                if mass:
                    du = _dot(qv, direction, nd)
                    x += max(du * ends[nd, 0], du * ends[nd, 1])
            cs[c] = np.inf if straddle[c] else x
        n = _top(cs, K, keep, topi, topv)
        for a in range(n):
            node[a], score[a] = child[topi[a]], topv[a]
    return n


@njit(fastmath=_FAST, cache=True, inline="always")
def _own_leaves(qv, lo_i, nown, nblock, sealed, M, keys, order, slot_valid, cfg, s):
    """The leaves of query ``qv``'s own final nodes (``s.node[:nown]``) that its block's
    (``s.mnode[:nblock]``) do not hold: their keys' logits ``s.xo`` (slot-major, -inf where not
    allowed; from ``keys`` in slot order, where a node's keys are one run of rows) and ranks
    ``s.ro``. Returns the number of leaves."""
    w, bs, sinks, final, depth, chunk, causal = cfg[0], cfg[1], cfg[4], cfg[6], cfg[7], cfg[9], cfg[11]
    per_node = 1 << (depth - final)
    node, score, mnode, mscore, ro, xo = s.node, s.score, s.mnode, s.mscore, s.ro, s.xo
    kept = 0
    for a in range(nown):
        new = score[a] > _NEG
        for b in range(nblock):
            new = new and not (mnode[b] == node[a] and mscore[b] > _NEG)
        if new:
            mnode[nblock + kept] = node[a]
            kept += 1
    L = kept * per_node
    for i in range(kept):
        first = (mnode[nblock + i] - (1 << final)) * per_node * bs
        for leaf in range(per_node):
            slot0 = first + leaf * bs
            leaf_ok = not causal or (slot0 // chunk + 1) * chunk <= sealed
            for t in range(bs):
                r = order[slot0 + t]
                e = t * L + i * per_node + leaf
                ro[e] = min(r, M - 1)
                ok = leaf_ok and slot_valid[slot0 + t] and r >= sinks * bs and (causal or not lo_i <= r < lo_i + w)
                xo[e] = _dot(qv, keys, slot0 + t) if ok else _NEG
    return L


Scratch = namedtuple("Scratch", "qb qd node score child base straddle vbuf cs tmp topi topv pflat rank ok kb dims "
                                "lscore xl xr xg cq cn lc dirty ex bits vb xv mnode mscore "
                                "fproj fchild fbase fstraddle fends xo ro ci cv qmax qsum")
Heads = namedtuple("Heads", "order slot_valid prior mean direction ends gcnt gk gv group_of prek prev keys")


@njit(cache=True)
def _scratch(D, Dv, sizes, like):
    """One worker's scratch, sized by ``sizes`` = (QB, nodes, children, exact keys, leaves,
    candidate keys, gathered rows, product entries, columns, own candidate keys)."""
    QB, nodes, K, X, L, C, E, P, cols, own = sizes
    dt = like.dtype
    n_ex = max(C, QB * K, X + cols, own)
    return Scratch(np.empty((QB, D), dt), np.empty((QB, D), dt), np.empty(nodes, np.int64), np.empty(nodes, dt),
                   np.empty(K, np.int64), np.empty(K, dt), np.empty(K, np.bool_), np.empty((2 * K, D), dt),
                   np.empty(K, dt), np.empty(QB * K, dt), np.empty(max(nodes, L), np.int64),
                   np.empty(max(nodes, L), dt), np.empty(P, dt), np.empty(C, np.int64), np.empty(C, np.bool_),
                   np.empty((E, D), dt),
                   np.zeros(2, np.int64), np.empty(L + own, dt), np.empty(X, dt), np.empty(X, np.int64),
                   np.empty(X, np.int64), np.empty(cols, dt), np.empty(cols, dt), np.empty(cols, dt),
                   np.empty(C, np.int64), np.empty(n_ex, dt),
                   np.empty(n_ex, np.int32), np.empty((E + X, Dv), dt), np.empty(X, np.int64),
                   np.empty(2 * nodes, np.int64), np.empty(2 * nodes, dt),
                   np.empty(QB * 2 * K, dt), np.empty(K, np.int64), np.empty(K, dt), np.empty(K, np.bool_),
                   np.empty((K, 2), dt), np.empty(max(own, 1), dt), np.empty(max(own, 1), np.int64),
                   np.empty(L + own, np.int64), np.empty(L + own, dt), np.empty(QB, dt), np.empty(QB, dt))


@njit(fastmath=_FAST, cache=True, nogil=True)
def _forward(qs, k, v, lo, cfg, sizes, hd, out, first, last):
    """Tasks ``[first, last)`` of the (head, query block) grid, with one scratch. Each task: the
    descent, candidates, one product for every logit, then each query's own descent
    (``query_beam``), exact keys, summaries and softmax."""
    N, M, QB = qs.shape[1], k.shape[1], sizes[0]
    nb = (N + QB - 1) // QB
    w, bs, G, chunk, causal = cfg[0], cfg[1], cfg[3], cfg[9], cfg[11]
    s = _scratch(qs.shape[2], v.shape[2], sizes, qs)
    qb, qd, mnode, mscore, node, score, dirty, rank = s.qb, s.qd, s.mnode, s.mscore, s.node, s.score, s.dirty, s.rank
    for t in range(first, last):
        h, blk = t // nb, t % nb
        i0 = blk * QB
        nq = min(QB, N - i0)
        lo_first, lo_last = lo[i0], lo[i0 + nq - 1]
        U = lo_last - lo_first + w
        for j in range(QB):  # loops, not slice copies: those compile numba's shape-error messages (5 s)
            for d in range(qb.shape[1]):
                qb[j, d] = qs[h, i0 + j, d] if j < nq else 0.0
        sealed = 0
        prior, mean, direction, ends = hd.prior[h], hd.mean[h], hd.direction[h], hd.ends[h]
        if causal:
            sealed = max(max(lo_first, 0) // chunk - 1, 0) * chunk
        if cfg[15]:
            _first_level(qb, sealed, cfg, prior, mean, direction, ends, s)
        if causal:
            for j in range(QB):  # the QB queries ending at the block's first one
                for d in range(qd.shape[1]):
                    qd[j, d] = qs[h, max(i0 - QB + 1 + j, 0), d]
            nfin = _descend(qd, QB, sealed, cfg, prior, mean, direction, ends, s)
        else:
            nfin = _descend(qb, nq, sealed, cfg, prior, mean, direction, ends, s)
        for a in range(nfin):
            mnode[a], mscore[a] = node[a], score[a]
        nleaf = _candidates(node, score, nfin, sealed, lo_last, M, hd.order[h], hd.slot_valid[h], cfg, s.rank, s.ok)
        C = nleaf * bs
        E = U + C + G
        _gather_rows(k[h], v[h], hd.gk[h], lo_first, U, C, s)
        logits = s.pflat[: QB * E].reshape(QB, E)
        np.dot(qb, s.kb[:E].T, logits)
        nd = _mask_static(logits, U, C, lo_first, lo_last, cfg, s)
        keys, order, slot_valid, vh = hd.keys[h], hd.order[h], hd.slot_valid[h], v[h]
        # each query: its own leaves, the dirty keys it may not select masked (in its window, or
        # causal after it), its exact keys, its summary columns, the softmax
        for j in range(nq):
            nown = 0
            qv, row, lo_i = qb[j], logits[j], lo[i0 + j]
            if cfg[15]:
                n = _own_descend(j, qv, sealed, cfg, prior, mean, direction, ends, s)
                nown = _own_leaves(qv, lo_i, n, nfin, sealed, M, keys, order, slot_valid, cfg, s)
            for a in range(nd):
                r = rank[dirty[a]]
                if r >= lo_i and (causal or r < lo_i + w):
                    row[U + dirty[a]] = _NEG
            m = _leaf_top(row[U:], nleaf, s.xo, nown, cfg, s)
            nx, nwin = _exact(row, lo_i, lo_first, M, nleaf, nown, m, rank, vh, cfg, s)
            ncol = _columns(row, qv, lo_i, M, nx, nwin, cfg, h, hd, s)
            _softmax_row(s.vb, nx, ncol, lo_i, cfg, h, hd, s, out[h, i0 + j])


@njit(cache=True, nogil=True)
def _tree_groups(order, valid, keys, v, gcnt, gk, gv, group_of, first, last):
    """Non-causal coarse groups ``[first, last)`` of ``(head, group)``: count, key and value
    sums, and the group of every key rank (runs of slots of the key tree); ``keys``: the keys in
    slot order (zero at empty slots)."""
    G = gcnt.shape[1]
    size = order.shape[1] // G
    for t in range(first, last):
        h, c = t // G, t % G
        gk[h, c] = 0.0
        gv[h, c] = 0.0
        n = 0
        for slot in range(c * size, (c + 1) * size):
            if valid[h, slot]:
                r = order[h, slot]
                n += 1
                group_of[h, r] = c
                for d in range(keys.shape[2]):
                    gk[h, c, d] += keys[h, slot, d]
                for d in range(v.shape[2]):
                    gv[h, c, d] += v[h, r, d]
        gcnt[h, c] = n


def _summary_arrays(k: torch.Tensor, v: torch.Tensor, index: KeyIndex, keys: torch.Tensor, p: HybridPlan):
    """``(gcnt, gk, gv, group_of, prek, prev)`` per head ``(BH, ...)``, numpy: each coarse
    group's count and key and value sums; non-causal (groups of slots; ``keys`` in slot order) the
    group of every key rank; causal (groups of ``gs`` ranks) the sums of each group's keys and
    values before each rank, ``(BH, G, gs + 1, .)``."""
    BH, M, D = k.shape
    G = p.num_summaries
    if not p.causal:
        dt = k.numpy().dtype
        gcnt, gk, gv = np.empty((BH, G), dt), np.empty((BH, G, D), dt), np.empty((BH, G, v.shape[-1]), dt)
        group_of = np.zeros((BH, M), np.int64)
        parallel(functools.partial(_tree_groups, index.order.reshape(BH, -1).numpy(),
                                   index.slot_valid.reshape(BH, -1).numpy(), keys.reshape(BH, -1, D).numpy(),
                                   v.numpy(), gcnt, gk, gv, group_of), BH * G, torch.get_num_threads())
        none = np.zeros((BH, 1, 1, 1), dt)
        return gcnt, gk, gv, group_of, none, none
    gs = causal_group_size(M, G, p.block_size)
    extra = gs * G - M
    kp = torch.nn.functional.pad(k, (0, 0, 0, extra)).view(BH, G, gs, D)
    vp = torch.nn.functional.pad(v, (0, 0, 0, extra)).view(BH, G, gs, -1)
    gcnt = (torch.arange(gs * G) < M).to(k.dtype).view(G, gs).sum(-1).expand(BH, G)
    prek = torch.nn.functional.pad(kp.cumsum(2), (0, 0, 1, 0))
    prev = torch.nn.functional.pad(vp.cumsum(2), (0, 0, 1, 0))
    return tuple(t.contiguous().numpy() for t in (gcnt, kp.sum(2), vp.sum(2), torch.zeros(BH, 1, dtype=torch.long),
                                                  prek, prev))


def _sizes(lo: list[int], N: int, M: int, p: HybridPlan, D: int) -> np.ndarray:
    """Scratch sizes for :func:`_scratch` from the window starts and the plan."""
    QB, bs = _options.QUERY_BLOCK, p.block_size
    keep, keep_own = p.beam + p.causal, (p.query_beam + p.causal if p.query_beam else 0)
    nodes = max(keep, keep_own, 1 << p.start_level) if p.final_level > p.start_level else 1 << p.start_level
    per_node = 1 << (p.depth - p.final_level)
    U = recent = 0
    for i0 in range(0, N, QB):
        first, last = lo[i0], lo[min(i0 + QB, N) - 1]
        U = max(U, last - first + p.window)
        if p.causal:
            sealed = sealed_ends(first, p)
            recent = max(recent, -(-max(last - sealed, 0) // bs))
    L = p.sinks + recent + nodes * per_node
    K = 2 * nodes
    E = U + L * bs + p.num_summaries
    return np.array([QB, nodes, K, p.window + p.num_selected * bs, L, L * bs, E, QB * max(E, 2 * K),
                     p.num_summaries + 1, keep_own * per_node * bs], dtype=np.int64)


@functools.cache
def _blas():
    """The BLAS libraries the kernel's products call (scipy's, loaded by numba's ``np.dot``), to
    limit to one thread inside the kernel: each of its threads calls BLAS on its own block, and
    a threaded BLAS inside them would oversubscribe the cores (measured: 2.2x slower on 2 cores)."""
    import scipy.linalg.cython_blas  # noqa: F401  (loaded before the controller looks)
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController().select(user_api="blas")


def hybrid_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lo: list[int], scale: float,
                  p: HybridPlan) -> torch.Tensor:
    """:func:`.attend.hybrid_core`'s output, computed by the kernel: ``q`` ``(B, H, N, D)``,
    real keys ``k``, ``v`` ``(B, H, M, .)`` in rank order (float32 or float64, CPU), window starts
    ``lo`` (one per query). No autograd."""

    B, H, N, D = q.shape
    M, Dv = k.shape[2], v.shape[-1]
    BH = B * H
    kf, vf = k.reshape(BH, M, D).contiguous(), v.reshape(BH, M, Dv).contiguous()
    index, keys = build_index_compiled(k, p)
    prior = node_priors(index.count, p.scoring)
    heads = Heads(*(t.reshape(BH, *t.shape[2:]).contiguous().numpy() for t in
                    (index.order, index.slot_valid, prior, index.mean, index.direction, index.ends)),
                  *_summary_arrays(kf, vf, index, keys, p), keys.reshape(BH, -1, D).numpy())
    gs = causal_group_size(M, p.num_summaries, p.block_size) if p.causal else 0
    cfg = np.array([p.window, p.block_size, p.num_selected, p.num_summaries, p.sinks, p.start_level, p.final_level,
                    p.depth, p.chunk_level, p.chunk_size, p.beam + p.causal, p.causal, p.scoring == "mass", gs,
                    p.slots, p.query_beam + p.causal if p.query_beam else 0], dtype=np.int64)
    qs = reused("qs", (BH, N, D), kf.numpy().dtype)
    torch.mul(q.reshape(BH, N, D), scale, out=torch.from_numpy(qs))
    out = np.empty((BH, N, Dv), dtype=qs.dtype)
    work = functools.partial(_forward, qs, kf.numpy(), vf.numpy(), np.asarray(lo, dtype=np.int64), cfg,
                             _sizes(lo, N, M, p, D), heads, out)
    with _blas().limit(limits=1):
        parallel(work, BH * -(-N // _options.QUERY_BLOCK), torch.get_num_threads())
    return torch.from_numpy(out).view(B, H, N, Dv)
