"""The hybrid estimator written out plainly, for tests: loops over batch, heads, queries and
groups, a dense logit matrix, and each key's weight set one by one. Slow; tiny shapes only.

For query ``i``: keys attended exactly keep their logit ``s q.k_j``; every other real key that
``i`` may see (causal: before its window) gets the mean logit of the keys of its coarse group
that are not attended exactly; padded (and, causal, later) keys get nothing. The output is
``sum_j w_j v_j / sum_j w_j`` with ``w_j = exp(logit_j)``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from . import HybridOptions, HybridPlan, leaves_per_node, plan
from .. import hybrid as _hybrid  # QUERY_BLOCK read at call time (tests may change it)

__all__ = ["hybrid_attention_naive", "groups_naive", "leaf_scores_naive"]


def _split(keys: Tensor, slots: list[int], valid: list[bool], iterations: int) -> list[int]:
    """One node of the tree: its slots sorted by projection on the top principal direction of
    its valid keys (power iteration from the farthest key), invalid slots last."""
    idx = [s for s, ok in zip(slots, valid) if ok]
    if not idx:
        return slots
    x = keys[idx]
    dev = x - x.mean(0)
    full = torch.zeros(len(slots), keys.shape[1], dtype=keys.dtype)
    for row, (s, ok) in enumerate(zip(slots, valid)):
        if ok:
            full[row] = dev[idx.index(s)]
    u = full[int(full.square().sum(1).argmax())]
    for _ in range(iterations):
        u = full.T @ (full @ u)
        u = u / max(float(u.norm()), 1e-30)
    proj = [float(full[r] @ u) if ok else math.inf for r, ok in enumerate(valid)]
    ranked = sorted(range(len(slots)), key=lambda r: proj[r])  # sorted() is stable
    return [slots[r] for r in ranked]


def groups_naive(k: Tensor, valid: Tensor, p: HybridPlan) -> list[list[int]]:
    """Leaves of one head's keys ``k`` ``(M, D)`` (``valid`` ``(M,)``) as lists of slot
    positions (``>= M``: padding slots), in slot order."""
    M = k.shape[0]
    bs = p.block_size
    if p.grouping == "contiguous":
        coarse = -(-M // (p.num_summaries * bs)) * bs
        S = coarse * p.num_summaries
        slots = list(range(S))
    else:
        depth = max(math.ceil(math.log2(max(1, -(-M // bs)))), int(math.log2(p.num_summaries)))
        S = bs << depth
        slots = list(range(S))
        ok = lambda s: s < M and bool(valid[s])  # noqa: E731
        keys = torch.cat([k, k[-1:].expand(S - M, -1)])
        nodes = [slots]
        while len(nodes[0]) > bs:
            nodes = [_split(keys, n, [ok(s) for s in n], p.tree_iterations) for n in nodes]
            nodes = [half for n in nodes for half in (n[: len(n) // 2], n[len(n) // 2 :])]
        slots = [s for n in nodes for s in n]
    return [slots[i : i + bs] for i in range(0, S, bs)]


def leaf_scores_naive(q: Tensor, k: Tensor, leaf: list[int], valid: Tensor, scoring: str, scale: float,
                      rank: int | None = None) -> float:
    """The score of a group of key slots (a leaf, or a first-stage node) for one query ``q``
    ``(D,)``; -inf for a group with no real key. ``second_order`` takes the variance from the top
    ``rank`` singular pairs of the key deviations (None: all of them, the exact variance)."""
    M = k.shape[0]
    real = [j for j in leaf if j < M and bool(valid[j])]
    if not real:
        return -math.inf
    x = k[real]
    if scoring == "bounds":
        hi, lo = x.max(0).values, x.min(0).values
        return float(sum(max(q[d] * hi[d], q[d] * lo[d]) for d in range(len(q)))) * scale
    score = float(q @ x.mean(0)) * scale
    if scoring == "second_order":
        dev = x - x.mean(0)
        _, sv, vh = torch.linalg.svd(dev, full_matrices=False)
        r = vh.shape[0] if rank is None else min(rank, vh.shape[0])
        var = sum(float(q @ (sv[t] * vh[t])) ** 2 for t in range(r)) / len(real)
        score += math.log(len(real)) + 0.5 * scale * scale * var
    return score


def _window(i: int, N: int, M: int, w: int, causal: bool) -> tuple[int, int]:
    if causal:
        return i - w + 1, i + 1
    lo = min(max((2 * i + 1) * M // (2 * N) - w // 2, 0), M - w)
    return lo, lo + w


def hybrid_attention_naive(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None = None,
                           causal: bool = False, scale: float | None = None, **options) -> Tensor:
    """Hybrid attention (``subquad.ops.hybrid``) by its definition, in the dtype of ``q``."""
    B, H, N, D = q.shape
    M = k.shape[2]
    scale = D**-0.5 if scale is None else scale
    o = HybridOptions(**options)
    p = plan(o, M, causal)
    valid = torch.ones(B, M, dtype=torch.bool) if key_padding_mask is None else ~key_padding_mask
    out = torch.zeros(B, H, N, v.shape[-1], dtype=q.dtype)
    for b in range(B):
        for h in range(H):
            out[b, h] = _head(q[b, h], k[b, h], v[b, h], valid[b], causal, scale, o.budget >= M, p)
    return out


def _head(q, k, v, valid, causal, scale, exact, p: HybridPlan):
    N, M = q.shape[0], k.shape[0]
    logits = (q @ k.T) * scale
    leaves = groups_naive(k, valid, p)
    per_coarse = len(leaves) // p.num_summaries
    coarse_of = {j: c // per_coarse for c, leaf in enumerate(leaves) for j in leaf}
    out = torch.zeros(N, v.shape[-1], dtype=q.dtype)
    for i in range(N):
        lo, hi = _window(i, N, M, p.window, causal)
        seen = [j for j in range(M) if valid[j] and (not causal or j <= i)]
        if exact:
            chosen = set(seen)
        else:
            chosen = {j for j in range(max(lo, 0), hi) if j in seen} | _selected(q, k, valid, leaves, i, lo, hi, p,
                                                                                causal, scale)
        rest = [j for j in seen if j not in chosen and (not causal or j < lo)]
        weight = torch.zeros(M, dtype=q.dtype)
        for j in chosen:
            weight[j] = logits[i, j].exp()
        for c in set(coarse_of[j] for j in rest):
            members = [j for j in rest if coarse_of[j] == c]
            mean_logit = logits[i, members].mean()
            for j in members:
                weight[j] = mean_logit.exp()
        if weight.sum() > 0:
            out[i] = weight @ v / weight.sum()
    return out


def _candidates(k, valid, leaves, lo_first: int, block_queries: list[Tensor], p: HybridPlan, causal,
                scale) -> list[int]:
    """Candidate leaves of one block of (pooled) queries: every leaf in one stage, else the
    leaves of the best nodes (runs of ``per_node`` leaves) by the best score any query of the
    block gives them (causal: the first query, among nodes that end before its window)."""
    L = len(leaves)
    per_node = leaves_per_node(L, p.candidates)
    if per_node >= L:
        return list(range(L))
    nodes = -(-L // per_node)
    scored = []
    for node in range(nodes):
        members = [j for leaf in leaves[node * per_node : (node + 1) * per_node] for j in leaf]
        rank = None if len(members) <= _hybrid.EXACT_VARIANCE else 2
        if causal:
            ends = (node + 1) * per_node * p.block_size
            s = leaf_scores_naive(block_queries[0], k, members, valid, p.scoring, scale, rank)
            s = -math.inf if ends > max(lo_first, 0) else s
        else:
            s = max(leaf_scores_naive(qb, k, members, valid, p.scoring, scale, rank) for qb in block_queries)
        scored.append((s, node))
    top = sorted(scored, key=lambda t: -t[0])[: min(max(1, p.candidates // per_node), nodes)]
    return [node * per_node + t for s, node in top if s > -math.inf for t in range(per_node)
            if node * per_node + t < L]


def _selected(q, k, valid, leaves, i, lo, hi, p: HybridPlan, causal, scale) -> set[int]:
    """Keys of the leaves chosen for query ``i`` (real keys outside the window)."""
    M, N = k.shape[0], q.shape[0]
    g = p.query_group
    qb = max(1, _hybrid.QUERY_BLOCK // g)  # pooled queries per block
    pooled = [q[t : min(t + g, N)].mean(0) for t in range(0, N, g)]
    gi = i // g
    block = range((gi // qb) * qb, min((gi // qb + 1) * qb, len(pooled)))
    first = block[0] * g
    lo_first = _window(first, N, M, p.window, causal)[0]
    cands = _candidates(k, valid, leaves, lo_first, [pooled[t] for t in block], p, causal, scale)
    scored = []
    for index in cands:
        leaf = leaves[index]
        s = leaf_scores_naive(pooled[gi], k, leaf, valid, p.scoring, scale)
        start, end = index * p.block_size, (index + 1) * p.block_size
        if p.grouping == "contiguous":
            if causal and end > max(lo, 0):
                s = -math.inf
            if not causal and start >= lo and min(end, M) <= hi:
                s = -math.inf
        scored.append((s, index))
    # torch.topk order is not specified among equal scores; the tests use inputs without ties
    top = sorted(scored, key=lambda t: -t[0])[: min(p.num_selected, len(scored))]
    keys = {j for s, index in top if s > -math.inf for j in leaves[index]}
    return {j for j in keys if j < M and bool(valid[j]) and not (lo <= j < hi)}
