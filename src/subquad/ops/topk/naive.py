"""Slow, obvious reference of top-k attention, for the tests (the library never imports it)."""

import torch


def topk_attention_reference(q, k, v, key_padding_mask=None, causal=False, scale=None, top_k=256, top_p=1.0):
    """Per query, the set of its visible keys whose logit is at least its ``top_k``-th largest
    visible logit, or, with ``top_p`` < 1, at least the logit of the first key (largest first)
    at which the keys before it hold ``top_p`` of its softmax over every visible key; softmax
    over that set (loops over queries)."""
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
                ordered = logits.sort(descending=True).values
                count = min(top_k, len(keys))
                if top_p < 1:
                    weights, total = torch.softmax(ordered, -1).tolist(), 0.0
                    for n, w in enumerate(weights[:count]):
                        if n > 0 and total >= top_p:
                            count = n
                            break
                        total += w
                kth = ordered[count - 1]
                chosen = [j for j, x in zip(keys, logits.tolist()) if x >= kth]
                w = torch.softmax((q[b, h, i] @ k[b, h, chosen].T) * scale, -1)
                out[b, h, i] = w @ v[b, h, chosen]
    return out
