"""Slow, obvious reference of MagicPIG's sampling estimate, for the tests (the library never imports it)."""

import math

import torch


def _code(x, hyperplanes, table):
    """The K signs of ``x . w > 0`` for the hyperplanes ``w`` of one table."""
    return tuple(bool(x @ w > 0) for w in hyperplanes[table])


def _sampling_probability(q, k, bits, tables, min_matches):
    """``P[at least min_matches of L tables collide]``, a table colliding with probability
    ``(1 - theta / pi)^K``, summed term by term in Python floats (detached: a constant)."""
    q, k = q.detach(), k.detach()
    qn, kn = float(q.norm()), float(k.norm())
    cos = float(q @ k) / (qn * kn) if qn > 0 and kn > 0 else 0.0
    p = (1 - math.acos(min(1.0, max(-1.0, cos))) / math.pi) ** bits
    return math.fsum(math.comb(tables, j) * p ** j * (1 - p) ** (tables - j) for j in range(min_matches, tables + 1))


def magicpig_attention_reference(q, k, v, key_padding_mask=None, causal=False, scale=None, *, hyperplanes,
                                 min_matches=2, sinks=4, local=64):
    """Per query (loops): its visible real keys; the static ones (the first ``sinks`` real keys,
    and those whose rank among the real keys is within ``local`` of the query's, causal only
    before it; query ``i`` at key position ``i``); every other one whose code equals the query's in
    at least ``min_matches`` tables, its logit lowered by ``log u``; softmax over those keys."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    B, H, N, _ = q.shape
    M = k.shape[2]
    L, K = hyperplanes.shape[:2]
    w = hyperplanes.to(q.dtype)
    out = q.new_zeros(B, H, N, v.shape[-1])
    for b in range(B):
        real = [j for j in range(M) if key_padding_mask is None or not key_padding_mask[b, j]]
        rank = {j: r for r, j in enumerate(real)}
        for h in range(H):
            for i in range(N):
                at = len([j for j in real if j <= i]) - 1  # the query's rank among the real keys
                keys, shifts = [], []
                for j in real:
                    if causal and j > i:
                        continue
                    near = at - local < rank[j] and (causal or rank[j] < at + local)
                    if rank[j] < sinks or near:
                        keys.append(j)
                        shifts.append(0.0)
                        continue
                    matches = sum(_code(q[b, h, i], w, t) == _code(k[b, h, j], w, t) for t in range(L))
                    if matches >= min_matches:
                        keys.append(j)
                        shifts.append(math.log(_sampling_probability(q[b, h, i], k[b, h, j], K, L, min_matches)))
                if not keys:
                    continue
                logits = (q[b, h, i] @ k[b, h, keys].T) * scale - torch.tensor(shifts, dtype=q.dtype)
                out[b, h, i] = torch.softmax(logits, -1) @ v[b, h, keys]
    return out
