"""hybrid's forward in torch: for every block of queries, one gather of its window keys, recent
keys (causal) and candidate leaves' keys, one product that gives every logit it needs, the
selection from those logits, and the softmax with the summaries. Runs on any device, under
autograd (gradients through everything but the discrete choice) and ``torch.compile``."""

from __future__ import annotations

import dataclasses

import math

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.profiler import record_function

from . import options as _options
from .index import KeyIndex, build_index, flat_rows, largest, rows
from .options import HybridPlan
from .select import descend, leaf_scores, sealed_ends
from .summaries import causal_group_size, causal_summaries, combine, tree_summaries

__all__ = ["window_starts", "hybrid_core", "runs"]


def window_starts(N: int, M: int, valid: Tensor | None, w: int, causal: bool) -> list[int]:
    """First key rank of each query's window (plain integers, so that ``torch.compile`` sees fixed
    sizes); ranks count the real keys (padding removed). Causal: the window is the ``w`` real
    keys up to the query's position (the start may be negative); else the ``w`` real keys around
    the position ``(2 i + 1) M / 2 N``, kept inside ``[0, real keys)``. Never decreases with the
    query. ``valid`` ``(M,)``: the real key positions (None: all)."""
    if valid is None:
        if causal:
            return [min(i + 1, M) - w for i in range(N)]
        return [min(max((2 * i + 1) * M // (2 * N) - w // 2, 0), max(M - w, 0)) for i in range(N)]
    i = torch.arange(N, device=valid.device)
    before = F.pad(valid.long().cumsum(0), (1, 0))  # real keys before each position
    if causal:
        return (before[(i + 1).clamp_max(M)] - w).tolist()
    rank = before[(2 * i + 1) * M // (2 * N)]
    return (rank - w // 2).clamp(0, max(int(before[-1]) - w, 0)).tolist()


class _Scratch:
    """Scratch tensors reused by the runs of one forward when autograd keeps nothing: a fresh
    tensor of a run's size costs page faults comparable to the work done on it (measured:
    a 6.7 MB zero fill 18 ms fresh, well under 1 ms reused). ``get`` returns None when the
    forward is tracked."""

    def __init__(self, enabled: bool):
        self.enabled, self.store = enabled, {}

    def get(self, name: str, shape: tuple[int, ...], like: Tensor) -> Tensor | None:
        if not self.enabled:
            return None
        n = math.prod(shape)
        buf = self.store.get(name)
        if buf is None or buf.numel() < n:
            buf = self.store[name] = like.new_empty(n)
        return buf[:n].view(shape)


def _extend(x: Tensor, n: int, dim: int) -> Tensor:
    """``x`` lengthened to ``n`` along ``dim`` by repeating its last entry."""
    extra = n - x.shape[dim]
    if extra == 0:
        return x
    last = x.narrow(dim, x.shape[dim] - 1, 1)
    return torch.cat([x, last.expand(*x.shape[:dim], extra, *x.shape[dim + 1:])], dim)


def runs(lo: list[int], sealed: list[int] | None, p: HybridPlan, qb: int, cand_keys: int,
         row_bytes: int) -> list[tuple[slice, int, int]]:
    """Runs of query blocks attended together, each with ``U`` (window ranks that cover its
    blocks' windows, from each block's first window start) and ``R`` (causal: recent ranks from
    each block's sealed end, whole leaves); a run's gathered keys and values take about
    ``CHUNK_BYTES`` per (batch, head). ``lo``: window start of every (padded) query; plain
    integers, so that ``torch.compile`` sees fixed sizes."""
    nb = len(lo) // qb
    first = [lo[b * qb] for b in range(nb)]
    span = [lo[b * qb + qb - 1] - first[b] + p.window for b in range(nb)]
    bs = p.block_size
    recent = [0] * nb if sealed is None else [-(-max(lo[b * qb + qb - 1] - sealed[b], 0) // bs) * bs
                                              for b in range(nb)]
    step = max(1, _options.CHUNK_BYTES // ((max(span) + max(recent) + cand_keys) * row_bytes))
    return [(slice(b, min(b + step, nb)), max(span[b: b + step]), max(recent[b: b + step]))
            for b in range(0, nb, step)]


def hybrid_core(q: Tensor, k: Tensor, v: Tensor, lo: list[int], causal: bool, scale: float, p: HybridPlan) -> Tensor:
    """Hybrid attention of queries ``q`` ``(B, H, N, D)`` over real keys ``k``, ``v`` ``(B, H, M, .)``
    in rank order, the window of query ``i`` starting at rank ``lo[i]`` (:func:`window_starts`).
    Its stages are named for ``torch.profiler`` (``hybrid.index``, ``hybrid.descend``,
    ``hybrid.summaries``, ``hybrid.attend``; ``benchmarks/hybrid_profile.py``)."""
    B, H, N, D = q.shape
    M = k.shape[2]
    qb = _options.QUERY_BLOCK
    nq = -(-N // qb) * qb
    with torch.no_grad(), record_function("hybrid.index"):
        index = build_index(k.detach(), p)
        order = index.order.clamp_max(M - 1)
    ko, vo = rows(k, order), rows(v, order)  # empty slots repeat the last key: masked wherever used
    lo_list = lo + lo[-1:] * (nq - N)
    qp, lop = _extend(q, nq, 2), torch.tensor(lo_list, device=q.device)
    sealed_list = [sealed_ends(x, p) for x in lo_list[::qb]] if causal else None
    sealed = None if sealed_list is None else torch.tensor(sealed_list, device=q.device)
    with torch.no_grad(), record_function("hybrid.descend"):
        leaf, leaf_ok = descend(_descent_queries(qp.detach(), qb, causal), index, sealed, p, scale)
        own = _own_leaves(qp.detach(), index, sealed, leaf, leaf_ok, p, scale) if p.query_beam else None
        if causal:
            group_of = None
        else:  # the coarse group of every key rank: invert the slot order
            slot_group = (torch.arange(p.slots, device=q.device) // (p.slots // p.num_summaries)).expand_as(index.order)
            group_of = torch.empty_like(index.order).scatter_(2, index.order, slot_group)[..., :M]
    row_bytes = (D + v.shape[-1]) * q.element_size()
    cand_keys = (leaf.shape[-1] + (0 if own is None else qb * own[0].shape[-1])) * p.block_size
    run_list = runs(lo_list, sealed_list, p, qb, cand_keys, row_bytes)
    sizes = [(blocks.stop - blocks.start) * qb for blocks, _, _ in run_list]
    with record_function("hybrid.summaries"):
        if causal:
            summaries = causal_summaries(qp, k, v, lop, p.num_summaries, p.block_size, scale, sizes)
        else:
            summaries = tree_summaries(qp, ko, vo, index.slot_valid, p.num_summaries, scale, sizes)
    keys, values = torch.cat([k, ko], 2), torch.cat([v, vo], 2)
    tracked = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    scratch = _Scratch(not torch.compiler.is_compiling() and not tracked)
    ctx = (p, scale, causal, index, group_of, summaries, scratch, M)
    plans = []
    with torch.no_grad():
        for i, (blocks, U, R) in enumerate(run_list):
            rq = slice(blocks.start * qb, blocks.stop * qb)
            plans.append(_run_rows(ctx, lop, leaf[:, :, blocks], leaf_ok[:, :, blocks],
                                   None if sealed is None else sealed[blocks], i, blocks, U, R,
                                   None if own is None else (own[0][:, :, rq], own[1][:, :, rq])))
    # one gather for all runs only where its gradient is wanted: else each run's rows can go
    batched = torch.is_grad_enabled() and (k.requires_grad or v.requires_grad)
    gathered = _gather_runs(keys, values, plans, scratch, batched)
    outs = []
    for run_rows, q_run, gathered_rows in zip(plans, qp.split(sizes, 2), gathered):  # split: see tree_summaries
        with record_function("hybrid.attend"):
            outs.append(_attend(ctx, q_run, lop, run_rows, *gathered_rows))
    return torch.cat(outs, 2)[:, :, :N]


@dataclasses.dataclass
class _RunRows:
    """What a run of query blocks gathers: ``idx`` ``(B, H, nb, E)`` rows (into ``[keys by rank;
    keys by slot]``) of its window (the first ``U``) and candidate keys, the candidates' ranks
    and validity (slot-major, ``L`` leaves), and per query its own leaves' rows, ranks and validity
    (``query_beam``; None without). ``run``: its position among the runs."""

    run: int
    blocks: slice
    U: int
    L: int
    idx: Tensor
    crank: Tensor
    cok: Tensor
    own: tuple[Tensor, Tensor, Tensor] | None


def _run_rows(ctx, lo: Tensor, leaf: Tensor, leaf_ok: Tensor, sealed: Tensor | None, run: int, blocks: slice, U: int,
              R: int, own=None) -> _RunRows:
    """The rows the query blocks ``blocks`` gather (:class:`_RunRows`)."""
    p, _, _, index, _, _, _, M = ctx
    qb = _options.QUERY_BLOCK
    B, H = leaf.shape[:2]
    nbk = blocks.stop - blocks.start
    first = lo[blocks.start * qb: blocks.stop * qb].view(nbk, qb)[:, :1]
    wrow = (first + torch.arange(U, device=lo.device)).clamp(0, M - 1).expand(B, H, nbk, U)
    crow, crank, cok = _candidates(index, M, leaf, leaf_ok, sealed, R, p)
    if own is not None:
        own = _tree_rows(index, M, own[0].unflatten(2, (nbk, qb)), own[1].unflatten(2, (nbk, qb)), p)
    return _RunRows(run, blocks, U, crow.shape[-1], torch.cat([wrow, crow.flatten(-2)], -1), crank, cok, own)


class _RowsOfRuns(torch.autograd.Function):
    """Rows ``x[i]`` of ``x`` ``(n, D)`` for each index vector ``i`` of ``idx``, whose backward
    adds every output's gradient into one tensor the size of ``x`` (a gather per run would
    zero-fill and sum one such tensor per run: a third of the backward at N = 16384)."""

    @staticmethod
    def forward(ctx, x: Tensor, *idx: Tensor) -> tuple[Tensor, ...]:
        ctx.save_for_backward(*idx)
        ctx.set_materialize_grads(False)  # a run whose rows get no gradient adds nothing
        ctx.rows = x.shape[0]
        return tuple(x.index_select(0, i) for i in idx)

    @staticmethod
    def backward(ctx, *grads: Tensor):
        idx = ctx.saved_tensors
        out = None
        for i, g in zip(idx, grads):
            if g is not None:
                out = g.new_zeros(ctx.rows, g.shape[-1]) if out is None else out
                out.index_add_(0, i, g)
        return (out,) + (None,) * len(idx)


def _gather_runs(keys: Tensor, values: Tensor, plans: list[_RunRows], scratch: _Scratch, batched: bool):
    """Per run, its window and candidate keys and values ``(B, H, nb, E, .)`` and its queries'
    own leaves' ``(B, H, nb, QB, bs Lo, .)`` (None without): ``batched``, every run's at once
    through :class:`_RowsOfRuns`; else run by run, into reused scratch where it is enabled. A
    generator to consume one run at a time: a run's rows may overwrite the previous run's."""
    idx = [[pl.idx] + ([] if pl.own is None else [pl.own[0].flatten(-2)]) for pl in plans]
    if batched:
        flat = [flat_rows(keys, i) for run in idx for i in run]
        got = iter(zip(*(_RowsOfRuns.apply(x.reshape(-1, x.shape[-1]), *flat) for x in (keys, values))))
        for run in idx:
            kv = [next(got) for _ in run]
            kx, vx = (t.view(*run[0].shape, t.shape[-1]) for t in kv[0])
            yield kx, vx, None if len(run) == 1 else tuple(t.view(*run[1].shape, t.shape[-1]) for t in kv[1])
        return
    for run in idx:
        kx, vx = (rows(x, run[0], scratch.get(name, (*run[0].shape, x.shape[-1]), x))
                  for name, x in (("keys", keys), ("values", values)))
        yield kx, vx, None if len(run) == 1 else (rows(keys, run[1]), rows(values, run[1]))


def _descent_queries(q: Tensor, qb: int, causal: bool) -> Tensor:
    """The queries each block's descent scores nodes for, ``(B, H, nb, qb, D)``: the block's own;
    causal, the ``qb`` queries that end at the block's first one (none of them later than any
    query of the block, so nothing later steers a choice, and a decoder can run the descent of
    a block when its first query arrives)."""
    if not causal:
        return q.unflatten(2, (-1, qb))
    first = torch.arange(0, q.shape[2], qb, device=q.device)
    idx = (first[:, None] + torch.arange(1 - qb, 1, device=q.device)).clamp_min(0)
    return q[:, :, idx]


def _own_leaves(q: Tensor, index: KeyIndex, sealed: Tensor | None, leaf: Tensor, leaf_ok: Tensor, p: HybridPlan,
                scale: float) -> tuple[Tensor, Tensor]:
    """``query_beam``: the leaves each query ``q`` ``(B, H, nq, D)`` ends on when it descends
    the tree alone (that beam, from its block's start level) within its block's sealed region:
    first slots ``(B, H, nq, L)`` and whether each may be chosen, False for a leaf its block's
    descent (``leaf``, ``leaf_ok``) found."""
    B, H, nq, _ = q.shape
    nb, bs = leaf.shape[2], p.block_size
    own, ok = descend(q.unsqueeze(3), index, None if sealed is None else sealed.repeat_interleave(nq // nb),
                      dataclasses.replace(p, beam=p.query_beam), scale)
    found = torch.zeros(B, H, nb, p.slots // bs, dtype=torch.bool, device=q.device)
    found.scatter_(-1, leaf // bs, leaf_ok)
    dup = found.gather(-1, (own // bs).view(B, H, nb, -1)).view(own.shape)
    return own, ok & ~dup


def _tree_rows(index: KeyIndex, M: int, leaf: Tensor, leaf_ok: Tensor, p: HybridPlan) -> tuple[Tensor, Tensor, Tensor]:
    """Rows (into ``[keys by rank; keys by slot]``), ranks and validity of the keys of tree leaves
    ``leaf`` ``(B, H, *shape, L)`` (first slots), slot-major ``(B, H, *shape, bs, L)``; a sink key
    is never valid here (it is a candidate through its sink leaf)."""
    slot = leaf.unsqueeze(-2) + torch.arange(p.block_size, device=leaf.device)[:, None]
    flat = slot.flatten(2)
    rank = index.order.gather(2, flat).view(slot.shape)
    ok = index.slot_valid.gather(2, flat).view(slot.shape) & leaf_ok.unsqueeze(-2) & (rank >= p.sinks * p.block_size)
    return M + slot, rank, ok


def _candidates(index: KeyIndex, M: int, leaf: Tensor, leaf_ok: Tensor, sealed: Tensor | None, R: int,
                p: HybridPlan):
    """Rows (into ``[keys by rank; keys by slot]``), ranks and validity of a run's candidate keys
    ``(B, H, nb, bs, L)``, slot-major: the sink leaves (the first ranks), the recent leaves (ranks
    from ``sealed``, causal), then the tree's candidate leaves; a sink key is a candidate through
    its sink leaf only."""
    bs, dev = p.block_size, leaf.device
    sink_keys = p.sinks * bs
    t = torch.arange(bs, device=dev)
    B, H, nb = leaf.shape[:3]
    row, rank, ok = _tree_rows(index, M, leaf, leaf_ok, p)
    by_rank = []
    if sink_keys:
        by_rank.append((t[:, None] + torch.arange(0, sink_keys, bs, device=dev)).expand(nb, bs, -1))
    if R:
        by_rank.append(sealed.view(-1, 1, 1) + t[:, None] + torch.arange(0, R, bs, device=dev))  # (nb, bs, R / bs)
    if by_rank:
        r = torch.cat(by_rank, -1).expand(B, H, nb, bs, -1)
        sink = (torch.arange(r.shape[-1], device=dev) < p.sinks).repeat(bs).view(bs, -1)
        row, rank = torch.cat([r.clamp_max(M - 1), row], -1), torch.cat([r, rank], -1)
        ok = torch.cat([(r < M) & (sink | (r >= sink_keys)), ok], -1)
    return row, rank, ok


def _attend(ctx, q: Tensor, lo: Tensor, pl: _RunRows, kx: Tensor, vx: Tensor,
            own_rows: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Outputs ``(B, H, nb * QB, Dv)`` of a run's query blocks ``q`` ``(B, H, nb * QB, D)``, their
    rows ``pl`` gathered into ``kx``, ``vx`` (and ``own_rows``: :func:`_gather_runs`): one product
    of each block's queries with its ``U`` window keys and its candidate keys gives every logit
    it needs (leaf scores and exact logits); the selected ones are picked from it, and the exact
    keys' weights, scattered back into a dense row, take one product with the values. Each
    query's own candidate leaves (``query_beam``) extend that row past its ``E`` columns."""
    p, scale, causal, _, group_of, summaries, scratch, M = ctx
    B, H = q.shape[:2]
    qb, bs, w = _options.QUERY_BLOCK, p.block_size, p.window
    blocks, U, L, crank, cok = pl.blocks, pl.U, pl.L, pl.crank, pl.cok
    nbk = blocks.stop - blocks.start
    rows_q = slice(blocks.start * qb, blocks.stop * qb)
    lo_q = lo[rows_q].view(nbk, qb)
    first = lo_q[:, :1]
    E = pl.idx.shape[-1]
    qs = q.unflatten(2, (nbk, qb)) * scale
    logits_all = scratch.get("logits", (B, H, nbk, qb, E), q)
    logits_all = qs @ kx.mT if logits_all is None else torch.matmul(qs, kx.mT, out=logits_all)
    row_logits, x, Lo = logits_all, logits_all[..., U:], 0
    own = pl.own
    if own is not None:  # each query's own leaves: keys and values gathered per query
        _, orank, ook = own
        Lo = orank.shape[-1]
        ko, vo = own_rows  # (B, H, nb, QB, bs Lo, .)
        logits_own = (qs.unsqueeze(-2) @ ko.mT).squeeze(-2)
        row_logits = torch.cat([logits_all, logits_own], -1)
        x = torch.cat([x.unflatten(-1, (bs, L)), logits_own.unflatten(-1, (bs, Lo))], -1).flatten(-2)
    with torch.no_grad():
        lo_e = lo_q.unsqueeze(-1)
        crank = crank.flatten(-2).unsqueeze(-2).expand(B, H, nbk, qb, -1)
        cok = cok.flatten(-2).unsqueeze(-2)
        if own is not None:  # leaf layout: the block's L leaves, then the query's own Lo, slot-major
            crank = torch.cat([crank.unflatten(-1, (bs, L)), orank], -1).flatten(-2)
            cok = torch.cat([cok.expand(B, H, nbk, qb, -1).unflatten(-1, (bs, L)), ook], -1).flatten(-2)
        Lt = L + Lo
        allowed = cok & ((crank < lo_e) if causal else (crank < lo_e) | (crank >= lo_e + w))
        top, pick = largest(leaf_scores(x, allowed, bs, p.scoring), min(p.num_selected, Lt))
        col = (pick.unsqueeze(-1) + torch.arange(0, bs * Lt, Lt, device=q.device)).flatten(-2)  # (.., QB, k bs)
        ok = allowed.gather(-1, col) & (top > -math.inf).repeat_interleave(bs, -1)
        pos = crank.gather(-1, col)
        key, leaf_at = col // Lt, col % Lt  # column in the row of logits: the block's, or past E the query's own
        col = torch.where(leaf_at < L, U + key * L + leaf_at, E + key * Lo + leaf_at - L)
        win = lo_e + torch.arange(w, device=q.device)  # (nb, QB, w)
        win_ok = ((win >= 0) & (win < M)).expand(B, H, *win.shape)
        cols = torch.cat([(win - first.unsqueeze(-1)).expand(B, H, *win.shape), col], -1)
        pos = torch.cat([win.clamp(0, M - 1).expand(B, H, *win.shape), pos.clamp(0, M - 1)], -1)
        ok = torch.cat([win_ok, ok], -1)
        if causal:
            egroup = pos // causal_group_size(M, p.num_summaries, bs)
        else:
            egroup = group_of.gather(2, pos.flatten(2)).view(pos.shape)
    logits = row_logits.gather(-1, cols).flatten(2, 3)
    qk, count, sub, egroup, vals = summaries(pl.run, pos.flatten(2, 3), ok.flatten(2, 3), egroup.flatten(2, 3))

    def exact_values(we):
        dense = scratch.get("weights", row_logits.shape, q)
        dense = torch.zeros_like(row_logits) if dense is None else dense.zero_()
        dense = dense.scatter_add_(-1, cols, we.unflatten(2, (nbk, qb)))
        out = dense[..., :E] @ vx
        if own is not None:
            out = out + (dense[..., E:].unsqueeze(-2) @ vo).squeeze(-2)
        return out.flatten(2, 3)

    return combine(logits, exact_values, ok.flatten(2, 3), sub, egroup, qk, count, vals)
