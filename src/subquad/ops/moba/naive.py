"""Slow, obvious reference of MoBA's gating, for the tests (the library never imports it)."""

import torch

from ..hybrid.naive import items_over_real_keys
from ..softmax.naive import softmax_attention_reference
from ..topk.naive import top_p_keys


def _one(q, k, v, causal, scale, block_size, top_blocks, top_p):
    """One unpadded item ``(H, n, D)``, loops over heads and queries; the chosen keys pruned by
    :func:`~subquad.ops.topk.naive.top_p_keys`."""
    H, N, _ = q.shape
    M = k.shape[1]
    P = -(-M // block_size)
    out = q.new_zeros(H, N, v.shape[-1])
    for h in range(H):
        blocks = {p: list(range(p * block_size, min(M, (p + 1) * block_size))) for p in range(P)}
        for i in range(N):
            own = i // block_size
            cands = [p for p in range(P) if not causal or p < own]
            gate = {p: float(q[h, i] @ k[h, blocks[p]].mean(0)) for p in cands}
            chosen = sorted(cands, key=lambda p: -gate[p])[:top_blocks - causal]  # ties: the earlier block
            if causal:
                chosen.append(own)
            keys = [j for p in chosen for j in blocks.get(p, []) if not causal or j <= i]
            keys = top_p_keys((q[h, i] @ k[h, keys].T) * scale, keys, top_p)
            w = torch.softmax((q[h, i] @ k[h, keys].T) * scale, -1)
            out[h, i] = w @ v[h, keys]
    return out


def moba_attention_reference(q, k, v, key_padding_mask=None, causal=False, scale=None, block_size=128,
                             top_blocks=8, top_p=1.0):
    """Each item over its real keys, as hybrid's reference does."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if top_blocks >= -(-k.shape[2] // block_size) and top_p >= 1:  # every block: exact attention
        return softmax_attention_reference(q, k, v, key_padding_mask, causal, scale)
    return items_over_real_keys(
        lambda q, k, v: _one(q[0], k[0], v[0], causal, scale, block_size, top_blocks, top_p)[None],
        q, k, v, key_padding_mask, causal)
