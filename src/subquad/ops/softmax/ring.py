"""Exact attention on a sequence split over a process group: ring attention (Liu, Zaharia and
Abbeel 2023, "Ring Attention with Blockwise Transformers for Near-Infinite Context", arXiv
2310.01889), the context-parallel baseline every other method's is measured against.

Each rank keeps its queries; the key and value shards travel around the ring of ranks, one step
per rank. At each step a rank attends its queries to the shard it holds (causal: the shards of
earlier ranks whole, its own with the causal mask, later ones not at all), and merges the partial
outputs by their log-sum-exp. The backward sends the shards around again with their gradients,
which come home after the last step; each block's gradients come from the merged output and
log-sum-exp, as in FlashAttention-2's backward. Memory per rank: its own shard and one more in
flight, never the whole sequence. With the contiguous layout, causal rank ``r`` computes ``r + 1``
of the ``size`` blocks, so the last rank works ``size`` times as long as the first; with
``layout="zigzag"`` (:func:`subquad.distributed.shard`) the sequence is cut into ``2 size`` chunks
and rank ``r`` holds chunks ``r`` and ``2 size - 1 - r``, which balances the causal work: every
rank attends ``2 size - 1`` pairs of chunks whole and 2 under the causal mask (the zig-zag layout
of Megatron-LM's context parallelism and of ``zigzag_ring_flash_attn.py`` in
zhuzilin/ring-flash-attention).

On the CPU each block is torch's fused flash kernel (``_scaled_dot_product_flash_attention_for_cpu``
and its backward); elsewhere plain matrix products that form the block's ``n x m`` logits.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .._masks import compute_dtype, compute_precision, drop_padded
from .._sharded import Shards

__all__ = ["ring_attention"]

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _bias(real: Tensor | None, like: Tensor) -> Tensor | None:
    """Additive ``(B, 1, 1, m)`` bias, -inf at padded keys (``real``: ``(B, m)`` True = a real key)."""
    if real is None:
        return None
    bias = torch.zeros(real.shape, dtype=like.dtype, device=like.device)
    return bias.masked_fill_(real == 0, -math.inf)[:, None, None]


def _logits(q: Tensor, k: Tensor, bias: Tensor | None, causal: bool, scale: float) -> Tensor:
    """The block's masked logits (the form off the CPU)."""
    s = (q * scale) @ k.mT
    if bias is not None:
        s = s + bias
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu_(1), -math.inf)
    return s


def _block(q: Tensor, k: Tensor, v: Tensor, real: Tensor | None, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """Attention of ``q`` over one shard of keys: the output and its log-sum-exp ``(B, H, n)``,
    -inf (output 0) for a query that sees no key of the shard."""
    bias = _bias(real, q)
    if q.device.type == "cpu":
        out, lse = _flash(q, k, v, 0.0, causal, attn_mask=bias, scale=scale)
    else:
        s = _logits(q, k, bias, causal, scale)
        lse = torch.logsumexp(s, -1)
        out = torch.exp(s - lse.unsqueeze(-1)).nan_to_num_(0.0) @ v
    if real is not None or causal:  # the fused kernel gives 0, not -inf, where no key is seen
        seen = torch.ones(q.shape[0], k.shape[2], device=q.device) if real is None else real.to(q.dtype)
        seen = seen.cumsum(-1)[:, : q.shape[2]] if causal else seen.sum(-1, keepdim=True)
        lse = lse.masked_fill(seen[:, None] == 0, -math.inf)
    return out, lse


def _block_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, real: Tensor | None,
                    causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv of one block, from the merged ``out`` and ``lse`` (finite everywhere)."""
    bias = _bias(real, q)
    if q.device.type == "cpu":
        dq, dk, dv, *_ = _flash_backward(dout, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale)
        return dq, dk, dv
    p = torch.exp(_logits(q, k, bias, causal, scale) - lse.unsqueeze(-1))
    dp = dout @ v.mT
    ds = p * (dp - (dout * out).sum(-1, keepdim=True))
    return (ds @ k) * scale, (ds.mT @ q) * scale, p.mT @ dout


def _merge(out: Tensor, lse: Tensor, o: Tensor, lse_o: Tensor) -> tuple[Tensor, Tensor]:
    """Two partial softmax outputs with their log-sum-exps merged into one."""
    new = torch.logaddexp(lse, lse_o)
    keep = torch.isfinite(new).unsqueeze(-1)
    a = torch.where(keep, torch.exp(lse - new).unsqueeze(-1), 0.0)
    b = torch.where(keep, torch.exp(lse_o - new).unsqueeze(-1), 0.0)
    return out * a + o * b, new


def _pieces(n: int, rank: int, size: int, layout: str, causal: bool) -> list[tuple[int, int, int]]:
    """``(chunk, start, length)`` of the chunks of the sequence a rank's shard of ``n`` positions
    holds, in its order (not causal: the shard as one piece, order does not matter): contiguous,
    chunk ``rank``; zig-zag, chunks ``rank`` (the first ``ceil(n / 2)`` positions) and ``2 size - 1
    - rank``. A chunk's number orders it in the sequence."""
    if not causal or layout == "contiguous":
        return [(rank, 0, n)]
    first = -(-n // 2)
    return [(rank, 0, first), (2 * size - 1 - rank, first, n - first)]


def _pairs(mine, theirs, causal):
    """``(query slice, key slice, diagonal)`` of the piece pairs that attend: not causal, all;
    causal, a key chunk before the query chunk whole, the same chunk with the causal mask."""
    for qc, qa, qn in mine:
        for kc, ka, kn in theirs:
            if qn and kn and (not causal or kc <= qc):
                yield slice(qa, qa + qn), slice(ka, ka + kn), causal and kc == qc


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, real, causal, scale, shards, lengths):
        rank, size = shards.rank, shards.size
        pieces = [_pieces(n, r, size, shards.layout, causal) for r, n in enumerate(lengths)]  # of the keys
        mine = _pieces(q.shape[2], rank, size, shards.layout, causal)  # of the queries (causal: the keys')
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:3], -math.inf, dtype=torch.float32 if q.dtype != torch.float64 else q.dtype,
                         device=q.device)
        block = [k, v] + ([] if real is None else [real])
        for step in range(size):
            source = (rank - step) % size
            requests, incoming = [], []
            if step < size - 1:  # pass the shard on while computing with it
                incoming = [x.new_empty(*x.shape[:-2], lengths[(source - 1) % size], x.shape[-1])
                            if x.ndim == 4 else x.new_empty(x.shape[0], lengths[(source - 1) % size]) for x in block]
                requests = shards.exchange(block, (rank + 1) % size, incoming, (rank - 1) % size)
            for qs, ks, diagonal in _pairs(mine, pieces[source], causal):
                o, lse_o = _block(q[:, :, qs], block[0][:, :, ks], block[1][:, :, ks],
                                  block[2][:, ks] if real is not None else None, diagonal, scale)
                out[:, :, qs], lse[:, :, qs] = _merge(out[:, :, qs], lse[:, :, qs], o, lse_o.to(lse.dtype))
            for r in requests:
                r.wait()
            block = incoming or block
        lse = torch.where(torch.isfinite(lse), lse, 0.0)  # a query that sees no key: output 0, no gradient
        ctx.save_for_backward(q, k, v, real, out, lse)
        ctx.causal, ctx.scale, ctx.shards, ctx.lengths, ctx.pieces = causal, scale, shards, lengths, (mine, pieces)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, real, out, lse = ctx.saved_tensors
        shards, lengths, causal, scale, (mine, pieces) = ctx.shards, ctx.lengths, ctx.causal, ctx.scale, ctx.pieces
        rank, size = shards.rank, shards.size
        dout = dout.contiguous()
        dq = torch.zeros_like(q)
        # the shard, its mask and its gradients travel together; after `size` steps they are home
        block = [k, v, torch.zeros_like(k), torch.zeros_like(v)] + ([] if real is None else [real])
        for step in range(size):
            source = (rank - step) % size
            for qs, ks, diagonal in _pairs(mine, pieces[source], causal):
                dq_b, dk_b, dv_b = _block_backward(dout[:, :, qs], q[:, :, qs], block[0][:, :, ks],
                                                   block[1][:, :, ks], out[:, :, qs], lse[:, :, qs],
                                                   block[4][:, ks] if real is not None else None, diagonal, scale)
                dq[:, :, qs] += dq_b
                block[2][:, :, ks] += dk_b  # the gradient buffers are this rank's own (zeros, or received)
                block[3][:, :, ks] += dv_b
            n = lengths[(source - 1) % size]
            incoming = [x.new_empty(*x.shape[:-2], n, x.shape[-1]) if x.ndim == 4 else x.new_empty(x.shape[0], n)
                        for x in block]
            for r in shards.exchange(block, (rank + 1) % size, incoming, (rank - 1) % size):
                r.wait()
            block = incoming
        return dq, block[2], block[3], None, None, None, None, None


def ring_attention(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None, causal: bool,
                   scale: float | None, shards: Shards) -> Tensor:
    """Exact softmax attention of this rank's queries over every rank's keys (see the module
    docstring). Shapes as the softmax op's, for this rank's shard (causal: ``N = M`` on each
    rank; shards may differ in length). Float32 math (float64 stays); returns the dtype of q."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    D, Dv = q.shape[-1], v.shape[-1]
    E = max(D, Dv)  # the fused kernel needs one head size: zero columns change no logit
    dtype = compute_dtype(q.dtype)
    info = shards.gather_ints([k.shape[2], key_padding_mask is not None], q.device)
    lengths = [n for n, _ in info]
    real = None
    if any(has_mask for _, has_mask in info):  # a rank without a mask sends an all-real one
        real = torch.ones(k.shape[0], k.shape[2], dtype=torch.bool, device=k.device) if key_padding_mask is None \
            else ~key_padding_mask
        real = real.to(torch.uint8)  # gloo sends no bool
    with compute_precision(q):
        k, v = drop_padded(k, key_padding_mask), drop_padded(v, key_padding_mask)  # no NaN of a padded key reaches out
        qc, kc, vc = (t.to(dtype).contiguous() if t.shape[-1] == E else F.pad(t.to(dtype), (0, E - t.shape[-1]))
                      for t in (q, k, v))  # no copy when the head sizes agree
        out = _Ring.apply(qc, kc, vc, real, causal, scale, shards, lengths)
    return out[..., :Dv].to(q.dtype)
