"""Slow, obvious reference of top-k attention, for the tests (the library never imports it)."""

import torch


def topk_attention_reference(q, k, v, key_padding_mask=None, causal=False, scale=None, top_k=256):
    """Per query, the set of its visible keys whose logit is at least its ``top_k``-th largest
    visible logit; softmax over that set (loops over queries)."""
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
                w = torch.softmax((q[b, h, i] @ k[b, h, chosen].T) * scale, -1)
                out[b, h, i] = w @ v[b, h, chosen]
    return out
