"""Slow, obvious reference of Quest's page selection, for the tests (the library never imports it)."""

import torch

from ..hybrid.naive import items_over_real_keys
from ..softmax.naive import softmax_attention_reference
from ..topk.naive import top_p_keys


def _one(q, k, v, causal, scale, page_size, num_pages, top_p):
    """One unpadded item ``(H, n, D)``: per query (loops), each candidate page's bound
    ``sum_d max(q_d min_d, q_d max_d)``; the ``num_pages`` highest (causal: among the pages wholly
    before the query's page, plus that page); softmax over the chosen pages' visible keys, pruned
    by :func:`~subquad.ops.topk.naive.top_p_keys`."""
    H, N, _ = q.shape
    M = k.shape[1]
    P = -(-M // page_size)
    out = q.new_zeros(H, N, v.shape[-1])
    for h in range(H):
        pages = {p: list(range(p * page_size, min(M, (p + 1) * page_size))) for p in range(P)}
        for i in range(N):
            own = i // page_size
            cands = [p for p in range(P) if not causal or p < own]
            bound = {p: float(torch.maximum(q[h, i] * k[h, pages[p]].min(0).values,
                                            q[h, i] * k[h, pages[p]].max(0).values).sum()) for p in cands}
            chosen = sorted(cands, key=lambda p: -bound[p])[:num_pages]  # ties: the earlier page
            if causal:
                chosen.append(own)
            keys = [j for p in chosen for j in pages.get(p, []) if not causal or j <= i]
            keys = top_p_keys((q[h, i] @ k[h, keys].T) * scale, keys, top_p)
            w = torch.softmax((q[h, i] @ k[h, keys].T) * scale, -1)
            out[h, i] = w @ v[h, keys]
    return out


def quest_attention_reference(q, k, v, key_padding_mask=None, causal=False, scale=None, page_size=16,
                              num_pages=64, top_p=1.0):
    """Each item over its real keys, as hybrid's reference does."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if num_pages >= -(-k.shape[2] // page_size) and top_p >= 1:  # every page: exact attention
        return softmax_attention_reference(q, k, v, key_padding_mask, causal, scale)
    return items_over_real_keys(
        lambda q, k, v: _one(q[0], k[0], v[0], causal, scale, page_size, num_pages, top_p)[None],
        q, k, v, key_padding_mask, causal)
