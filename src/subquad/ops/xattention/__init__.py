"""XAttention (Xu et al. 2025, "XAttention: Block Sparse Attention with Antidiagonal Scoring",
arXiv 2503.16428): queries and keys in blocks of ``block_size``; each (query block, key block)
pair is scored by antidiagonal sampling of its logits, and each query block keeps the fewest key
blocks whose share of the estimated attention reaches ``threshold``.

The score, as implemented here (a per-query variant: the paper's code averages each tile's
antidiagonal logits and takes the softmax over tiles): within every ``stride x stride`` tile of the
logits only the antidiagonal entries are read (query ``i``, key ``j`` with ``i mod stride + j mod
stride = stride - 1``, so each query reads every ``stride``-th key and each key is read by every
``stride``-th query); each query's read entries go through a softmax over the keys it may see, and
a block pair's score is the sum of its entries, divided by the query block's number of queries: a
distribution over the key blocks of each query block. Its key blocks are taken in decreasing score
until their sum reaches ``threshold`` (XAttention's threshold selection; 0.9 in the paper).

Causal: the paper scores a query block with its own queries, so a query's keys would depend on
the later queries of its block; here, as in ``hybrid``, a query block's key blocks are chosen by
the scores of the block before it (the first block attends to its own keys), its diagonal block
is always kept, and a query sees the keys up to itself: no output depends on a later token. Not
causal: each block by its own queries, as in the paper. There is no token-by-token decoding form
(a block's choice needs the whole block before it). This form computes every logit
(exact attention's cost) to measure what the selection keeps, not to be fast. Padding is removed
first, per item. The selection has no gradient; the softmax over the chosen keys has.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ...checks import check_float, check_int, check_share
from ...registry import register_method
from .._common import keys_of_blocks
from .._masks import each_item_without_padding
from ..softmax import sdpa
from ..topk import attend_chosen

__all__ = ["XAttentionOptions", "block_scores", "xattention_attention"]


@dataclass
class XAttentionOptions:
    """``block_size``: queries and keys per block (default 128); ``stride``: the antidiagonal
    sampling stride (default 8, the paper's for this block size); ``threshold``: the share of each
    query block's estimated attention its kept key blocks reach (default 0.9); ``top_p``: each
    query's keys in the kept blocks pruned to the fewest that hold this share of their softmax
    (default 1.0: none pruned; Twilight's top-p, :func:`subquad.ops.topk.keep_share`)."""

    block_size: int = 128
    stride: int = 8
    threshold: float = 0.9
    top_p: float = 1.0

    def __post_init__(self):
        check_int("xattention", "block_size", self.block_size, minimum=1)
        check_int("xattention", "stride", self.stride, minimum=1)
        check_float("xattention", "threshold", self.threshold, minimum=0.0)
        if self.threshold > 1:
            raise ValueError(f"xattention: threshold must be at most 1, got {self.threshold}")
        check_share("xattention", "top_p", self.top_p)


def flops(B, H, N, M, D, Dv, o):
    """Matmul FLOPs of one forward as computed: every logit and the weights times values."""
    return 2 * B * H * N * M * (D + Dv)


def block_scores(logits: Tensor, visible: Tensor, start: int, block_size: int, stride: int) -> Tensor:
    """``(B, H, n / block_size, P)``: per query block of the chunk (whose first position ``start``
    is a multiple of ``block_size``), the estimated share of attention on each key block."""
    n, M = logits.shape[-2:]
    i = torch.arange(start, start + n, device=logits.device)[:, None] % stride
    j = torch.arange(M, device=logits.device) % stride
    read = visible & (i + j == stride - 1)
    weights = torch.softmax(logits.masked_fill(~read, -torch.inf), -1).nan_to_num(0.0)  # a row reading nothing: 0
    nb, P = -(-n // block_size), -(-M // block_size)
    weights = F.pad(weights, (0, P * block_size - M, 0, nb * block_size - n))
    sums = weights.reshape(*weights.shape[:2], nb, block_size, P, block_size).sum((3, 5))
    rows = torch.clamp(n - torch.arange(nb, device=logits.device) * block_size, max=block_size)
    return sums / rows.view(nb, 1).to(sums.dtype)


def _causal_scores(q: Tensor, k: Tensor, scale: float, block_size: int, stride: int) -> Tensor:
    """:func:`block_scores` of every query block of a causal self-attention ``(B, H, nb, P)``."""
    step = max(1, (1 << 24) // max(1, q.shape[0] * q.shape[1] * k.shape[2] * block_size)) * block_size
    out = []
    for a in range(0, q.shape[2], step):
        logits = (q[:, :, a: a + step] * scale) @ k.mT
        positions = torch.arange(a, a + logits.shape[2], device=q.device)[:, None]
        visible = torch.arange(k.shape[2], device=q.device) <= positions
        out.append(block_scores(logits.masked_fill(~visible, -torch.inf), visible, a, block_size, stride))
    return torch.cat(out, 2)


def _keep_until(scores: Tensor, threshold: float) -> Tensor:
    """Per row, the fewest entries in decreasing order whose sum reaches ``threshold`` (at least one)."""
    ordered, order = scores.sort(dim=-1, descending=True, stable=True)  # ties: the earlier block
    before = ordered.cumsum(-1) - ordered  # the sum of the entries ranked above each one
    keep = before < threshold
    keep[..., 0] = True
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, order, keep)


def expected_keys(q: Tensor, k: Tensor, causal: bool, o: XAttentionOptions) -> Tensor:
    """``(B, H, N)`` float64: the keys each query attends on these q ``(B, H, N, D)`` and k
    ``(B, H, M, D)`` (every key real; the registry's ``expected_keys``): its query block's key
    blocks kept up to ``threshold`` (causal: scored as the op scores them, plus the diagonal
    block; the keys at or before the query). Not with ``top_p`` < 1, whose pruning needs each
    query's exact weights (NotImplementedError)."""
    if o.top_p < 1:
        raise NotImplementedError("xattention: expected_keys counts the kept blocks; top_p prunes keys per query")
    B, H, N, _ = q.shape
    M, bs = k.shape[2], o.block_size
    scale = q.shape[-1] ** -0.5
    if q.dtype in (torch.float16, torch.bfloat16):
        q, k = q.float(), k.float()
    if causal:
        every = _causal_scores(q, k, scale, bs, o.stride)
        keep = _keep_until(torch.cat([torch.zeros_like(every[:, :, :1]), every[:, :, :-1]], 2), o.threshold)
        nb, P = keep.shape[-2:]
        keep = keep | (torch.arange(P, device=q.device) == torch.arange(nb, device=q.device)[:, None])
    else:
        step = max(1, (1 << 24) // max(1, B * H * M * bs)) * bs
        visible = torch.ones(1, 1, 1, M, dtype=torch.bool, device=q.device)
        keep = torch.cat([_keep_until(block_scores((q[:, :, a: a + step] * scale) @ k.mT, visible, a, bs, o.stride),
                                      o.threshold) for a in range(0, N, step)], 2)
    return keys_of_blocks(keep, N, M, bs, bs, causal)


@register_method("xattention", options=XAttentionOptions,
                 summary="exact softmax over each query block's key blocks up to a share of their antidiagonal score",
                 causal=True, cross_attention=True, complexity="quadratic", flops=flops,
                 test_options={"block_size": 4, "stride": 2, "threshold": 0.5}, fullgraph_with_padding=False,
                 quality_reference=True, expected_keys=expected_keys)
def xattention_attention(q, k, v, key_padding_mask, causal, scale, *, block_size, stride, threshold, top_p):
    """Shapes: q ``(B, H, N, D)``, k ``(B, H, M, D)``, v ``(B, H, M, Dv)`` -> ``(B, H, N, Dv)``;
    causal, query ``i`` sees the keys ``<= i``. Padding is removed per item first, and a query at a
    padded position copies an earlier real query's output
    (:func:`~subquad.ops._masks.each_item_without_padding`). Float32 math under autocast (float64
    stays float64); returns the dtype of q."""

    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if k.shape[2] <= block_size and top_p >= 1:  # one key block, always kept: exact attention, masks as given
        return sdpa(q, k, v, key_padding_mask, causal, scale)

    def attend(q, k, v):
        previous = []  # causal: every query block's scores, from which the next block chooses

        def choose(qc, start, ranked):
            n, M = ranked.shape[-2:]
            if not causal:
                scores = block_scores(ranked, ranked > -torch.inf, start, block_size, stride)
            else:
                if not previous:
                    previous.append(_causal_scores(q.detach().to(qc.dtype), k.detach().to(qc.dtype), scale,
                                                   block_size, stride))
                first, nb, every = start // block_size, -(-n // block_size), previous[0]
                if first == 0:  # the first block has none before it: its own keys alone
                    scores = torch.cat([torch.zeros_like(every[:, :, :1]), every[:, :, : nb - 1]], 2)
                else:
                    scores = every[:, :, first - 1: first - 1 + nb]
            keep = _keep_until(scores, threshold)
            if causal:  # the diagonal block
                nb, P = keep.shape[-2:]
                own = start // block_size + torch.arange(nb, device=keep.device)
                keep = keep | (torch.arange(P, device=keep.device) == own[:, None])
            return keep.repeat_interleave(block_size, -2)[..., :n, :].repeat_interleave(block_size, -1)[..., :M]

        return attend_chosen(q, k, v, None, causal, scale, choose, chunk_multiple=block_size, top_p=top_p)

    if key_padding_mask is None or not bool(key_padding_mask.any()):
        return attend(q, k, v)
    return each_item_without_padding(attend, q, k, v, key_padding_mask, causal)
