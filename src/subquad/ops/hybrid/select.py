"""hybrid's selection: which key blocks each block of queries attends exactly.

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

Scores (``score``), from each block's mean key ``m_j`` and its count of keys ``n_j``:

- ``"mass"``: the estimated attention mass the scoring queries give the block,
  ``sum_t softmax_j(s q_t.m_j + log n_j)``: each scoring query's weights over the candidate
  blocks (a block taken as ``n_j`` copies of its mean key), summed over the queries;
- ``"mean"``: ``s mean_t(q_t).m_j``, the block-shared form of MoBA's gate (Lu et al. 2025, "MoBA:
  Mixture of Block Attention for Long-Context LLMs", arXiv 2502.13189);
- ``"mean_query"``: the attention mass the scoring queries' mean query gives the block's own keys,
  ``sum_{k in j} softmax_k(s qbar.k)`` over every candidate key (one row of logits per query
  block: ``1 / query_block`` of exact attention's products);
- ``"sampled"``: the attention mass the scoring queries give the block's own keys, each query's
  softmax taken over a strided sample of the keys (:func:`sampled_mass`: XAttention's antidiagonal
  sample, Xu et al. 2025, "XAttention: Block Sparse Attention with Antidiagonal Scoring",
  arXiv 2503.16428): every ``stride``-th key per query, so it costs ``1 / stride`` of the logits.

With ``top_p`` < 1 (Twilight's top-p, Lin et al. 2025, "Twilight: Adaptive Attention Sparsity with
Hierarchical Top-p Pruning", arXiv 2502.02770, here on blocks), the chosen blocks are pruned, best
first, to the fewest that bring the estimated share of the query block's attention held by its
forced and chosen blocks to ``top_p``; the estimate is each candidate block's share among the
candidates (:func:`estimated_share`), and the diagonal blocks are outside it (always attended).

Blocks are counted over the keys given: the op removes padding first, so each item of a padded
batch computes what it computes alone.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .._masks import masked_fill_value

__all__ = ["Selection", "select_blocks", "block_means", "geometry", "candidates", "choose_blocks", "estimated_share",
           "sampled_mass"]

# bytes of (query, key block) scores formed at a time
_SCORE_BYTES = 1 << 26


@dataclass(frozen=True)
class Selection:
    """The key blocks of every query block: ``index`` ``(B, H, nq, L)`` key-block ids, ascending
    among the ``valid`` entries (valid entries first; the others hold 0); ``full`` ``(B, H, nq, L)``:
    every key of the block is visible to every query of the query block (no causal mask inside,
    no position past the last key), else the block needs the per-key mask."""

    index: Tensor
    valid: Tensor
    full: Tensor
    query_block: int
    key_block: int


def geometry(n: int, m: int, query_block: int, key_block: int, causal: bool, local: int) -> tuple[Tensor, Tensor]:
    """Per query block ``(nq,)``, the key blocks ``lo .. hi - 1`` under it, clipped to ``[0, nk]``:
    causal, those overlapping its positions (``lo``: its first query's block, so the blocks
    ``j < lo`` precede its first query); not causal, those and ``local`` more on each side."""
    nq, nk = -(-n // query_block), -(-m // key_block)
    first = torch.arange(nq) * query_block
    last = torch.clamp(first + query_block, max=n)  # one past the block's last query
    if causal:
        lo = torch.clamp(first // key_block, max=nk)
        return lo, torch.maximum(torch.clamp(-(-torch.clamp(last, max=m) // key_block), max=nk), lo)
    lo = torch.clamp(first // key_block - local, min=0, max=nk)
    return lo, torch.maximum(torch.clamp(-(-last // key_block) + local, max=nk), lo)


def _blocks(x: Tensor, size: int) -> Tensor:
    """``(B, H, L, d)`` viewed ``(B, H, ceil(L / size), size, d)``; copied with zero rows only when
    ``L`` is not a multiple of ``size``."""
    B, H, L, d = x.shape
    n = -(-L // size)
    if n * size != L:
        x = torch.nn.functional.pad(x, (0, 0, 0, n * size - L))
    return x.view(B, H, n, size, d)


def _counts(length: int, size: int, like: Tensor) -> Tensor:
    """Positions in each block of ``size`` ``(ceil(length / size),)``; the last holds what is left."""
    start = torch.arange(0, length, size, device=like.device)
    return torch.clamp(length - start, max=size).to(like.dtype)


def block_means(k: Tensor, key_block: int) -> Tensor:
    """Mean key of each key block ``(B, H, nk, D)`` (the last block's over the keys it has)."""
    return _blocks(k, key_block).sum(-2) / _counts(k.shape[2], key_block, k).unsqueeze(-1)


def sampled_mass(q: Tensor, k: Tensor, scale: float, *, query_block: int, key_block: int, stride: int,
                 causal: bool, offset: int = 0) -> Tensor:
    """``(B, H, nq, nk)``: for each block of ``query_block`` queries of q ``(B, H, n, D)`` (the
    first at position ``offset``, a multiple of ``query_block``), the summed weights its queries
    give each block of ``key_block`` keys of k ``(B, H, M, D)`` (keys at positions ``0 .. M - 1``)
    when each query's softmax reads only a sample of the keys: query ``t`` reads key ``j`` when
    ``t mod S + j mod S = S - 1`` (the antidiagonals of ``S x S`` tiles: every ``S``-th key per
    query, every ``S``-th query per key) and, causal, ``j <= t``; a query that reads nothing gives
    nothing. ``S`` is ``stride``, at most both block sizes (powers of two; a larger stride is taken
    as the smaller block size).

    Computed by residue: the queries ``t = a S + r`` all read the keys ``j = c S + S - 1 - r``, one
    matrix product per ``r``; ``n M D / S`` multiply-adds (causal: about half)."""
    B, H, n, D = q.shape
    M = k.shape[2]
    S = min(stride, query_block, key_block)
    nq, nk = -(-n // query_block), -(-M // key_block)
    qr = (_blocks(q, S) * scale).transpose(2, 3).contiguous()  # (B, H, S, A, D): row a of residue r, query a S + r
    kr = _blocks(k, S).flip(3).transpose(2, 3).contiguous()  # (B, H, S, C, D): column c of r, key c S + S - 1 - r
    A, C = qr.shape[3], kr.shape[3]
    qa, kc = query_block // S, key_block // S
    r = torch.arange(S, device=q.device).view(S, 1, 1)
    out = q.new_zeros(B, H, nq, nk)
    # causal: one query block at a time (keys up to its end); else as many as _SCORE_BYTES allows
    step = qa if causal else qa * max(1, _SCORE_BYTES // max(1, B * H * query_block * C * q.element_size()))
    for a0 in range(0, A, step):
        a1 = min(A, a0 + step)
        t = offset + torch.arange(a0, a1, device=q.device).view(1, -1, 1) * S + r  # (S, a, 1)
        c1 = min(C, (offset + a1 * S - 1) // S + 1) if causal else C  # no key past the chunk's last query
        w = torch.matmul(qr[:, :, :, a0:a1], kr[:, :, :, :c1].mT)  # (B, H, S, a, c) logits
        # before column ``tail`` every key is real and (causal) before the chunk's first query
        tail = min(c1, M // S, offset // S + a0 if causal else c1)
        if tail < c1:
            j = torch.arange(tail, c1, device=q.device).view(1, 1, -1) * S + (S - 1 - r)  # (S, 1, c - tail)
            w[..., tail:].masked_fill_(~((j < M) & (j <= t)) if causal else ~(j < M), -math.inf)
        w = w.sub_(w.amax(-1, keepdim=True)).exp_()  # unnormalised weights; NaN in a row that reads nothing
        whole = c1 // kc * kc
        sums = w[..., :whole].view(*w.shape[:-1], whole // kc, kc).sum(-1)  # (B, H, S, a, key blocks)
        if whole < c1:
            sums = torch.cat([sums, w[..., whole:].sum(-1, keepdim=True)], -1)
        sums = (sums / sums.sum(-1, keepdim=True)).nan_to_num_(0.0)
        sums = sums.masked_fill_(t >= offset + n, 0.0).sum(2)  # (B, H, a, key blocks): past the end, nothing
        sums = torch.nn.functional.pad(sums, (0, 0, 0, -(a1 - a0) % qa))
        sums = sums.view(B, H, sums.shape[2] // qa, qa, sums.shape[-1]).sum(3)
        out[:, :, a0 // qa: a0 // qa + sums.shape[2], : sums.shape[3]] += sums
    return out


def _scoring_means(q: Tensor, query_block: int, causal: bool) -> Tensor:
    """``(B, H, nq, D)``: the mean of each query block's scoring queries: its own, or (causal)
    block ``i - 1``'s (zeros for block 0)."""
    qm = _blocks(q, query_block).sum(-2) / _counts(q.shape[2], query_block, q).unsqueeze(-1)
    return torch.cat([torch.zeros_like(qm[:, :, :1]), qm[:, :, :-1]], 2) if causal else qm


def _mean_query_mass(q: Tensor, k: Tensor, candidate: Tensor, scale: float, query_block: int, key_block: int,
                     causal: bool) -> Tensor:
    """``(B, H, nq, nk)``: the softmax weights of each query block's mean scoring query over every
    key of its candidate blocks, summed per block (-inf where not a candidate)."""
    B, H, N, D = q.shape
    M = k.shape[2]
    qm = scale * _scoring_means(q, query_block, causal)
    kb = _blocks(k, key_block)  # (B, H, nk, KB, D)
    nq, nk, KB = qm.shape[2], kb.shape[2], kb.shape[3]
    keys = kb.flatten(2, 3).mT  # (B, H, D, nk KB), a view
    real = (torch.arange(nk * KB, device=q.device) < M).view(nk, KB)
    step = max(1, _SCORE_BYTES // max(1, B * H * nk * KB * q.element_size()))
    out = []
    for a in range(0, nq, step):
        logits = torch.matmul(qm[:, :, a: a + step], keys)
        c = logits.shape[2]
        # the softmax in place (a fresh tensor of this size costs more than the passes), summed per
        # block; a logit more than 80 below its row's largest weighs exp(-80) ~ 2e-35 of it, not less
        # (exp is several times slower on -inf and on float32's subnormal results, below about -87)
        w = logits.view(B, H, c, nk, KB).masked_fill_(~(candidate[a: a + step, :, None] & real), -math.inf)
        w = w.sub_(w.amax((-2, -1), keepdim=True)).clamp_(min=-80.0).exp_().sum(-1)
        out.append(w.div_(w.sum(-1, keepdim=True)).nan_to_num_(0.0))  # a block without candidates: 0
    return torch.cat(out, 2).masked_fill(~candidate, -math.inf)


def _scores(q: Tensor, k: Tensor, candidate: Tensor, score: str, scale: float, query_block: int, key_block: int,
            causal: bool, stride: int) -> Tensor:
    """Each query block's score of each key block ``(B, H, nq, nk)``, -inf where not a candidate
    (``candidate`` ``(nq, nk)``). The scoring queries of block ``i`` are its own, or (causal) those
    of block ``i - 1`` (none for block 0). No copy of ``q`` when ``N`` is a multiple of ``query_block``."""
    B, H, N, D = q.shape
    M = k.shape[2]
    if score == "sampled":
        if not causal:
            return sampled_mass(q, k, scale, query_block=query_block, key_block=key_block, stride=stride,
                                causal=False).masked_fill(~candidate, -math.inf)
        s = sampled_mass(q[:, :, : (-(-N // query_block) - 1) * query_block], k, scale, query_block=query_block,
                         key_block=key_block, stride=stride, causal=True)
        return torch.cat([s.new_zeros(B, H, 1, s.shape[3]), s], 2).masked_fill(~candidate, -math.inf)
    if score == "mean_query":
        return _mean_query_mass(q, k, candidate, scale, query_block, key_block, causal)
    means, key_count = block_means(k, key_block), _counts(M, key_block, q)
    qb = _blocks(q, query_block)
    nq, nk = qb.shape[2], means.shape[2]
    if score == "mean":
        return (scale * _scoring_means(q, query_block, causal) @ means.mT).masked_fill(~candidate, -math.inf)
    # logit of block j for query t: s q_t.m_j + log n_j, a large finite negative value where j is no
    # candidate (so a query with none has finite weights; its block's scores are masked below)
    bias = key_count.log() + (~candidate).to(q.dtype) * masked_fill_value(q.dtype)  # (nq, nk)
    if causal:  # block i's candidates, scored by block i - 1's queries: rows 1 .. nq - 1
        qb, bias = qb[:, :, :-1], bias[1:]
    keys = (scale * means).mT.unsqueeze(2)  # (B, H, 1, D, nk)
    rows = qb.shape[2]
    short = N % query_block and not causal  # the last block's zero rows past the end must not score
    step = max(1, _SCORE_BYTES // max(1, B * H * query_block * nk * q.element_size()))
    out = [torch.zeros(B, H, nq - rows, nk, dtype=q.dtype, device=q.device)]
    for a in range(0, rows, step):
        logits = torch.matmul(qb[:, :, a: a + step], keys).add_(bias[a: a + step].unsqueeze(-2))
        weights = torch.softmax(logits, -1)  # (B, H, c, QB, nk): each scoring query's mass over the blocks
        if short and a + step >= rows:
            weights[:, :, -1, N % query_block:] = 0
        out.append(weights.sum(-2))
    return torch.cat(out, 2).masked_fill(~candidate, -math.inf)


def past_blocks(num_blocks: int, sinks: int, local: int) -> int:
    """The key blocks a causal query block attends before its own positions: the ``sinks`` first,
    the ``local`` last and ``num_blocks`` chosen. A query block with at most this many key blocks
    before it attends to all of them (the exact prefix); every form of the op and the decoding
    state use this one rule."""
    return sinks + local + num_blocks


def candidates(n: int, m: int, causal: bool, *, query_block: int, key_block: int, sinks: int, local: int,
               device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(lo, hi, candidate, forced)`` of every query block of ``n`` queries over ``m`` keys: the
    key blocks under it (:func:`geometry`), which key blocks it may choose ``(nq, nk)`` and which it
    always attends ``(nq, nk)``. They depend on the sizes alone: kept per device for the last few
    sizes (a GPU call then launches no kernels and copies nothing from the host for them); callers
    must not write to them."""
    args = (n, m, causal, query_block, key_block, sinks, local, torch.device(device))
    if torch.compiler.is_compiling():
        return _candidates(*args)
    return _cached_candidates(*args)


def _candidates(n, m, causal, query_block, key_block, sinks, local, device):
    nk = -(-m // key_block)
    lo, hi = (t.to(device) for t in geometry(n, m, query_block, key_block, causal, local))
    j = torch.arange(nk, device=device)
    if causal:  # the blocks before the query block's first query
        candidate = j < lo[:, None]
        forced = candidate & ((j < sinks) | (j >= lo[:, None] - local))
    else:
        candidate = torch.ones(len(lo), nk, dtype=torch.bool, device=device)
        forced = ((j >= lo[:, None]) & (j < hi[:, None])) | (j < sinks)
    return lo, hi, candidate, forced


@functools.lru_cache(maxsize=32)
def _cached_candidates(*args):
    with torch.inference_mode(False), torch.no_grad():  # usable later under autograd as under inference
        return _candidates(*args)


def select_blocks(q: Tensor, k: Tensor, causal: bool, scale: float, *, query_block: int, key_block: int,
                  num_blocks: int, sinks: int, local: int, score: str, top_p: float = 1.0,
                  stride: int = 8) -> Selection:
    """The key blocks of every query block (see the module docstring; ``stride``: the ``"sampled"``
    score's, :func:`sampled_mass`)."""
    N, M = q.shape[2], k.shape[2]
    lo, hi, candidate, forced = candidates(N, M, causal, query_block=query_block, key_block=key_block, sinks=sinks,
                                           local=local, device=q.device)
    s = _scores(q, k, candidate, score, scale, query_block, key_block, causal, stride)
    return choose_blocks(s, M, lo, hi, candidate, forced, causal, query_block=query_block, key_block=key_block,
                         num_blocks=num_blocks, sinks=sinks, local=local, score=score, top_p=top_p)


def estimated_share(s: Tensor, candidate: Tensor, m: int, key_block: int, score: str) -> Tensor:
    """Each candidate block's estimated share of its query block's attention among the candidates
    ``(B, H, nq, nk)`` (0 elsewhere), from scores ``s``: ``"mean"``, the softmax over the candidates
    of ``s_j + log n_j`` (a block as ``n_j`` copies of its mean key); ``"mass"``, ``"mean_query"``
    and ``"sampled"``, the scores (already summed softmax weights) over their sum."""
    if score == "mean":
        share = torch.softmax((s + _counts(m, key_block, s).log()).masked_fill(~candidate, -math.inf), -1)
    else:
        share = s.masked_fill(~candidate, 0.0)
        share = share / share.sum(-1, keepdim=True)
    return share.nan_to_num(0.0)  # a query block without candidates


def choose_blocks(s: Tensor, m: int, lo: Tensor, hi: Tensor, candidate: Tensor, forced: Tensor, causal: bool, *,
                  query_block: int, key_block: int, num_blocks: int, sinks: int, local: int, score: str = "mean",
                  top_p: float = 1.0) -> Selection:
    """The selection of query blocks with scores ``s`` ``(B, H, nq, nk)`` (of kind ``score``) over
    the key blocks of ``m`` keys and the rows of :func:`candidates` for them: the forced blocks, the
    ``num_blocks`` best-scored other candidates (with ``top_p`` < 1, pruned as the module docstring
    says), and (causal) the diagonal ones."""
    B, H = s.shape[:2]
    dev = s.device
    nk = s.shape[-1]
    j = torch.arange(nk, device=dev)
    scores, s = s, s.masked_fill(~candidate, -math.inf).masked_fill(forced, -math.inf)
    # ties (as when every score is 0) go to the earlier block
    top, idx = (t[..., :num_blocks] for t in s.sort(dim=-1, descending=True, stable=True))
    valid = top > -math.inf
    if top_p < 1:  # keep the best while the share held before them is below top_p
        share = estimated_share(scores, candidate, m, key_block, score)
        ranked = share.gather(-1, idx)
        held = (share * forced).sum(-1, keepdim=True) + ranked.cumsum(-1) - ranked
        valid = valid & (held < top_p)
    span = max(1, query_block // key_block)  # the most key blocks under one query block (powers of two)
    width = min(nk, sinks + (local if causal else span + 2 * local))  # static: no data-dependent shapes
    fidx = torch.where(forced, j, nk + j).argsort(-1)[..., :width]  # the forced blocks first
    idx = torch.cat([fidx.expand(B, H, -1, -1), idx], -1)
    valid = torch.cat([forced.gather(-1, fidx).expand(B, H, -1, -1), valid], -1)
    if causal:  # the diagonal blocks, with the causal mask
        diag = lo[:, None] + torch.arange(span, device=dev)  # (nq, span)
        idx = torch.cat([idx, diag.clamp(max=max(nk - 1, 0)).expand(B, H, -1, -1)], -1)
        valid = torch.cat([valid, (diag < hi[:, None]).expand(B, H, -1, -1)], -1)
    order = torch.where(valid, idx, nk + idx).argsort(-1)
    idx, valid = idx.gather(-1, order), valid.gather(-1, order)
    idx = idx.masked_fill(~valid, 0)
    full = valid & ((idx + 1) * key_block <= m)
    if causal:
        full = full & (idx < lo.view(-1, 1))
    return Selection(idx, valid, full, query_block, key_block)
