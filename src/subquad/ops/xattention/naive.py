"""Slow, obvious reference of XAttention's antidiagonal block selection, for the tests (the library
never imports it)."""

import torch

from ..hybrid.naive import items_over_real_keys
from ..softmax.naive import softmax_attention_reference
from ..topk.naive import top_p_keys


def kept_blocks(q, k, causal, scale, block_size, stride, threshold):
    """``kept[h][qb]``: the key blocks query block ``qb`` of one unpadded item ``(H, n, D)`` keeps
    (loops over heads, query blocks and their scoring queries)."""
    H, N, _ = q.shape
    M = k.shape[1]
    P = -(-M // block_size)
    out = [[] for _ in range(H)]
    for h in range(H):
        for qb in range(-(-N // block_size)):
            rows = range(qb * block_size, min(N, (qb + 1) * block_size))
            scorers = rows if not causal else range(max(0, qb - 1) * block_size, qb * block_size)
            share = [0.0] * P
            for i in scorers:
                read = [j for j in range(M) if (not causal or j <= i) and i % stride + j % stride == stride - 1]
                if read:
                    w = torch.softmax((q[h, i] @ k[h, read].T) * scale, -1)
                    for j, x in zip(read, w.tolist()):
                        share[j // block_size] += x / len(scorers)
            kept, total = set(), 0.0
            for p in sorted(range(P), key=lambda p: -share[p]) if scorers else ():  # the tests avoid ties
                if kept and total >= threshold:
                    break
                kept.add(p)
                total += share[p]
            if causal:
                kept.add(qb)
            out[h].append(kept)
    return out


def _one(q, k, v, causal, scale, block_size, stride, threshold, top_p):
    """One unpadded item ``(H, n, D)``, loops over heads, query blocks and queries; each query's
    keys pruned by :func:`~subquad.ops.topk.naive.top_p_keys`."""
    H, N, _ = q.shape
    M = k.shape[1]
    out = q.new_zeros(H, N, v.shape[-1])
    kept = kept_blocks(q, k, causal, scale, block_size, stride, threshold)
    for h in range(H):
        for qb, blocks in enumerate(kept[h]):
            for i in range(qb * block_size, min(N, (qb + 1) * block_size)):
                keys = [j for j in range(M) if j // block_size in blocks and (not causal or j <= i)]
                keys = top_p_keys((q[h, i] @ k[h, keys].T) * scale, keys, top_p)
                w = torch.softmax((q[h, i] @ k[h, keys].T) * scale, -1)
                out[h, i] = w @ v[h, keys]
    return out


def xattention_attention_reference(q, k, v, key_padding_mask=None, causal=False, scale=None, block_size=128,
                                   stride=8, threshold=0.9, top_p=1.0):
    """Each item over its real keys, as hybrid's reference does."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if k.shape[2] <= block_size and top_p >= 1:  # one key block: exact attention
        return softmax_attention_reference(q, k, v, key_padding_mask, causal, scale)
    return items_over_real_keys(
        lambda q, k, v: _one(q[0], k[0], v[0], causal, scale, block_size, stride, threshold, top_p)[None],
        q, k, v, key_padding_mask, causal)
