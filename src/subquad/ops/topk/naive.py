"""Slow, obvious reference of top-k attention, for the tests (the library never imports it)."""

import torch


def top_p_keys(logits, keys, top_p):
    """Of ``keys`` (their ``logits``), those whose logit is at least that of the first key
    (largest first) at which the keys before it hold ``top_p`` of the softmax over ``keys``."""
    if top_p >= 1:
        return keys
    ordered = logits.sort(descending=True).values
    count, total = len(keys), 0.0
    for n, w in enumerate(torch.softmax(ordered, -1).tolist()):
        if n > 0 and total >= top_p:
            count = n
            break
        total += w
    return [j for j, x in zip(keys, logits.tolist()) if x >= ordered[count - 1]]


def topk_attention_reference(q, k, v, key_padding_mask=None, causal=False, scale=None, top_k=256, top_p=1.0):
    """Per query, the set of its visible keys whose logit is at least its ``top_k``-th largest
    visible logit, pruned by :func:`top_p_keys`; softmax over that set (loops over queries)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    B, H, N, _ = q.shape
    M = k.shape[2]
    out = q.new_zeros(B, H, N, v.shape[-1])
    for b in range(B):
        for h in range(H):
            for i in range(N):
                keys = [j for j in range(M) if (not causal or j <= i)
                        and (key_padding_mask is None or not key_padding_mask[b, j])]
                if not keys:
                    continue
                logits = (q[b, h, i] @ k[b, h, keys].T) * scale
                kth = logits.sort(descending=True).values[min(top_k, len(keys)) - 1]
                chosen = [j for j, x in zip(keys, logits.tolist()) if x >= kth]
                chosen = top_p_keys((q[b, h, i] @ k[b, h, chosen].T) * scale, chosen, top_p)
                w = torch.softmax((q[b, h, i] @ k[b, h, chosen].T) * scale, -1)
                out[b, h, i] = w @ v[b, h, chosen]
    return out
