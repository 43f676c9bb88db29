"""Slow, obvious reference of block-sparse attention, for the tests (the library never imports it):
the selection by loops over query blocks, then dense masked softmax over the full logits."""

from __future__ import annotations

import math

import torch


def selected_blocks(q, k, key_padding_mask=None, causal=False, scale=None, *, query_block=128, key_block=64,
                    num_blocks=16, sinks=1, local=1, score="mass"):
    """``sel[b][h][i]``: the set of key blocks query block ``i`` attends (module docstring of
    ``subquad.ops.block_sparse.select``), and for causal calls the diagonal ones among them."""
    B, H, N, D = q.shape
    M = k.shape[2]
    scale = D ** -0.5 if scale is None else scale
    real = torch.ones(B, M, dtype=torch.bool) if key_padding_mask is None else ~key_padding_mask
    qreal = real if N == M else torch.ones(B, N, dtype=torch.bool)
    nq, nk = -(-N // query_block), -(-M // key_block)
    out = [[[set() for _ in range(nq)] for _ in range(H)] for _ in range(B)]
    for b in range(B):
        for h in range(H):
            means, counts = [], []
            for j in range(nk):
                keys = [t for t in range(j * key_block, min(M, (j + 1) * key_block)) if real[b, t]]
                counts.append(len(keys))
                means.append(k[b, h, keys].mean(0) if keys else torch.zeros(D, dtype=k.dtype))
            for i in range(nq):
                first, last = i * query_block, min(N, (i + 1) * query_block) - 1
                if causal:
                    past = min(first // key_block, nk)
                    cands = [j for j in range(past) if counts[j]]
                    forced = {j for j in cands if j < sinks or j >= past - local}
                    scorers = [t for t in range(first - query_block, first) if t >= 0 and qreal[b, t]]
                    diag = {j for j in range(past, nk) if j * key_block <= min(last, M - 1) and counts[j]}
                else:
                    lo = max(0, first // key_block - local)
                    hi = min(nk, -(-(last + 1) // key_block) + local)
                    cands = [j for j in range(nk) if counts[j]]
                    forced = {j for j in cands if j < sinks or lo <= j < hi}
                    scorers = [t for t in range(first, last + 1) if qreal[b, t]]
                    diag = set()
                scores = {}
                for j in cands:
                    if score == "mean":
                        qm = q[b, h, scorers].mean(0) if scorers else torch.zeros(D, dtype=q.dtype)
                        scores[j] = float(scale * qm @ means[j])
                    else:
                        total = 0.0
                        for t in scorers:
                            logits = [float(scale * q[b, h, t] @ means[c]) + math.log(counts[c]) for c in cands]
                            top = max(logits)
                            z = sum(math.exp(x - top) for x in logits)
                            total += math.exp(float(scale * q[b, h, t] @ means[j]) + math.log(counts[j]) - top) / z
                        scores[j] = total
                rest = sorted((j for j in cands if j not in forced), key=lambda j: -scores[j])
                out[b][h][i] = forced | set(rest[:num_blocks]) | diag
    return out


def block_sparse_attention_reference(q, k, v, key_padding_mask=None, causal=False, scale=None, **options):
    """Dense softmax over the keys of each query's selected blocks (minus padding and, causal,
    later keys); zeros for a query with none."""
    B, H, N, D = q.shape
    M = k.shape[2]
    scale = D ** -0.5 if scale is None else scale
    qb, kb = options.get("query_block", 128), options.get("key_block", 64)
    sel = selected_blocks(q, k, key_padding_mask, causal, scale, **options)
    allowed = torch.zeros(B, H, N, M, dtype=torch.bool)
    for b in range(B):
        for h in range(H):
            for i, blocks in enumerate(sel[b][h]):
                for j in blocks:
                    allowed[b, h, i * qb: (i + 1) * qb, j * kb: (j + 1) * kb] = True
    if causal:
        allowed &= torch.ones(N, M, dtype=torch.bool).tril()
    if key_padding_mask is not None:
        allowed &= ~key_padding_mask[:, None, None, :]
    logits = (q @ k.mT) * scale
    weights = torch.softmax(logits.masked_fill(~allowed, -math.inf), -1).nan_to_num(0.0)
    return weights @ v
