"""hybrid on a sequence split over a process group (:func:`subquad.distributed.attention`):
causal self-attention, the LLM case, each rank holding whole query and key blocks of the sequence
(every shard but the last a multiple of ``query_block`` and ``key_block``).

1. **Summaries**: every rank's key-block means and query-block means, one all-gather (no gradient;
   ``(n / QB + n / KB) D`` numbers per (item, head) and rank).
2. **Selection**: each rank scores its query blocks against the key blocks before them with the
   single-process rule, so it picks the same blocks: a block is rated by the previous query block's
   mean (for a rank's first block, the previous rank's last), against the block's mean key
   (``score="mean"``) or, ``score="mean_query"``, against the block's every key: every rank's
   scoring means are all-gathered, each rank takes the log-sum-exp of their logits over each of its
   own key blocks, and a second all-gather gives every rank the softmax over its candidate blocks
   (``nq nk`` numbers per (item, head) and rank).
3. **Rounds**: a rank takes its query blocks :data:`ROUND_BLOCKS` at a time. Per round, the
   selected key blocks that live on earlier ranks, each (item, head, block) once, are sent by
   their owners (one exchange of counts, then point-to-point sends of the wanted block ids and of
   those blocks' keys and values), and the round's query blocks attend them with the CPU
   fused-kernel form of the causal op (:func:`~subquad.ops.hybrid.chunk.units_forward`). Every rank
   takes part in as many rounds as the rank with the most query blocks (serving the others).
4. **Backward**: the same rounds fetch the blocks again (a rank never holds more than one round's)
   and send their gradients back to their owners.

A rank other than the first must start past the dense prefix (where a query block's selection is
every key before it): at ``(past KB // QB + 1) QB`` tokens, 2048 at the defaults. Not supported:
``score="mass"`` and ``"sampled"`` (they need the previous query block's every query), key padding (the op removes
padding first, which moves the blocks across ranks), non-causal attention, ``key_block >
query_block``, and devices other than the CPU (the fused kernel is torch's CPU one).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .._masks import compute_dtype, compute_precision
from .._sharded import Shards
from ..softmax.ring import ring_attention
from .chunk import prefix_backward, prefix_forward, sparse_start, units_backward, units_forward
from .select import block_means, candidates, choose_blocks, past_blocks

__all__ = ["hybrid_context_parallel", "ROUND_BLOCKS"]

#: query blocks a rank computes per round of fetches: a round's fetched blocks are at most
#: ``ROUND_BLOCKS (sinks + local + num_blocks)`` per (item, head), whatever N
ROUND_BLOCKS = 8


def _check(o, key_padding_mask: Tensor | None, causal: bool, q: Tensor, lengths: list[int], past: int,
           exact: bool) -> None:
    """ValueError / NotImplementedError for what the context-parallel form does not run."""
    if not causal:
        raise NotImplementedError("hybrid: context parallelism runs causal self-attention; pass causal=True")
    if key_padding_mask is not None:
        raise NotImplementedError("hybrid: context parallelism takes no key_padding_mask (padding removal would "
                                  "move blocks between ranks)")
    if o.score not in ("mean", "mean_query"):
        raise NotImplementedError("hybrid: context parallelism scores blocks with score='mean' or 'mean_query'")
    if o.top_p < 1:
        raise NotImplementedError("hybrid: context parallelism runs top_p=1 (its per-block kernel takes every "
                                  "query block's full count of past blocks)")
    if exact:  # the ring runs it
        return
    if o.key_block > o.query_block or q.device.type != "cpu":
        raise NotImplementedError("hybrid: context parallelism runs on the CPU with key_block <= query_block")
    if any(n % o.query_block for n in lengths[:-1]):
        raise ValueError(f"hybrid: every shard but the last must hold whole query blocks ({o.query_block} tokens); "
                         f"got shard lengths {lengths}")
    least = sparse_start_tokens(o.query_block, o.key_block, past)
    if len(lengths) > 1 and lengths[0] < least:
        raise ValueError(f"hybrid: the first shard must reach past the dense prefix ({least} tokens at these "
                         f"options); got shard lengths {lengths}")


def sparse_start_tokens(query_block: int, key_block: int, past: int) -> int:
    """Where the sparse query blocks start: the dense prefix's length in tokens."""
    return (past * key_block // query_block + 1) * query_block


def _summaries(q: Tensor, k: Tensor, o, shards: Shards, lengths: list[int]) -> tuple[Tensor, Tensor]:
    """Every rank's key-block means up to this rank's ``(B, H, nk_end, D)`` and the mean of the query
    block before each of this rank's ``(B, H, nq, D)`` (zeros before the first)."""
    QB, KB = o.query_block, o.key_block
    nks, nqs = [-(-n // KB) for n in lengths], [-(-n // QB) for n in lengths]
    pad = lambda x, n: F.pad(x, (0, 0, 0, n - x.shape[2]))  # noqa: E731
    own = torch.cat([pad(block_means(k, KB), max(nks)), pad(block_means(q, QB), max(nqs))], 2)
    every = shards.gather(own.detach())  # (R, B, H, max nk + max nq, D)
    r = shards.rank
    means = torch.cat([every[s, :, :, :nks[s]] for s in range(r + 1)], 2)
    before = every[r - 1, :, :, max(nks) + nqs[r - 1] - 1:][:, :, :1] if r else torch.zeros_like(own[:, :, :1])
    return means, torch.cat([before, every[r, :, :, max(nks): max(nks) + nqs[r] - 1]], 2)


def _mean_query_scores(before: Tensor, k: Tensor, o, shards: Shards, lengths: list[int], scale: float,
                       candidate: Tensor) -> Tensor:
    """``score="mean_query"``'s scores ``(B, H, nq, nk_end)`` of this rank's query blocks (scoring
    means ``before``): each block's share of the softmax of the scoring mean over every candidate
    key, from the log-sum-exps that each rank computes over its own key blocks."""
    KB, r = o.key_block, shards.rank
    nks, nqs = [-(-n // KB) for n in lengths], [-(-n // o.query_block) for n in lengths]
    befores = shards.gather(F.pad(before, (0, 0, 0, max(nqs) - before.shape[2])))  # (R, B, H, max nq, D)
    logits = scale * befores @ k.mT  # (R, B, H, max nq, n) over this rank's keys
    logits = F.pad(logits, (0, nks[r] * KB - k.shape[2]), value=-math.inf)
    lse = torch.logsumexp(logits.unflatten(-1, (nks[r], KB)), -1)  # (R, B, H, max nq, nk)
    every = shards.gather(F.pad(lse, (0, max(nks) - nks[r])))  # (owner, R, B, H, max nq, max nk)
    lse = torch.cat([every[s, r, :, :, :nqs[r], :nks[s]] for s in range(r + 1)], -1)
    share = torch.softmax(lse.masked_fill(~candidate, -math.inf), -1).nan_to_num_(0.0)
    return share.masked_fill(~candidate, -math.inf)


def hybrid_context_parallel(q, k, v, key_padding_mask, causal, scale, o, shards: Shards) -> Tensor:
    """The entry's ``context_parallel`` (see the module docstring)."""
    shards.need_contiguous(causal, "hybrid")
    past = past_blocks(o.num_blocks, o.sinks, o.local)
    lengths = [n for (n,) in shards.gather_ints([q.shape[2]], q.device)]
    exact = o.num_blocks + max(o.sinks, o.local) >= -(-sum(lengths) // o.key_block)  # every block, as the op
    _check(o, key_padding_mask, causal, q, lengths, past, exact)
    if exact:
        return ring_attention(q, k, v, None, True, scale, shards)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    QB, KB = o.query_block, o.key_block
    start = sum(lengths[: shards.rank])
    n, D, Dv = q.shape[2], q.shape[-1], v.shape[-1]
    with compute_precision(q):
        dtype = compute_dtype(q.dtype)
        qc, kc, vc = q.to(dtype), k.to(dtype), v.to(dtype)
        with torch.no_grad():
            means, before = _summaries(qc, kc, o, shards, lengths)
            end = start + n
            lo, hi, cand, forced = candidates(end, end, True, query_block=QB, key_block=KB, sinks=o.sinks,
                                              local=o.local, device=q.device)
            g0 = start // QB
            if o.score == "mean_query":
                scores = _mean_query_scores(before, kc, o, shards, lengths, scale, cand[g0:])
            else:
                scores = scale * before @ means.mT
            sel = choose_blocks(scores, end, lo[g0:], hi[g0:], cand[g0:], forced[g0:], True, query_block=QB,
                                key_block=KB, num_blocks=o.num_blocks, sinks=o.sinks, local=o.local)
        Np, E = -(-n // QB) * QB, max(D, Dv)
        qc, kc, vc = (t.contiguous() if t.shape[-2:] == (Np, E) else F.pad(t, (0, E - t.shape[-1], 0, Np - n))
                      for t in (qc, kc, vc))  # no copy when nothing is padded
        dense = [min(sparse_start(sel, past), -(-lengths[0] // QB))] + [0] * (len(lengths) - 1)  # rank 0's prefix
        units = [-(-n // QB) - d for n, d in zip(lengths, dense)]
        i0 = dense[shards.rank]
        out = _Blocks.apply(qc, kc, vc, sel.index[:, :, i0:, :past], i0 * QB, start // KB,
                            max(-(-u // ROUND_BLOCKS) for u in units), QB, KB, scale, shards, lengths)
    return out[:, :, :n, :Dv].to(q.dtype)


class _Round:
    """One round of a rank's query blocks (``ids`` ``(B, H, c, S)``, global key-block ids; ``first``
    the rank's first own block, ``blocks`` its own count): the past blocks they use, each (item,
    head, block) once, at ``slot`` in a buffer of ``size`` blocks per (item, head) (``ids`` holds
    them as indices into it); which are its own and which each earlier rank sends, and which
    blocks each later rank wants from this one (exchanged at construction: counts to all, then
    the ids point to point)."""

    def __init__(self, ids: Tensor, first: int, blocks: int, KB: int, shards: Shards, lengths: list[int]):
        B, H = ids.shape[:2]
        self.shards, self.KB = shards, KB
        need = torch.zeros(B, H, first + blocks, dtype=torch.bool, device=ids.device)
        need.scatter_(-1, ids.flatten(2), True)
        slot = need.long().cumsum(-1) - 1
        self.size = int(need.sum(-1).max()) if ids.numel() else 0
        self.ids = slot.gather(-1, ids.flatten(2)).view_as(ids)
        bh, block = need.view(B * H, -1).nonzero(as_tuple=True)
        at = slot.view(B * H, -1)[bh, block]
        firsts = [sum(lengths[:r]) // KB for r in range(len(lengths))]
        owner = torch.bucketize(block, torch.tensor(firsts[1:], device=block.device), right=True)
        # per owner rank: (item-head, the owner's own block index, slot here)
        self.want = [(bh[owner == r], block[owner == r] - firsts[r], at[owner == r]) for r in range(shards.size)]
        counts = shards.gather_ints([len(w[0]) for w in self.want], ids.device)
        me = shards.rank
        self.serve = [torch.empty(2, counts[r][me], dtype=torch.int64, device=ids.device) for r in range(shards.size)]
        _swap(shards, [(torch.stack(self.want[r][:2]), r) for r in range(shards.size)
                       if r != me and len(self.want[r][0])],
              [(self.serve[r], r) for r in range(shards.size) if r != me and counts[r][me]])

    def past_keys(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """The round's past keys and values ``(B, H, size KB, E)``: its own blocks copied, the others
        received from their owners (while sending the blocks later ranks want from this one)."""
        B, H, Np, E = k.shape
        me, KB = self.shards.rank, self.KB
        own_k, own_v = k.view(B * H, Np // KB, KB, E), v.view(B * H, Np // KB, KB, E)
        kp, vp = k.new_zeros(B * H, self.size, KB, E), v.new_zeros(B * H, self.size, KB, E)
        got = {r: k.new_empty(2, len(w[0]), KB, E) for r, w in enumerate(self.want) if r != me and len(w[0])}
        sends = [(torch.stack([own_k[bh, block], own_v[bh, block]]), r) for r, (bh, block) in enumerate(self.serve)
                 if r != me and bh.numel()]
        _swap(self.shards, sends, list(zip(got.values(), got.keys())))
        bh, block, at = self.want[me]
        kp[bh, at], vp[bh, at] = own_k[bh, block], own_v[bh, block]
        for r, t in got.items():
            bh, _, at = self.want[r]
            kp[bh, at], vp[bh, at] = t[0], t[1]
        return kp.view(B, H, self.size * KB, E), vp.view(B, H, self.size * KB, E)

    def add_gradients(self, dkp: Tensor, dvp: Tensor, dk: Tensor, dv: Tensor) -> None:
        """Add the past blocks' gradients ``dkp``, ``dvp`` to their owners' ``dk``, ``dv``: its own
        here, the others sent back (while receiving those of the blocks this rank served)."""
        B, H, Np, E = dk.shape
        me, KB = self.shards.rank, self.KB
        gk, gv = dkp.view(B * H, self.size, KB, E), dvp.view(B * H, self.size, KB, E)
        rows_k, rows_v = dk.view(B * H, Np // KB, KB, E), dv.view(B * H, Np // KB, KB, E)
        sends = [(torch.stack([gk[bh, at], gv[bh, at]]), r) for r, (bh, _, at) in enumerate(self.want)
                 if r != me and len(bh)]
        got = {r: dk.new_empty(2, bh.numel(), KB, E) for r, (bh, _) in enumerate(self.serve) if r != me and bh.numel()}
        _swap(self.shards, sends, list(zip(got.values(), got.keys())))
        bh, block, at = self.want[me]
        rows_k.index_put_((bh, block), gk[bh, at], accumulate=True)
        rows_v.index_put_((bh, block), gv[bh, at], accumulate=True)
        for r, t in got.items():
            bh, block = self.serve[r]
            rows_k.index_put_((bh, block), t[0], accumulate=True)
            rows_v.index_put_((bh, block), t[1], accumulate=True)


def _swap(shards: Shards, sends: list[tuple[Tensor, int]], recvs: list[tuple[Tensor, int]]) -> None:
    """Point-to-point sends and receives with any ranks, all started at once, then waited on."""
    requests = []
    for t, peer in sends:
        requests += shards.exchange([t.contiguous()], peer, [], peer)
    for t, peer in recvs:
        requests += shards.exchange([], peer, [t], peer)
    for request in requests:
        request.wait()


class _Blocks(torch.autograd.Function):
    """The causal op on a rank's shard ``q``, ``k``, ``v`` ``(B, H, Np, E)`` contiguous: positions
    before ``P`` (rank 0's dense prefix) causal attention; then its query blocks (past blocks
    ``ids``) in ``rounds`` rounds of :data:`ROUND_BLOCKS`, each fetching its past blocks
    (:class:`_Round`). The backward fetches them again rather than keep them, so a rank holds one
    round's blocks at a time, forward and backward."""

    @staticmethod
    def forward(ctx, q, k, v, ids, P, first, rounds, QB, KB, scale, shards, lengths):
        Np = q.shape[2]
        out, lse = prefix_forward(q, k, v, P, scale)
        plans = []
        for t in range(rounds):
            part = ids[:, :, t * ROUND_BLOCKS: (t + 1) * ROUND_BLOCKS]
            plans.append(_Round(part, first, Np // KB, KB, shards, lengths))
            kp, vp = plans[-1].past_keys(k, v)
            if part.shape[2]:
                units_forward(q, k, v, kp, vp, plans[-1].ids, P + t * ROUND_BLOCKS * QB, QB, KB, scale, out, lse)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plans, ctx.P, ctx.QB, ctx.KB, ctx.scale = plans, P, QB, KB, scale
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        P, QB, KB, scale = ctx.P, ctx.QB, ctx.KB, ctx.scale
        dout = dout.contiguous()
        dq, dk, dv = prefix_backward(dout, q, k, v, out, lse, P, scale)
        for t, plan in enumerate(ctx.plans):
            kp, vp = plan.past_keys(k, v)
            dkp, dvp = torch.zeros_like(kp), torch.zeros_like(vp)
            if plan.ids.shape[2]:
                units_backward(dout, q, k, v, kp, vp, plan.ids, P + t * ROUND_BLOCKS * QB, QB, KB, scale, out, lse,
                               (dq, dk, dv, dkp, dvp))
            plan.add_gradients(dkp, dvp, dk, dv)
        return dq, dk, dv, *([None] * 9)
