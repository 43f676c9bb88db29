"""block_sparse's selection: which key blocks each block of queries attends exactly.

Queries go in blocks of ``query_block`` consecutive positions, keys in blocks of ``key_block``.
Query block ``i`` (positions ``[i QB, (i + 1) QB)``) attends to a set of key blocks shared by
all its queries:

- causal: the **past** blocks are those whose every key precedes the block's first query
  (``j < i QB // KB``); of them, the first ``sinks`` and the last ``local`` always, and the
  ``num_blocks`` others that score best; then the **diagonal** blocks (overlapping the block's
  positions), inside which the causal mask applies. A block is scored by the ``query_block``
  queries *before* block ``i`` (positions ``[(i - 1) QB, i QB)``), so nothing at or after a
  query's block steers its choice, and a decoder knows a block's keys when its first token
  arrives;
- not causal: the blocks overlapping the query block's positions and ``local`` blocks on each
  side, the first ``sinks``, and the ``num_blocks`` others its own queries score best.

Scores (``score``), from each block's mean key ``m_j`` over its real keys and their count ``n_j``:

- ``"mass"``: the estimated attention mass the scoring queries give the block,
  ``sum_t softmax_j(s q_t.m_j + log n_j)``: each scoring query's weights over the candidate
  blocks (a block taken as ``n_j`` copies of its mean key), summed over the queries;
- ``"mean"``: ``s mean_t(q_t).m_j``, the block-shared form of MoBA's gate (Lu et al. 2025, "MoBA:
  Mixture of Block Attention for Long-Context LLMs", arXiv 2502.13189).

Padded keys count in no mean and no count; a block with no real key is never chosen; in
self-attention (``N == M``) queries at padded positions score nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Selection", "select_blocks", "block_means", "geometry"]

# bytes of (query, key block) scores formed at a time
_SCORE_BYTES = 1 << 26


@dataclass(frozen=True)
class Selection:
    """The key blocks of every query block: ``index`` ``(B, H, nq, L)`` key-block ids, ascending
    among the ``valid`` entries (valid entries first; the others hold 0); ``full`` ``(B, H, nq, L)``:
    every key of the block is visible to every query of the query block (no causal mask, no padded
    or missing key inside), else the block needs the per-key mask; ``count`` ``(B, H, nq)``: valid
    entries per row."""

    index: Tensor
    valid: Tensor
    full: Tensor
    count: Tensor
    query_block: int
    key_block: int


def geometry(n: int, m: int, query_block: int, key_block: int, causal: bool, local: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per query block ``(nq,)``: the first key block of its own span (``lo``), one past its last
    (``hi``), both clipped to ``[0, nk]``, and (causal) its past blocks ``past``: key blocks
    ``j < past`` precede its first query. Not causal, ``lo .. hi`` includes ``local`` blocks on
    each side and ``past`` is 0."""
    nq, nk = -(-n // query_block), -(-m // key_block)
    first = torch.arange(nq) * query_block
    last = torch.clamp(first + query_block, max=n)  # one past the block's last query
    if causal:
        past = torch.clamp(first // key_block, max=nk)
        hi = torch.clamp(-(-torch.clamp(last, max=m) // key_block), max=nk)
        return past, torch.maximum(hi, past), past
    lo = torch.clamp(first // key_block - local, min=0, max=nk)
    hi = torch.clamp(-(-last // key_block) + local, max=nk)
    return lo, torch.maximum(hi, lo), torch.zeros(nq, dtype=torch.long)


def block_means(k: Tensor, key_valid: Tensor | None, key_block: int) -> tuple[Tensor, Tensor]:
    """Mean key of each key block over its real keys ``(B, H, nk, D)`` and their count
    ``(B, 1, nk)`` (``key_valid`` ``(B, M)``: True at real keys; None: all real)."""
    B, H, M, D = k.shape
    nk = -(-M // key_block)
    pad = nk * key_block - M
    kp = torch.nn.functional.pad(k, (0, 0, 0, pad))
    if key_valid is None:
        w = torch.ones(B, M, dtype=k.dtype, device=k.device)
    else:
        w = key_valid.to(k.dtype)
    w = torch.nn.functional.pad(w, (0, pad)).view(B, 1, nk, key_block)
    count = w.sum(-1)
    total = (w.unsqueeze(-2) @ kp.view(B, H, nk, key_block, D)).squeeze(-2)
    return total / count.clamp_min(1).unsqueeze(-1), count


def _scoring_queries(q: Tensor, query_valid: Tensor | None, query_block: int, causal: bool) -> tuple[Tensor, Tensor]:
    """The queries that score each query block's candidates ``(B, H, nq, QB, D)`` and their
    weights ``(B, 1, nq, QB)`` (0 at padding and past the end): the block's own queries, or
    (causal) the ``query_block`` queries before it (none for the first block)."""
    B, H, N, D = q.shape
    nq = -(-N // query_block)
    pad = nq * query_block - N
    w = torch.ones(B, N, dtype=q.dtype, device=q.device) if query_valid is None else query_valid.to(q.dtype)
    qb = torch.nn.functional.pad(q, (0, 0, 0, pad)).view(B, H, nq, query_block, D)
    wb = torch.nn.functional.pad(w, (0, pad)).view(B, 1, nq, query_block)
    if causal:  # shift by one block: block i is scored by block i - 1's queries
        qb = torch.cat([torch.zeros_like(qb[:, :, :1]), qb[:, :, :-1]], 2)
        wb = torch.cat([torch.zeros_like(wb[:, :, :1]), wb[:, :, :-1]], 2)
    return qb, wb


def _scores(qb: Tensor, wb: Tensor, means: Tensor, count: Tensor, candidate: Tensor, score: str,
            scale: float) -> Tensor:
    """Each query block's score of each key block ``(B, H, nq, nk)``, -inf where not a candidate
    (``candidate`` ``(B, 1, nq, nk)``)."""
    B, H, nq, QB, D = qb.shape
    if score == "mean":
        qm = (wb.unsqueeze(-1) * qb).sum(-2) / wb.sum(-1, keepdim=True).clamp_min(1)
        return (scale * qm @ means.mT).masked_fill(~candidate, -math.inf)
    prior = count.clamp_min(1).log().masked_fill(count == 0, -math.inf).unsqueeze(-2)  # (B, 1, 1, nk)
    nk = means.shape[2]
    step = max(1, _SCORE_BYTES // max(1, B * H * QB * nk * qb.element_size()))
    out = []
    for a in range(0, nq, step):
        logits = scale * qb[:, :, a: a + step] @ means.unsqueeze(2).mT + prior.unsqueeze(2)
        logits = logits.masked_fill(~candidate[:, :, a: a + step].unsqueeze(-2), -math.inf)
        weights = torch.softmax(logits, -1).nan_to_num(0.0)  # a query with no candidate: zeros
        out.append((wb[:, :, a: a + step].unsqueeze(-1) * weights).sum(-2))
    mass = torch.cat(out, 2)
    return mass.masked_fill(~candidate, -math.inf)


def select_blocks(q: Tensor, k: Tensor, key_valid: Tensor | None, causal: bool, scale: float, *, query_block: int,
                  key_block: int, num_blocks: int, sinks: int, local: int, score: str) -> Selection:
    """The key blocks of every query block (see the module docstring). ``key_valid`` ``(B, M)``:
    True at real keys (None: all)."""
    B, H, N, D = q.shape
    M = k.shape[2]
    dev = q.device
    nk = -(-M // key_block)
    lo, hi, past = (t.to(dev) for t in geometry(N, M, query_block, key_block, causal, local))
    j = torch.arange(nk, device=dev)
    means, count = block_means(k, key_valid, key_block)
    has_keys = (count > 0).unsqueeze(2)  # (B, 1, 1, nk)
    if causal:
        candidate = j < past[:, None]
        forced = (j < sinks) | (j >= past[:, None] - local)
    else:
        own = (j >= lo[:, None]) & (j < hi[:, None])
        candidate = torch.ones(len(lo), nk, dtype=torch.bool, device=dev)
        forced = own | (j < sinks)
    candidate = candidate & has_keys
    forced = forced & candidate
    query_valid = key_valid if (key_valid is not None and N == M) else None
    qb, wb = _scoring_queries(q, query_valid, query_block, causal)
    s = _scores(qb, wb, means, count, candidate, score, scale)
    s = s.masked_fill(forced, -math.inf)
    # ties (a block whose scoring queries are all padding scores every candidate alike) go to the earlier block
    top, idx = (t[..., :num_blocks] for t in s.sort(dim=-1, descending=True, stable=True))
    valid = top > -math.inf
    forced = forced.expand(B, H, -1, -1)
    span = max(1, query_block // key_block)  # the most key blocks under one query block (powers of two)
    width = min(nk, sinks + (local if causal else span + 2 * local))  # static: no data-dependent shapes
    fidx = torch.where(forced, j, nk + j).argsort(-1)[..., :width]  # the forced blocks first
    idx, valid = torch.cat([fidx, idx], -1), torch.cat([forced.gather(-1, fidx), valid], -1)
    if causal:  # the diagonal blocks, with the causal mask
        diag = lo[:, None] + torch.arange(span, device=dev)  # (nq, span)
        at = diag.clamp(max=max(nk - 1, 0))
        dvalid = (diag < hi[:, None]) & (count[:, 0] > 0)[:, at]  # (B, nq, span)
        idx = torch.cat([idx, at.expand(B, H, -1, -1)], -1)
        valid = torch.cat([valid, dvalid.unsqueeze(1).expand(B, H, -1, -1)], -1)
    return _tables(idx, valid, key_valid, causal, N, M, query_block, key_block, lo)


def _tables(idx: Tensor, valid: Tensor, key_valid: Tensor | None, causal: bool, N: int, M: int, query_block: int,
            key_block: int, lo: Tensor) -> Selection:
    """Sorted tables with each entry marked full or partial."""
    B, H, nq, L = idx.shape
    nk = -(-M // key_block)
    order = torch.where(valid, idx, nk + idx).argsort(-1)
    idx, valid = idx.gather(-1, order), valid.gather(-1, order)
    idx = idx.masked_fill(~valid, 0)
    # a block with a padded or missing key, or (causal) one at or after the block's first query, is partial
    holes = torch.zeros(B, nk, dtype=torch.bool, device=idx.device)
    if M % key_block:
        holes[:, -1] = True
    if key_valid is not None:
        pad = nk * key_block - M
        kv = torch.nn.functional.pad(key_valid, (0, pad), value=True).view(B, nk, key_block)
        holes |= ~kv.all(-1)
    full = valid & ~holes.view(B, 1, 1, nk).expand(B, H, nq, nk).gather(-1, idx)
    if causal:
        full = full & (idx < lo.view(1, 1, nq, 1))
    return Selection(idx, valid, full, valid.sum(-1), query_block, key_block)
