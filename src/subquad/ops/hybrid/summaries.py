"""hybrid's coarse summaries and the softmax that combines them with the exact keys.

A coarse group ``c`` enters a query's softmax as one column: its count ``n'`` and mean key and
value over the keys of ``c`` the query does not attend exactly, weighted ``n' exp(s q.k')``.
Non-causal, the groups are the key tree's nodes at depth ``log2(num_summaries)``; causal, runs
of key ranks, and a query summarises only the keys before its window (the group holding the
window start enters with its part before it, from prefix sums)."""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["tree_summaries", "causal_summaries", "causal_group_size", "combine"]


def _group_sums(k: Tensor, v: Tensor, valid: Tensor, size: int):
    """Count ``(B, H, G, size, 1)``, keys and values ``(B, H, G, size, D)`` of consecutive
    groups of ``size`` rows, zero at invalid rows."""
    B, H, S, _ = k.shape
    w = valid.to(k.dtype).unsqueeze(-1)
    G = S // size
    return w.view(B, H, G, size, 1), (k * w).view(B, H, G, size, -1), (v * w).view(B, H, G, size, -1)


def tree_summaries(q: Tensor, ko: Tensor, vo: Tensor, slot_valid: Tensor, num_summaries: int, scale: float,
                   sizes: list[int]) -> Callable:
    """Non-causal: ``q`` ``(B, H, N, D)``, keys and values in slot order; the groups are runs of
    ``S / num_summaries`` slots. Returns ``columns(i, pos, ok, egroup)``, what :func:`combine`
    takes for run ``i`` of the query rows (``sizes``: rows per run, in order) and its exact keys
    (every exact key leaves its group). Split, not sliced per run: a slice's backward fills a
    gradient the size of the whole."""
    cnt, ks, vs = _group_sums(ko, vo, slot_valid, ko.shape[2] // num_summaries)
    qk = ((q @ ks.sum(3).transpose(-2, -1)) * scale).split(sizes, 2)
    count, vsum = cnt.sum(3).squeeze(-1).unsqueeze(2), vs.sum(3)

    def columns(i, pos, ok, egroup):
        return qk[i], count, ok, egroup, lambda pc: pc @ vsum

    return columns


def causal_group_size(M: int, num_summaries: int, block_size: int) -> int:
    """Key ranks per causal coarse group: ``M`` split into ``num_summaries`` runs of whole leaves."""
    return -(-M // (num_summaries * block_size)) * block_size


def causal_summaries(q: Tensor, k: Tensor, v: Tensor, lo: Tensor, num_summaries: int, block_size: int,
                     scale: float, sizes: list[int]) -> Callable:
    """Causal: keys and values by rank ``(B, H, M, .)``; the summarised region of query ``i`` is
    the keys before its window, ``[0, a_i)`` with ``a_i = max(lo_i, 0)``. Groups that end by
    ``a_i`` enter whole; the group holding ``a_i`` enters with its part before ``a_i`` as an
    extra column ``G``. Only selected keys (all before ``a_i``) leave a summary. Returns
    ``columns(i, pos, ok, egroup)`` for run ``i`` of the query rows (``sizes``), as
    :func:`tree_summaries`."""
    M = k.shape[2]
    size = causal_group_size(M, num_summaries, block_size)
    extra = size * num_summaries - M
    valid = (torch.arange(M + extra, device=k.device) < M).expand(*k.shape[:2], -1)
    cnt, ks, vs = _group_sums(F.pad(k, (0, 0, 0, extra)), F.pad(v, (0, 0, 0, extra)), valid, size)
    G = num_summaries
    a = lo.clamp_min(0)
    g_a = (a // size).clamp_max(G - 1)
    r_a = a - g_a * size  # up to ``size``: the whole last group when ``a`` is past it (window 0)
    full = torch.arange(G, device=q.device)[None, :] < g_a[:, None]  # (N, G)
    pre_c, pre_k, pre_v = (F.pad(t.cumsum(3), (0, 0, 1, 0)) for t in (cnt, ks, vs))
    part_c, part_k, part_v = (t[:, :, g_a, r_a] for t in (pre_c, pre_k, pre_v))  # (B, H, N, .)
    tot_k, tot_v = ks.sum(3), vs.sum(3)
    qk = torch.cat([q @ tot_k.transpose(-2, -1), (q * part_k).sum(-1, keepdim=True)], dim=-1) * scale
    count = torch.cat([cnt.sum(3).squeeze(-1).unsqueeze(2) * full, part_c], dim=-1)

    qk, count, part_v = (t.split(sizes, 2) for t in (qk, count, part_v))
    a, g_a = a.split(sizes), g_a.split(sizes)

    def columns(i, pos, ok, egroup):
        egroup = torch.where(egroup == g_a[i][:, None], G, egroup)
        sub = ok & (pos < a[i][:, None])

        def values(pc):
            return pc[..., :G] @ tot_v + pc[..., G:] * part_v[i]

        return qk[i], count[i], sub, egroup, values

    return columns


def combine(logits, exact_values, ok, sub, egroup, qk, count, values):
    """Softmax over the exact keys and the summaries.

    ``logits`` ``(B, H, N, E)`` of the exact keys (``ok``: real ones); ``exact_values(w)`` maps
    their weights to ``sum_j w_j v_j``; ``qk`` ``(B, H, N, G)``: scaled ``q . (key sum)`` of
    each summary column before taking out exact keys, ``count`` ``(B, H, N or 1, G)`` its keys;
    ``sub`` marks exact keys to take out of their column ``egroup``; ``values(p)`` maps column
    weights ``(B, H, N, G)`` to ``sum_c p_c (value sum of c)``. A summary's logit is the mean
    logit of what is left in it."""
    subf = sub.to(logits.dtype)
    zeros = torch.zeros_like(qk)
    rest = count - zeros.scatter_add(-1, egroup, subf)
    lc = (qk - zeros.scatter_add(-1, egroup, logits * subf)) / rest.clamp_min(1.0)
    lc = lc.masked_fill(rest < 0.5, -math.inf)
    le = logits.masked_fill(~ok, -math.inf)
    m = torch.maximum(le.amax(-1, keepdim=True), lc.amax(-1, keepdim=True)).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    pe, pc = torch.exp(le - m), torch.exp(lc - m)
    we = pe - pc.gather(-1, egroup) * subf  # exact keys out of their summary's value sum
    num = exact_values(we) + values(pc)
    den = pe.sum(-1, keepdim=True) + (pc * rest.clamp_min(0.0)).sum(-1, keepdim=True)
    return num / torch.where(den > 0, den, torch.ones_like(den))
