"""Slow, obvious reference of block-sparse attention, for the tests (the library never imports it):
the selection by loops over query blocks, then dense masked softmax over the full logits."""

from __future__ import annotations

import math

import torch

from ..softmax.naive import softmax_attention_reference


def selected_blocks(q, k, causal=False, scale=None, *, query_block=512, key_block=128, num_blocks=12, sinks=1,
                    local=1, score="mean_query", top_p=1.0, stride=8):
    """``sel[b][h][i]``: the set of key blocks query block ``i`` attends (module docstring of
    ``subquad.ops.hybrid.select``), for unpadded q ``(B, H, N, D)``, k ``(B, H, M, D)``."""
    B, H, N, D = q.shape
    M = k.shape[2]
    scale = D ** -0.5 if scale is None else scale
    nq, nk = -(-N // query_block), -(-M // key_block)
    out = [[[set() for _ in range(nq)] for _ in range(H)] for _ in range(B)]
    for b in range(B):
        for h in range(H):
            keys = [list(range(j * key_block, min(M, (j + 1) * key_block))) for j in range(nk)]
            means = [k[b, h, ks].mean(0) for ks in keys]
            for i in range(nq):
                first, last = i * query_block, min(N, (i + 1) * query_block) - 1
                if causal:
                    past = min(first // key_block, nk)
                    cands = list(range(past))
                    forced = {j for j in cands if j < sinks or j >= past - local}
                    scorers = list(range(max(0, first - query_block), first))
                    diag = {j for j in range(past, nk) if j * key_block <= min(last, M - 1)}
                else:
                    lo, hi = max(0, first // key_block - local), min(nk, -(-(last + 1) // key_block) + local)
                    cands = list(range(nk))
                    forced = {j for j in cands if j < sinks or lo <= j < hi}
                    scorers = list(range(first, last + 1))
                    diag = set()
                scores = {j: 0.0 for j in cands}
                for t in scorers if score == "mass" and cands else ():  # each scoring query's softmax over the blocks
                    logits = {c: float(scale * q[b, h, t] @ means[c]) + math.log(len(keys[c])) for c in cands}
                    top = max(logits.values())
                    z = sum(math.exp(x - top) for x in logits.values())
                    for c in cands:
                        scores[c] += math.exp(logits[c] - top) / z
                if score == "sampled":
                    _add_sampled(scores, q[b, h], k[b, h], scorers, causal, scale, min(stride, query_block, key_block),
                                 key_block)
                if score == "mean_query" and scorers and cands:
                    _add_mean_query(scores, q[b, h, scorers].mean(0), k[b, h], [keys[c] for c in cands], cands, scale)
                if score == "mean" and scorers:
                    qm = q[b, h, scorers].mean(0)
                    scores = {j: float(scale * qm @ means[j]) for j in cands}
                rest = sorted((j for j in cands if j not in forced), key=lambda j: -scores[j])[:num_blocks]
                if top_p < 1 and rest:
                    rest = _top_p(rest, forced, cands, scores, [len(ks) for ks in keys], score, top_p)
                out[b][h][i] = forced | set(rest) | diag
    return out


def _add_mean_query(scores, qm, k, keys, cands, scale):
    """Add to ``scores[c]`` the softmax weights of the mean query ``qm`` over every key of the
    candidate blocks ``cands`` (``keys[i]``: the positions of block ``cands[i]``) held by block ``c``."""
    logits = {(c, t): float(scale * qm @ k[t]) for c, ks in zip(cands, keys) for t in ks}
    top = max(logits.values())
    z = sum(math.exp(x - top) for x in logits.values())
    for (c, _), x in logits.items():
        scores[c] += math.exp(x - top) / z


def _add_sampled(scores, q, k, scorers, causal, scale, stride, key_block):
    """Add to ``scores[j]`` (candidate blocks) each scoring query's softmax weights over the keys it
    reads (``t mod stride + j mod stride = stride - 1``, causal: ``j <= t``) that fall in block ``j``."""
    for t in scorers:
        read = [j for j in range(k.shape[0]) if (t % stride + j % stride) == stride - 1 and (not causal or j <= t)]
        if not read:
            continue
        logits = [float(scale * q[t] @ k[j]) for j in read]
        top = max(logits)
        z = sum(math.exp(x - top) for x in logits)
        for j, x in zip(read, logits):
            if j // key_block in scores:
                scores[j // key_block] += math.exp(x - top) / z


def _top_p(ranked, forced, cands, scores, counts, score, top_p):
    """The first of ``ranked`` blocks while the estimated share held by the forced blocks and the
    blocks before stays below ``top_p``; shares among the candidates ``cands``: softmax of
    ``score + log count`` ("mean") or score over the sum of scores (the others)."""
    if score == "mean":
        top = max(scores[c] + math.log(counts[c]) for c in cands)
        weight = {c: math.exp(scores[c] + math.log(counts[c]) - top) for c in cands}
    else:
        weight = {c: scores[c] for c in cands}
    total = sum(weight.values())
    held = sum(weight[c] for c in forced) / total
    kept = []
    for j in ranked:
        if held >= top_p:
            break
        kept.append(j)
        held += weight[j] / total
    return kept


def _dense(q, k, v, causal, scale, qb, kb, options):
    B, H, N, D = q.shape
    M = k.shape[2]
    sel = selected_blocks(q, k, causal, scale, query_block=qb, key_block=kb, **options)
    allowed = torch.zeros(B, H, N, M, dtype=torch.bool)
    for b in range(B):
        for h in range(H):
            for i, blocks in enumerate(sel[b][h]):
                for j in blocks:
                    allowed[b, h, i * qb: (i + 1) * qb, j * kb: (j + 1) * kb] = True
    if causal:
        allowed &= torch.ones(N, M, dtype=torch.bool).tril()
    weights = torch.softmax((q @ k.mT * scale).masked_fill(~allowed, -math.inf), -1).nan_to_num(0.0)
    return weights @ v


def hybrid_attention_reference(q, k, v, key_padding_mask=None, causal=False, scale=None, query_block=512,
                                     key_block=128, **options):
    """Dense softmax over the keys of each query's selected blocks (causal: at or before it), item
    by item over its real keys (self-attention: and real queries; a padded query position copies
    the last real query before it, causal: zeros where none is, not causal: the first real one)."""
    B, H, N, D = q.shape
    M = k.shape[2]
    scale = D ** -0.5 if scale is None else scale
    o = {"num_blocks": 12, "sinks": 1, "local": 1, **options}
    every = o["num_blocks"] + max(o["sinks"], o["local"], 0 if causal else 1) >= -(-M // key_block)
    if every and o.get("top_p", 1.0) >= 1:
        return softmax_attention_reference(q, k, v, key_padding_mask, causal, scale)  # every block selected
    return items_over_real_keys(lambda q, k, v: _dense(q, k, v, causal, scale, query_block, key_block, options),
                                q, k, v, key_padding_mask, causal)


def items_over_real_keys(one, q, k, v, key_padding_mask, causal):
    """``one(q, k, v)`` on each item ``(1, H, n, D)`` over its real keys (self-attention: and real
    queries); a padded query position copies the last real query before it (causal: zeros where
    none is, not causal: the first real one)."""
    B, H, N, _ = q.shape
    M = k.shape[2]
    out = q.new_zeros(B, H, N, v.shape[-1])
    for b in range(B):
        keep = torch.arange(M) if key_padding_mask is None else (~key_padding_mask[b]).nonzero().squeeze(-1)
        if len(keep) == 0:
            continue
        rows = keep if N == M else torch.arange(N)
        res = one(q[b: b + 1, :, rows], k[b: b + 1, :, keep], v[b: b + 1, :, keep])
        for t in range(N):
            before = [r for r, pos in enumerate(rows.tolist()) if pos <= t]
            if before:
                out[b, :, t] = res[0, :, before[-1]]
            elif not causal:
                out[b, :, t] = res[0, :, 0]
    return out
