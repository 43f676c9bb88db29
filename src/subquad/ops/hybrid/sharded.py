"""hybrid on a sequence split over a process group (:func:`subquad.distributed.attention`):
causal self-attention, the LLM case, each rank holding whole query and key blocks of the sequence
(every shard but the last a multiple of ``query_block`` and ``key_block``).

1. **Summaries**: every rank's key-block means and query-block means, one all-gather (no gradient;
   ``(n / QB + n / KB) D`` numbers per (item, head) and rank).
2. **Selection**: each rank scores its query blocks against the key blocks before them with the
   single-process rule (``score="mean"``: a block is rated by the previous query block's mean, which
   for a rank's first block is the previous rank's last), so it picks the same blocks.
3. **Fetch**: the selected key blocks that live on earlier ranks, per (item, head) each block once,
   sent by their owners: one exchange of counts, then point-to-point sends of the wanted block ids
   and of those blocks' keys and values; the backward sends their gradients back the same way.
4. **Attention**: the CPU fused-kernel form of the causal op (:class:`~subquad.ops.hybrid.chunk.CausalBlocks`)
   on the rank's own queries, with its past blocks drawn from the fetched blocks and its own.

A rank other than the first must start past the dense prefix (where a query block's selection is
every key before it): at ``(past KB / QB + 1) QB`` tokens, 2304 at the defaults. Not supported:
``score="mass"`` (it needs the previous query block's every query), key padding (the op removes
padding first, which moves the blocks across ranks), non-causal attention, ``key_block >
query_block``, and devices other than the CPU (the fused kernel is torch's CPU one).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .._masks import compute_dtype, compute_precision
from .._sharded import Shards
from ..softmax.ring import ring_attention
from .chunk import CausalBlocks, sparse_start
from .select import block_means, candidates, choose_blocks, past_blocks

__all__ = ["hybrid_context_parallel"]


def _check(o, key_padding_mask: Tensor | None, causal: bool, q: Tensor, lengths: list[int], past: int,
           exact: bool) -> None:
    """ValueError / NotImplementedError for what the context-parallel form does not run."""
    if not causal:
        raise NotImplementedError("hybrid: context parallelism runs causal self-attention; pass causal=True")
    if key_padding_mask is not None:
        raise NotImplementedError("hybrid: context parallelism takes no key_padding_mask (padding removal would "
                                  "move blocks between ranks)")
    if o.score != "mean":
        raise NotImplementedError("hybrid: context parallelism scores blocks with score='mean'")
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


def hybrid_context_parallel(q, k, v, key_padding_mask, causal, scale, o, shards: Shards) -> Tensor:
    """The entry's ``context_parallel`` (see the module docstring)."""
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
            sel = choose_blocks(scale * before @ means.mT, end, lo[g0:], hi[g0:], cand[g0:], forced[g0:], True,
                                query_block=QB, key_block=KB, num_blocks=o.num_blocks, sinks=o.sinks, local=o.local)
        Np, E = -(-n // QB) * QB, max(D, Dv)
        qc, kc, vc = (F.pad(t, (0, E - t.shape[-1], 0, Np - n)).contiguous() for t in (qc, kc, vc))
        i0 = min(sparse_start(sel, past), Np // QB) if shards.rank == 0 else 0
        ids = sel.index[:, :, i0:, :past]
        kp, vp, ids = _past_keys(kc, vc, ids, start // KB, KB, shards, lengths)
        out = CausalBlocks.apply(qc, kc, vc, kp, vp, ids, i0 * QB, KB, scale)
    return out[:, :, :n, :Dv].to(q.dtype)


def _past_keys(k: Tensor, v: Tensor, ids: Tensor, first: int, KB: int, shards: Shards,
               lengths: list[int]) -> tuple[Tensor, Tensor, Tensor]:
    """The past keys and values ``(B, H, (F + nb) KB, E)``, the ``F`` fetched blocks of each (item,
    head) then this rank's own ``nb``, and ``ids`` (global block ids, own from ``first`` on) as
    indices into them."""
    B, H = ids.shape[:2]
    wanted = torch.zeros(B, H, first + 1, dtype=torch.bool, device=ids.device)  # the last column: own blocks
    wanted.scatter_(-1, ids.clamp(max=first).flatten(2), True)
    wanted = wanted[..., :first]
    slot = wanted.long().cumsum(-1) - 1  # a wanted block's place among its (item, head)'s fetched ones
    F_ = int(wanted.sum(-1).max()) if first else 0
    remote = slot.gather(-1, ids.clamp(max=first - 1).flatten(2)).view_as(ids) if first else ids
    local = torch.where(ids < first, remote, F_ + ids - first)
    bh, block = wanted.view(B * H, first).nonzero(as_tuple=True)
    plan = _Plan(bh, block, slot.view(B * H, first)[bh, block] if first else block, F_, KB, shards, lengths)
    kp, vp = _Fetch.apply(k, v, plan)
    return kp, vp, local


class _Plan:
    """Who sends which key blocks to whom: this rank's wanted ``(bh, block)`` pairs (global block
    ids, each going to ``slot`` of its (item, head)), split by owner, and the pairs every later rank
    wants from this one (exchanged at construction: counts to all, then the ids)."""

    def __init__(self, bh: Tensor, block: Tensor, slot: Tensor, fetched: int, KB: int, shards: Shards,
                 lengths: list[int]):
        self.shards, self.KB, self.fetched = shards, KB, fetched
        firsts = [sum(lengths[:s]) // KB for s in range(len(lengths))] + [10 ** 18]
        owner = torch.bucketize(block, torch.tensor(firsts[1:-1], device=block.device), right=True)
        self.want = [(bh[owner == s], block[owner == s] - firsts[s], slot[owner == s]) for s in range(shards.size)]
        counts = shards.gather_ints([len(w[0]) for w in self.want], block.device)
        r = shards.rank
        self.serve = [torch.empty(2, counts[s][r], dtype=torch.int64, device=block.device) for s in range(shards.size)]
        sends = [(torch.stack(self.want[s][:2]), s) for s in range(shards.size) if len(self.want[s][0])]
        recvs = [(self.serve[s], s) for s in range(shards.size) if counts[s][r]]
        _swap(shards, sends, recvs)


def _swap(shards: Shards, sends: list[tuple[Tensor, int]], recvs: list[tuple[Tensor, int]]) -> None:
    """Point-to-point sends and receives with any ranks, all started at once, then waited on."""
    requests = []
    for t, peer in sends:
        requests += shards.exchange([t.contiguous()], peer, [], peer)
    for t, peer in recvs:
        requests += shards.exchange([], peer, [t], peer)
    for request in requests:
        request.wait()


class _Fetch(torch.autograd.Function):
    """``(kp, vp)``: the wanted blocks of earlier ranks' keys and values, then this rank's own ``k``,
    ``v`` ``(B, H, Np, E)``; backward returns each fetched block's gradient to its owner, who adds
    it to its own keys' and values'."""

    @staticmethod
    def forward(ctx, k, v, plan):
        ctx.plan = plan
        B, H, Np, E = k.shape
        KB, fetched, shards = plan.KB, plan.fetched, plan.shards
        rows = lambda x: x.view(B * H, Np // KB, KB, E)  # noqa: E731
        sends = [(torch.stack([rows(k)[bh, blk], rows(v)[bh, blk]]), s)
                 for s, (bh, blk) in enumerate(plan.serve) if bh.numel()]
        got = {s: k.new_empty(2, len(w[0]), KB, E) for s, w in enumerate(plan.want) if len(w[0])}
        _swap(shards, sends, [(t, s) for s, t in got.items()])
        kf, vf = k.new_zeros(B * H, fetched, KB, E), v.new_zeros(B * H, fetched, KB, E)
        for s, t in got.items():
            bh, _, slot = plan.want[s]
            kf[bh, slot], vf[bh, slot] = t[0], t[1]
        kp = torch.cat([kf.view(B, H, fetched * KB, E), k], 2)
        vp = torch.cat([vf.view(B, H, fetched * KB, E), v], 2)
        return kp, vp

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dkp, dvp):
        plan = ctx.plan
        KB, fetched, shards = plan.KB, plan.fetched, plan.shards
        B, H, L, E = dkp.shape
        Np = L - fetched * KB
        dk, dv = dkp[:, :, fetched * KB:].clone(), dvp[:, :, fetched * KB:].clone()
        gk = dkp[:, :, : fetched * KB].reshape(B * H, fetched, KB, E)
        gv = dvp[:, :, : fetched * KB].reshape(B * H, fetched, KB, E)
        sends = [(torch.stack([gk[bh, slot], gv[bh, slot]]), s) for s, (bh, _, slot) in enumerate(plan.want)
                 if len(bh)]
        got = {s: dk.new_empty(2, bh.numel(), KB, E) for s, (bh, _) in enumerate(plan.serve) if bh.numel()}
        _swap(shards, sends, [(t, s) for s, t in got.items()])
        rows_k, rows_v = dk.view(B * H, Np // KB, KB, E), dv.view(B * H, Np // KB, KB, E)
        for s, t in got.items():
            bh, blk = plan.serve[s]
            rows_k.index_put_((bh, blk), t[0], accumulate=True)
            rows_v.index_put_((bh, blk), t[1], accumulate=True)
        return dk, dv, None
