"""Hybrid attention: a local window and selected key groups attended exactly, and a coarse summary
for every other key.

Keys are counted by **rank** among the real keys (padding removed), so a padded batch computes
exactly what each of its items computes alone. For query ``i`` the keys fall in three sets:

- the **window**: ``window`` keys around ``i`` (causal: the ``window`` keys up to ``i``);
- the **selected leaves**: the ``num_selected`` leaves (groups of ``block_size`` keys) that score
  highest for ``i`` among its block's candidates, counting only keys ``i`` may select (not in its
  window; causal: before it);
- the **rest**, by ``num_summaries`` coarse groups. A coarse group ``c`` enters as one summary:
  its count ``n'`` and mean key and value over the keys of ``c`` not attended exactly, weighted
  ``n' exp(s q.k')``. So no key is silently dropped.

Equivalently, it is softmax attention in which every key not attended exactly has its logit
replaced by the mean logit of its coarse group's keys not attended exactly. ``naive.py``
computes exactly this, densely.

**The key tree** (``index.py``): leaves of ``block_size`` keys, grouped by similarity
(``grouping="tree"``: each node split at the median of its keys' projections on their top
principal direction) or by position (``"contiguous"``). Non-causal, one tree over all keys;
its nodes at depth ``log2(num_summaries)`` are the coarse groups. Causal, the tree splits by
position down to **sealed chunks** of ``chunk_size`` keys and by similarity inside each chunk,
so no group mixes a key with later ones; the coarse groups are runs of ranks, and a query
summarises only the keys before its window.

**Selection** (``select.py``): queries go in blocks of :data:`~.options.QUERY_BLOCK` consecutive
queries that share one **beam descent** of the tree: from every node of the level with ``beam``
nodes, each level keeps the ``beam`` children that some query of the block scores best relative
to its other choices (a node's score: the largest logit a key reaches along the node's principal
direction, plus the log of its count), down to nodes of ``candidates / beam`` leaves, whose
leaves are the block's candidates: ``candidates`` leaves for O(beam log N) node scores per
block. With at most ``candidates`` leaves every leaf is a candidate. The first ``sinks`` leaves
(where pretrained models park attention: StreamingLLM's attention sinks, Xiao et al. 2023) are
always candidates. Causal, a block descends only through the chunks sealed before the chunk
preceding its first window, its descent scores nodes for the 64 queries that end at its first
query (nothing later steers a choice), and its **recent keys** (from there to each query's
window) are always candidates, in leaves by position. Each query then scores its candidate
leaves exactly, by the log-sum-exp of the logits of the keys it may select in them, and takes
the best ``num_selected``. The idea of compressed + selected + window terms follows Native Sparse
Attention (Yuan et al. 2025); grouping by key similarity, clustered attention (Vyas et al. 2020);
scoring a group by its mean key, MoBA (Lu et al. 2025), as ``scoring="mean"`` does.

**Budget**: ``budget`` = keys attended exactly + summaries, per query. The parts not given are
derived from it: ``num_summaries`` = the largest power of two <= ``budget / 8``, ``window`` =
``budget // 8``, ``num_selected`` = ``(budget - window - num_summaries) // block_size`` (64 ->
window 8, 12 leaves of 4, 8 summaries; chosen on all-MiniLM-L6-v2, ``benchmarks/real_fidelity.py``),
``candidates`` = 8 per selected leaf (at least 128), ``beam`` = a quarter of them. At ``budget >=``
the number of real keys the op is exact attention. Measured on SmolLM2-135M-Instruct's causal
attention at 2k-8k tokens in ``benchmarks/results/long_fidelity.md``.

Selection is discrete and has no gradient; everything else (window, selected keys, summaries) is
differentiable. Cost per query: ``O((window + candidates * block_size + beam log N) D)``, plus the
tree, ``O(D log N)`` per key and power-iteration step; causal adds up to ``2 chunk_size +
QUERY_BLOCK`` recent keys. How it is computed: on CPU without autograd by a compiled kernel
(``kernel.py``, ``kernel_tree.py``; numba), elsewhere and with gradients in torch (``attend.py``),
the two tested equal; FLOPs: ``flops.py``. Decoding one token at a time against a growing cache
and its index, without rebuilding the tree: :class:`~.decode.HybridDecodeState` (``decode.py``).
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import Tensor

from ...registry import register_method
from .._masks import compute_dtype, compute_precision
from ..softmax import sdpa
from .attend import hybrid_core, window_starts
from .decode import HybridDecodeState
from .index import numpy_path
from .flops import flops
from .options import HybridOptions, HybridPlan, plan

__all__ = ["HybridDecodeState", "HybridOptions", "HybridPlan", "hybrid_attention", "plan", "flops", "torch_path"]


@register_method(
    "hybrid",
    options=HybridOptions,
    summary="window + selected key groups exactly + coarse summaries of the rest",
    causal=True,
    cross_attention=True,
    complexity="linear",
    flops=flops,
    test_options={"budget": 9, "block_size": 2, "window": 3, "num_selected": 2, "num_summaries": 2,
                  "candidates": 4, "beam": 2, "chunk_size": 4},
    fullgraph_with_padding=False,  # padding is removed first: shapes from the mask
    decode_state=HybridDecodeState,
)
def hybrid_attention(q, k, v, key_padding_mask, causal, scale, *, options: HybridOptions):
    """Hybrid attention (see the module docstring).

    Shapes: q ``(B, H, N, D)``, k ``(B, H, M, D)``, v ``(B, H, M, Dv)`` -> ``(B, H, N, Dv)``.
    Padded keys are never attended, selected or summarised; a query with no real key outputs
    zeros. Causal: query ``i`` sees the keys at positions ``<= i``. Computes in float32 (float64
    stays float64), also under autocast."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    o = options
    if o.budget >= k.shape[2]:
        return sdpa(q, k, v, key_padding_mask, causal, scale)
    dtype = compute_dtype(q.dtype)
    with compute_precision(q):
        qc, kc, vc = q.to(dtype), k.to(dtype), v.to(dtype)
        if key_padding_mask is None or not bool(key_padding_mask.any()):
            out = _batch(qc, kc, vc, None, causal, scale, o)
        else:  # each item over its own real keys
            out = torch.cat([_batch(qc[b: b + 1], kc[b: b + 1], vc[b: b + 1], key_padding_mask[b], causal, scale, o)
                             for b in range(q.shape[0])])
    return out.to(q.dtype)


def _batch(q: Tensor, k: Tensor, v: Tensor, padding: Tensor | None, causal: bool, scale: float,
           o: HybridOptions) -> Tensor:
    """Items that share their padding ``(M,)`` (True = padded; or None). The approximation runs
    over the real keys only; in self-attention (``N == M``) over the real queries too, and the
    queries at padded positions output zeros."""
    B, H, N, _ = q.shape
    M = k.shape[2]
    Mv = M if padding is None else M - int(padding.sum())
    if Mv == 0:
        return q.new_zeros(B, H, N, v.shape[-1])
    if o.budget >= Mv:
        mask = None if padding is None else padding.expand(B, M)
        return sdpa(q, k, v, mask, causal, scale)
    if padding is not None:
        keep = (~padding).nonzero().squeeze(-1)
        k, v = k.index_select(2, keep), v.index_select(2, keep)
        if N == M:
            out = _approximate(q.index_select(2, keep), k, v, None, causal, scale, o)
            return q.new_zeros(B, H, N, v.shape[-1]).index_copy(2, keep, out)
    return _approximate(q, k, v, None if padding is None else ~padding, causal, scale, o)


def _approximate(q: Tensor, k: Tensor, v: Tensor, valid: Tensor | None, causal: bool, scale: float,
                 o: HybridOptions) -> Tensor:
    """The estimator over real keys ``k``, ``v`` (rank order); ``valid`` ``(M,)``: which key
    positions they came from (cross-attention with padding), for the windows."""
    N, Mv = q.shape[2], k.shape[2]
    M = Mv if valid is None else valid.shape[0]
    p = plan(o, Mv, causal)
    lo = window_starts(N, M, valid, p.window, causal)
    tracked = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    kernel = None if tracked or not _KERNEL_ON[0] or not numpy_path(q.detach()) else _kernel()
    if kernel is None:
        return hybrid_core(q, k, v, lo, causal, scale, p)
    return kernel.hybrid_kernel(q, k, v, lo, scale, p)


_KERNEL_ON = [True]  # False inside torch_path()


@contextlib.contextmanager
def torch_path():
    """Within this context hybrid runs its torch path on the CPU too, as on other devices (the
    compiled kernel is off): to profile the path's stages or compare the two. Not thread-safe."""
    before = _KERNEL_ON[0]
    _KERNEL_ON[0] = False
    try:
        yield
    finally:
        _KERNEL_ON[0] = before


@functools.cache
def _kernel():
    """The compiled CPU kernel (:mod:`.kernel`), or None where numba does not import."""
    try:
        from . import kernel
    except ImportError:  # pragma: no cover - numba is a dependency; a platform without its wheels
        return None
    return kernel
