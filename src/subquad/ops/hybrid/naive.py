"""The hybrid estimator written out plainly, for tests: loops over batch, heads, queries, nodes
and keys, a dense logit matrix, and each key's weight set one by one. Slow; tiny shapes only.

For query ``i``: keys attended exactly keep their logit ``s q.k_j``; every other real key that
``i`` may see (causal: before its window) gets the mean logit of the keys of its coarse group
that are not attended exactly; padded (and, causal, later) keys get nothing. The output is
``sum_j w_j v_j / sum_j w_j`` with ``w_j = exp(logit_j)``. Keys are handled by rank among the
real keys throughout; in self-attention with padding, queries too (padded ones output zeros).
"""

from __future__ import annotations

import dataclasses

import math

import torch
from torch import Tensor

from . import options as _options
from ..softmax.naive import softmax_attention_reference
from .options import HybridOptions, HybridPlan, plan

__all__ = ["hybrid_attention_naive", "tree_naive"]


def _stats(keys: Tensor, members: list[int], size: int, iterations: int):
    """Count, mean, principal direction, its (largest, smallest) projection and per-member
    projections of one node (``members``: real key ranks among its ``size`` slots), as
    ``index.node_stats`` defines them."""
    D = keys.shape[1]
    if not members:
        return 0, torch.zeros(D, dtype=keys.dtype), torch.zeros(D, dtype=keys.dtype), (0.0, 0.0), {}
    x = keys[members]
    mean = x.mean(0)
    dev = x - mean
    u = dev[int(dev.square().sum(1).argmax())]
    for _ in range(iterations):
        u = dev.T @ (dev @ u)
        u = u / max(float(u.detach().norm()), 1e-30)
    proj = dev @ u
    ends = (max(float(proj.detach().max()), 0.0), min(float(proj.detach().min()), 0.0))  # empty slots project to 0
    return len(members), mean, u, ends, dict(zip(members, proj.tolist()))


def tree_naive(k: Tensor, p: HybridPlan) -> tuple[list[list[int]], dict]:
    """The key tree of one head's real keys ``k`` ``(M, D)`` (rank order): its leaves, as lists
    of key ranks (``-1``: an empty slot) in slot order, and the summary ``(count, mean, u,
    (largest, smallest projection on u))`` of every node the descent scores, by ``(level,
    index)``."""
    M = k.shape[0]
    nodes = [list(range(M)) + [-1] * (p.slots - M)]
    stats = {}
    for level in range(p.depth + 1):
        scored = p.start_level < level <= p.final_level
        split = p.chunk_level <= level < p.depth
        nxt = []
        for j, node in enumerate(nodes):
            members = [r for r in node if r >= 0]
            count, mean, u, ends, proj = _stats(k, members, len(node), p.tree_iterations)
            if scored:
                stats[level, j] = (count, mean, u, ends)
            if split:  # sorted() is stable; empty slots last
                node = sorted(node, key=lambda r: proj[r] if r >= 0 else math.inf)
            nxt += [node[: len(node) // 2], node[len(node) // 2:]]
        if level < p.depth:
            nodes = nxt
    return nodes, stats


def _node_score(q: Tensor, stat, scoring: str, scale: float) -> float:
    """``s q.mean + log n + s max((q.u) p_max, (q.u) p_min)`` (``mass``) or ``s q.mean``."""
    count, mean, u, (high, low) = stat
    if count == 0:
        return -math.inf
    score = float((q @ mean).detach()) * scale  # scores steer discrete choices only
    if scoring == "mass":
        b = float((q @ u).detach()) * scale
        score += math.log(count) + max(b * high, b * low)
    return score


def _leaf_score(logits: list[float], scoring: str) -> float:
    """Score of a leaf from the logits of its keys the query may select: their log-sum-exp
    (``mass``) or mean (``mean``)."""
    if not logits:
        return -math.inf
    x = torch.tensor(logits, dtype=torch.float64)
    return float(x.logsumexp(0) if scoring == "mass" else x.mean())


def _windows(N: int, M: int, valid: Tensor, w: int, causal: bool) -> list[int]:
    """First rank of each query's window (rank = real keys before a position)."""
    rank = [int(valid[:j].sum()) for j in range(M + 1)]
    if causal:
        return [rank[min(i + 1, M)] - w for i in range(N)]
    return [min(max(rank[(2 * i + 1) * M // (2 * N)] - w // 2, 0), max(rank[M] - w, 0)) for i in range(N)]


def _candidates(qs: list[Tensor], stats, nodes, sealed: int | None, p: HybridPlan, scale: float) -> list[list[int]]:
    """The candidate leaves (lists of ranks) of one block of queries ``qs``: the beam descent."""
    def extent(level, j):
        size = p.slots >> level
        start, end = j * size, (j + 1) * size
        if level >= p.chunk_level:
            start = start // p.chunk_size * p.chunk_size
            end = start + p.chunk_size
        return start, end

    frontier = [(0.0, j) for j in range(1 << p.start_level)]
    for level in range(p.start_level + 1, p.final_level + 1):
        children, usable, forced = [], {}, set()
        for parent_score, parent in frontier:
            for j in (2 * parent, 2 * parent + 1):
                children.append(j)
                alive = parent_score > -math.inf
                start, end = extent(level, j)
                inside = sealed is None or end <= sealed
                usable[j] = alive and inside
                if alive and not inside and level < p.chunk_level and start < sealed:
                    forced.add(j)
        best = {j: -math.inf for j in children}
        for qv in qs:  # each query's scores relative to their log-sum-exp over the children
            s = {j: _node_score(qv, stats[level, j], p.scoring, scale) if usable[j] else -math.inf for j in children}
            finite = [x for x in s.values() if x > -math.inf]
            lse = math.log(sum(math.exp(x - max(finite)) for x in finite)) + max(finite) if finite else 0.0
            for j in children:
                best[j] = max(best[j], s[j] - lse)
        scored = [(math.inf if j in forced else best[j], j) for j in children]
        frontier = sorted(scored, key=lambda t: -t[0])[: p.beam + (sealed is not None)]
    per_node = 1 << (p.depth - p.final_level)
    leaves = [(j * per_node + t) for s, j in frontier if s > -math.inf for t in range(per_node)]
    if sealed is not None:
        leaves = [t for t in leaves if (t * p.block_size // p.chunk_size + 1) * p.chunk_size <= sealed]
    return [nodes[t] for t in leaves]


def hybrid_attention_naive(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None = None,
                           causal: bool = False, scale: float | None = None, **options) -> Tensor:
    """Hybrid attention (``subquad.ops.hybrid``) by its definition, in the dtype of ``q``."""
    B, H, N, D = q.shape
    M = k.shape[2]
    scale = D**-0.5 if scale is None else scale
    o = HybridOptions(**options)
    valid = torch.ones(B, M, dtype=torch.bool) if key_padding_mask is None else ~key_padding_mask
    out = torch.zeros(B, H, N, v.shape[-1], dtype=q.dtype)
    for b in range(B):
        real = [j for j in range(M) if valid[b, j]]
        if not real:
            continue
        if o.budget >= len(real) or o.budget >= M:
            out[b] = softmax_attention_reference(q[b: b + 1], k[b: b + 1], v[b: b + 1],
                                                 None if key_padding_mask is None else key_padding_mask[b: b + 1],
                                                 causal, scale)[0]
            continue
        p = plan(o, len(real), causal)
        # self-attention with padding: only the real queries, at their ranks
        queries = real if (N == M and len(real) < M) else list(range(N))
        Mq = len(real) if queries is real else M
        pos_valid = torch.ones(Mq, dtype=torch.bool) if queries is real else valid[b]
        lo = _windows(len(queries), Mq, pos_valid, p.window, causal)
        upto = [int(pos_valid[: i + 1].sum()) for i in range(len(queries))]  # causal: ranks a query sees
        for h in range(H):
            kr, vr = k[b, h, real], v[b, h, real]
            out[b, h, queries] = _head(q[b, h, queries], kr, vr, lo, upto, causal, scale, p)
    return out


def _head(q, k, v, lo, upto, causal, scale, p: HybridPlan):
    N, M = q.shape[0], k.shape[0]
    logits = (q @ k.T) * scale
    leaves, stats = tree_naive(k, p)
    qb = _options.QUERY_BLOCK
    out = torch.zeros(N, v.shape[-1], dtype=q.dtype)
    for i in range(N):
        seen = list(range(upto[i] if causal else M))
        window = [j for j in range(lo[i], lo[i] + p.window) if 0 <= j < M]
        region = [j for j in seen if (j < lo[i] if causal else j not in window)]  # may be selected or summarised
        block = range((i // qb) * qb, min((i // qb + 1) * qb, N))
        chosen = set(window) | _selected(q, logits, leaves, stats, i, block, lo, region, causal, p, scale)
        rest = [j for j in region if j not in chosen]
        weight = torch.zeros(M, dtype=q.dtype)
        for j in chosen:
            weight[j] = logits[i, j].exp()
        for group in _coarse_groups(rest, leaves, M, causal, p):
            mean_logit = logits[i, group].mean()
            for j in group:
                weight[j] = mean_logit.exp()
        if weight.sum() > 0:
            out[i] = weight @ v / weight.sum()
    return out


def _coarse_groups(rest: list[int], leaves, M: int, causal: bool, p: HybridPlan) -> list[list[int]]:
    """``rest`` split by coarse group: runs of ranks (causal) or the tree's nodes at depth
    ``log2(num_summaries)``."""
    if causal:
        size = -(-M // (p.num_summaries * p.block_size)) * p.block_size
        group_of = {j: j // size for j in rest}
    else:
        per = len(leaves) // p.num_summaries
        group_of = {j: t // per for t, leaf in enumerate(leaves) for j in leaf if j >= 0}
    groups = {}
    for j in rest:
        groups.setdefault(group_of[j], []).append(j)
    return list(groups.values())


def _selected(q, logits, leaves, stats, i, block, lo, region, causal, p: HybridPlan, scale) -> set[int]:
    """Keys of the leaves chosen for query ``i``: its block's candidates (the sink leaves; causal,
    the recent leaves by position; the tree leaves from the descent; a sink key only in its
    sink leaf) and, with ``query_beam``, the tree leaves of its own descent (that beam), each scored over
    the keys ``i`` may select (``region``)."""
    qb = _options.QUERY_BLOCK
    first = block[0]
    sealed = None
    cands = []
    if causal:
        sealed = max(max(lo[first], 0) // p.chunk_size - 1, 0) * p.chunk_size
        last = lo[min(first + qb, len(lo)) - 1] if first + qb <= len(lo) else lo[-1]
        recent = range(sealed, max(last, sealed), p.block_size)
        cands = [list(range(r, r + p.block_size)) for r in recent]
    if causal:  # the qb queries that end at the block's first
        qs = [q[max(first - qb + 1 + t, 0)] for t in range(qb)]
    else:
        qs = [q[t] for t in block] + [q[block[-1]]] * (qb - len(block))  # the last query repeated
    sink_keys = p.sinks * p.block_size
    tree = _candidates(qs, stats, leaves, sealed, p, scale)
    if p.query_beam:  # the leaves of query i's own descent, those its block did not find
        own = _candidates([q[i]], stats, leaves, sealed, dataclasses.replace(p, beam=p.query_beam), scale)
        tree += [leaf for leaf in own if leaf not in tree]
    cands = [[j for j in leaf if j >= sink_keys] for leaf in cands + tree]
    cands = [list(range(r, r + p.block_size)) for r in range(0, sink_keys, p.block_size)] + cands
    allowed = set(region)
    scored = []
    for leaf in cands:
        keys = [j for j in leaf if j in allowed]
        scored.append((_leaf_score([float(logits[i, j].detach()) for j in keys], p.scoring), keys))
    # torch.topk order is not specified among equal scores; the tests use inputs without ties
    top = sorted(scored, key=lambda t: -t[0])[: p.num_selected]
    return {j for s, keys in top if s > -math.inf for j in keys}
