"""hybrid's matmul FLOPs, counted as ``torch.utils.flop_counter`` counts the torch path."""

from __future__ import annotations

from . import options as _options
from .attend import runs, window_starts
from .options import HybridOptions, HybridPlan, plan

__all__ = ["flops"]


def _tree_flops(p, D: int) -> int:
    """The key tree's node summaries and splits (``index.node_stats``): per level computed, the
    mean, the distances, each power-iteration step and the projection."""
    S, it = p.slots, p.tree_iterations
    total = 0
    for level in range(p.depth + 1):
        if p.start_level < level <= p.final_level or p.chunk_level <= level < p.depth:
            total += (6 + 4 * it) * S * D + (it + 1) * 2 * D * (1 << level)
    return total


def _descent_flops(p: HybridPlan, beam: int, nq: int, D: int) -> tuple[int, int]:
    """FLOPs of the descents of ``nq`` queries (per block or alone: the same count) keeping
    ``beam`` nodes per level, and the number of leaves each ends on."""
    per_score = 2 if p.scoring == "mass" else 1  # products with the means and the principal directions
    K, total = 1 << p.start_level, 0
    for _ in range(p.start_level + 1, p.final_level + 1):
        total += per_score * 2 * nq * 2 * K * D
        K = min(beam, 2 * K)
    return total, K << (p.depth - p.final_level)


def flops(B, H, N, M, D, Dv, o) -> int:
    """Matmul FLOPs of one non-causal float32 forward without padding."""
    if o["budget"] >= M:
        return 2 * B * H * N * M * (D + Dv)
    p = plan(HybridOptions(**o), M, False)
    qb = _options.QUERY_BLOCK
    nb = -(-N // qb)
    nq = nb * qb
    total = _tree_flops(p, D)
    block, tree = _descent_flops(p, p.beam, nq, D)  # each block's descent
    own_descent, own = _descent_flops(p, p.query_beam, nq, D) if p.query_beam else (0, 0)  # each query's own
    total += block + own_descent
    L = tree + p.sinks  # tree leaves and the sink leaves
    total += 2 * nq * p.block_size * own * (D + Dv)
    lo = window_starts(N, M, None, p.window, False)
    lo += lo[-1:] * (nq - N)
    for blocks, U, _ in runs(lo, None, p, qb, (L + qb * own) * p.block_size, (D + Dv) * 4):
        total += 2 * (blocks.stop - blocks.start) * qb * (U + p.block_size * L) * (D + Dv)
    total += 2 * nq * p.num_summaries * (D + Dv)  # the summaries' logits and values
    return B * H * total
