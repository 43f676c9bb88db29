"""MoBA, mixture of block attention (Lu et al. 2025, "MoBA: Mixture of Block Attention for
Long-Context LLMs", arXiv 2502.13189): the keys are cut into blocks of ``block_size``; each query
scores every block by its gate ``q . mean(block's keys)`` and attends exactly to the
``top_blocks`` blocks of highest gate. Causal, as in the paper's code (the own block's gate is set
to +inf inside its top-k): the query's own block (its keys up to itself) is always one of the
``top_blocks``, the others the best of the blocks wholly before it. Not causal: every block is a
candidate, none forced. Blocks are cut over each item's real keys
(padding removed first, as in ``quest`` and ``hybrid``).

MoBA gates per query; ``hybrid`` (``score="mean"``) gates per block of queries with the mean of
the queries before the block, which makes its selection a matrix product per block. This form
computes every logit (exact attention's cost) to measure what MoBA's selection keeps, not to be
fast. The selection has no gradient; the softmax over the chosen keys has.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ...checks import check_int, check_share
from ...registry import register_method
from ..quest import attend_pages, whole_blocks

__all__ = ["MobaOptions", "block_means", "moba_attention"]


@dataclass
class MobaOptions:
    """``block_size``: keys per block (default 128); ``top_blocks``: blocks each query attends
    (default 8: 1024 keys; causal, its own block is one of them); ``top_p``: the chosen keys
    pruned to the fewest that hold this share of their softmax (default 1.0: none pruned;
    Twilight's top-p, :func:`subquad.ops.topk.keep_share`)."""

    block_size: int = 128
    top_blocks: int = 8
    top_p: float = 1.0

    def __post_init__(self):
        check_int("moba", "block_size", self.block_size, minimum=1)
        check_int("moba", "top_blocks", self.top_blocks, minimum=1)
        check_share("moba", "top_p", self.top_p)


def flops(B, H, N, M, D, Dv, o):
    """Matmul FLOPs of one forward as computed: the gates, every logit, the weights times values;
    exact attention's when every block is chosen."""
    blocks = -(-M // o["block_size"])
    return 2 * B * H * N * ((blocks * D if o["top_blocks"] < blocks else 0) + M * (D + Dv))


def block_means(k: Tensor, block_size: int) -> tuple[Tensor]:
    """``((B, H, P, D),)``: the mean key of each block (the last one over its keys alone)."""
    B, H, M, D = k.shape
    P = -(-M // block_size)
    sums = F.pad(k, (0, 0, 0, P * block_size - M)).view(B, H, P, block_size, D).sum(3)
    counts = torch.clamp(M - torch.arange(P, device=k.device) * block_size, max=block_size)
    return (sums / counts.view(P, 1).to(k.dtype),)


def budget_options(o: MobaOptions, keys: int) -> dict:
    """About ``keys`` keys a query beyond its own block: whole blocks, and the own block."""
    return {"top_blocks": whole_blocks("moba", keys, o.block_size) + 1}


@register_method("moba", options=MobaOptions,
                 summary="exact softmax over each query's blocks of highest gate q . mean(k) (MoBA)",
                 causal=True, cross_attention=True, complexity="quadratic", flops=flops, query_local=True,
                 test_options={"block_size": 2, "top_blocks": 2}, fullgraph_with_padding=False,
                 budget_options=budget_options, quality_reference=True)
def moba_attention(q, k, v, key_padding_mask, causal, scale, *, block_size, top_blocks, top_p):
    """Shapes: q ``(B, H, N, D)``, k ``(B, H, M, D)``, v ``(B, H, M, Dv)`` -> ``(B, H, N, Dv)``. Causal:
    query ``i`` sees the keys ``<= i``. A query at a padded position takes the output of the last
    real query before it (causal: zeros when there is none; not causal: the first real query's), an
    item without real keys outputs zeros (equal query and key lengths are read as self-attention:
    :func:`~subquad.ops._masks.each_item_without_padding`). Float32 math under autocast (float64
    stays float64); returns the dtype of q."""
    if top_blocks >= -(-k.shape[2] // block_size):  # every block: exact attention (attend_pages)
        top_blocks += 1
    return attend_pages(q, k, v, key_padding_mask, causal, scale, block_size, top_blocks - causal,
                        lambda k: block_means(k, block_size), lambda q, means: q @ means.mT, top_p)
