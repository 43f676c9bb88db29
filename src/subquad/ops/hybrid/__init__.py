"""Hybrid attention: a local window and selected key groups attended exactly, and a coarse summary
for every other key.

For query ``i`` the keys fall in three sets:

- the **window**: ``window`` keys around ``i`` (causal: ``i - window + 1 .. i``);
- the **selected groups**: the ``num_selected`` key groups (leaves of ``block_size`` keys) that
  score highest for ``i``; keys of a selected group that are in the window count once. With more
  than ``candidates`` leaves, selection runs in two stages (see :func:`_candidate_nodes`), so
  its cost per query does not grow like ``N / block_size``;
- the **rest**, split by ``num_summaries`` coarse groups. A coarse group ``c`` enters as one
  summary: its count ``n'`` and mean key and value over the keys of ``c`` that are not attended
  exactly, weighted ``n' exp(s q.k') `` in the normaliser. So no key is silently dropped.

Equivalently, it is softmax attention in which every key not attended exactly has its logit
replaced by the mean logit of its coarse group's keys not attended exactly (``s q.k'`` is that
mean). ``naive.py`` computes exactly this, densely.

Grouping (``grouping``): ``"contiguous"`` blocks of positions, or ``"tree"``, keys grouped by
similarity: split the keys recursively at the median of their top principal direction (power
iteration) down to leaves of ``block_size``; the coarse groups are the tree's nodes at depth
``log2(num_summaries)``. Scoring (``scoring``) of a group for a query (scale ``s``):
``"second_order"``, ``s q.k_mean + log n + s^2 Var_j(q.k_j) / 2`` (the log of a group's
attention mass to second order), for a leaf with the exact variance of its keys' logits, for a
first-stage node with the variance from the rank-2 principal part of its key deviations (exact up
to :data:`EXACT_VARIANCE` keys); ``"bounds"``, the largest ``s q.k`` a key within
the group's elementwise key min/max box can reach (Quest, Tang et al. 2024); ``"mean"``,
``s q.k_mean`` (MoBA, Lu et al. 2025). The idea of compressed + selected + window terms follows
Native Sparse Attention (Yuan et al. 2025); grouping by key similarity follows clustered attention
(Vyas et al. 2020).

Budget: ``budget`` = keys attended exactly + summaries, per query. The parts not given are
derived from it: ``num_summaries`` = the largest power of two <= ``budget / 8``, ``window`` =
``budget // 8``, ``num_selected`` = ``(budget - window - num_summaries) // block_size`` (with
``block_size`` 4: 64 -> window 8, 12 groups of 4, 8 summaries). This split was chosen on the Q, K, V
of all-MiniLM-L6-v2 (``benchmarks/real_fidelity.py``): there, exact keys spent on selected groups
of 4 buy more than a wider window or groups of 8. At ``budget >= M`` the op is exact attention.

Causal mode uses contiguous groups only (a tree over all keys would let later keys steer the
choice): the window, groups that end before the window, and summaries of the keys before the
window, built from prefix sums, so nothing after ``i`` is read. Selection is discrete and has no
gradient; everything else (window, selected keys, summaries) is differentiable.

How it is computed: queries go in blocks of about :data:`QUERY_BLOCK` that share their candidate
leaves. One product of a block's queries with its window keys and its candidates' keys gives
every logit the block needs: the leaf scores (mean, log count and variance of each leaf's
logits), and the exact keys' logits, picked from it; the exact keys' weights are scattered back
into a dense row and take one product with the same keys' values. No per-query gathers: every
product is a dense matrix product of a block. Cost: O(N (window + candidates * block_size) D),
the tree, O(N D log N) per power iteration, and the first stage, every query against about
``sqrt(N / block_size)`` nodes (so O(N^1.5 D); its memory is bounded by scoring a chunk of query
blocks at a time); at N = 16384 and D = 64 about 5% of exact attention's FLOPs. On a 2-core CPU
it is 4.7x faster than SDPA at N = 16384 and about as fast at 4096, far from that FLOP ratio: the
products are about a third of its time, the tree's passes over the keys, the first stage, the
leaf scores and the many small kernels of the per-query selection the rest
(``benchmarks/results/hybrid_speed.md``, ``hybrid_profile.md``). ``candidates`` = 128 leaves keeps selection
in one stage up to 512 keys (with ``block_size`` 4), where the fidelity was measured; two-stage
selection costs fidelity: scoring half the leaves through first-stage nodes of 16 leaves raised
the error on all-MiniLM-L6-v2 from 0.111 to 0.211 at budget 64
(``benchmarks/results/real_fidelity.md``), and past 512 keys (no real attention of that length
was measured) every default call selects in two stages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from ...checks import check_choice, check_int
from ...registry import register_method
from .._common import modes_active, one_thread, over_threads
from .._masks import compute_dtype, compute_precision
from ..softmax import softmax_attention

__all__ = ["HybridOptions", "HybridPlan", "hybrid_attention", "plan", "flops", "build_groups"]

GROUPINGS = ("tree", "contiguous")
SCORINGS = ("second_order", "bounds", "mean")


@dataclass
class HybridOptions:
    """``budget``: keys attended exactly + summaries per query (default 64); ``window``,
    ``block_size``, ``num_selected`` (groups attended exactly per query), ``num_summaries``
    (coarse groups; a power of two for the tree): the parts, derived from the budget when None;
    ``grouping``: ``"tree"`` or ``"contiguous"`` (None: tree, contiguous when causal);
    ``scoring``: ``"second_order"``, ``"bounds"`` or ``"mean"``; ``query_group``: queries that
    share one selection (by their mean query; 1 = per query; must be 1 when causal);
    ``tree_iterations``: power-iteration steps per tree split; ``candidates``: leaves scored per
    query (more leaves than this are chosen in two stages, see :func:`_candidate_nodes`)."""

    budget: int = 64
    window: int | None = None
    block_size: int = 4
    num_selected: int | None = None
    num_summaries: int | None = None
    grouping: str | None = None
    scoring: str = "second_order"
    query_group: int = 1
    tree_iterations: int = 4
    candidates: int = 128

    def __post_init__(self):
        check_int("hybrid", "budget", self.budget, minimum=1)
        check_int("hybrid", "block_size", self.block_size, minimum=1)
        check_int("hybrid", "query_group", self.query_group, minimum=1)
        check_int("hybrid", "tree_iterations", self.tree_iterations, minimum=1)
        check_int("hybrid", "candidates", self.candidates, minimum=1)
        for name in ("window", "num_selected"):
            if getattr(self, name) is not None:
                check_int("hybrid", name, getattr(self, name), minimum=0)
        if self.num_summaries is not None:
            check_int("hybrid", "num_summaries", self.num_summaries, minimum=1)
        if self.grouping is not None:
            check_choice("hybrid", "grouping", self.grouping, GROUPINGS)
        check_choice("hybrid", "scoring", self.scoring, SCORINGS)


@dataclass(frozen=True)
class HybridPlan:
    """The resolved parts for one call: every field set."""

    window: int
    block_size: int
    num_selected: int
    num_summaries: int
    grouping: str
    scoring: str
    query_group: int
    tree_iterations: int
    candidates: int


def plan(o: HybridOptions, n_keys: int, causal: bool) -> HybridPlan:
    """Split ``o.budget`` into window, selected groups and summaries (the rule in the module
    docstring), and check the combination against the call."""
    summaries = o.num_summaries
    if summaries is None:
        summaries = 1 << max(0, int(math.log2(max(1, o.budget // 8))))
    window = o.budget // 8 if o.window is None else o.window
    selected = o.num_selected
    if selected is None:
        selected = max(0, (o.budget - window - summaries) // o.block_size)
    grouping = o.grouping or ("contiguous" if causal else "tree")
    if causal and grouping != "contiguous":
        raise ValueError("hybrid: causal=True needs grouping='contiguous' (a tree groups later keys with earlier ones)")
    if causal and o.query_group != 1:
        raise ValueError("hybrid: causal=True needs query_group=1 (a shared choice would read later queries)")
    if grouping == "tree" and summaries & (summaries - 1):
        raise ValueError(f"hybrid: num_summaries must be a power of two with grouping='tree', got {summaries}")
    return HybridPlan(min(window, n_keys), o.block_size, selected, summaries, grouping, o.scoring,
                      o.query_group, o.tree_iterations, o.candidates)


# ----------------------------------------------------------------------------------------------
# grouping


def _rows(x: Tensor, idx: Tensor, out: Tensor | None = None) -> Tensor:
    """Rows of ``x`` ``(B, H, M, D)`` picked per head by ``idx`` ``(B, H, *shape)`` (values in
    ``[0, M)``): ``(B, H, *shape, D)``, written into ``out`` when given (no autograd). Copies
    whole rows (``index_select``), many times faster than an elementwise ``gather`` with an
    expanded index."""
    B, H, M, D = x.shape
    base = (torch.arange(B * H, device=x.device) * M).view(B, H, *([1] * (idx.dim() - 2)))
    flat = (idx + base).flatten()
    if out is None:
        return x.reshape(B * H * M, D).index_select(0, flat).view(*idx.shape, D)
    return torch.index_select(x.reshape(B * H * M, D), 0, flat, out=out.view(-1, D)).view(*idx.shape, D)


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


def _numpy_path(x: Tensor) -> bool:
    """Whether a selection step on ``x`` may run in numpy: a float32/float64 CPU tensor without
    autograd, outside ``torch.compile`` and outside dispatch and function modes (which numpy would
    bypass)."""
    return (x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and not x.requires_grad
            and not torch.compiler.is_compiling() and not modes_active())


def _largest(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The ``k`` largest entries of each row of ``x`` (last dimension) and their indices, in no
    particular order. On CPU numpy's ``argpartition`` (a selection, no sort): 5 ms against 17 ms
    for ``torch.topk`` on 16384 rows of 128, one thread, torch 2.13."""
    n = x.shape[-1]
    if k == 0 or not _numpy_path(x):
        return x.topk(k, dim=-1, sorted=False)
    idx = torch.from_numpy(np.ascontiguousarray(np.argpartition(x.contiguous().numpy(), n - k, axis=-1)[..., n - k:]))
    return x.gather(-1, idx), idx


def _halves(proj: Tensor) -> Tensor:
    """A permutation of each row of ``proj`` (last dimension, even length ``m``) whose first
    ``m / 2`` entries index its ``m / 2`` smallest values: a median split. On CPU numpy's
    ``argpartition`` (linear time; the order within each half is arbitrary), elsewhere a stable
    sort."""
    m = proj.shape[-1]
    if not _numpy_path(proj):
        return proj.argsort(dim=-1, stable=True)
    return torch.from_numpy(np.argpartition(proj.contiguous().numpy(), m // 2 - 1, axis=-1))


def _tree_depth(n_keys: int, block_size: int) -> int:
    return max(0, math.ceil(math.log2(max(1, -(-n_keys // block_size)))))


def _principal_projection(x: Tensor, valid: Tensor, iterations: int) -> Tensor:
    """Projections ``(..., n)`` of the centred valid rows of ``x`` ``(..., n, D)`` on their top
    principal direction (power iteration from the row farthest from the mean); +inf at invalid
    rows. The deviations are never formed: ``(x - mean) u = x u - mean . u``, so each step reads
    ``x`` twice and writes nothing of its size."""
    w = valid.to(x.dtype)
    mean = (w.unsqueeze(-2) @ x) / w.sum(-1, keepdim=True).clamp_min(1).unsqueeze(-1)  # (..., 1, D)

    # products with x as row vector times x^T: (1, D) @ (D, n) runs several times faster on CPU
    # than (n, D) @ (D, 1)
    def centred(u):  # (x_j - mean) . u, zero at invalid rows
        return ((u.unsqueeze(-2) @ x.mT).squeeze(-2) - (mean @ u.unsqueeze(-1)).squeeze(-1)) * w

    dist = (torch.linalg.vector_norm(x, dim=-1).square_() - 2 * (mean @ x.mT).squeeze(-2)
            + mean.square().sum(-1)) * w
    far = dist.argmax(-1, keepdim=True)
    u = (x.gather(-2, far.unsqueeze(-1).expand(*far.shape, x.shape[-1])) - mean).squeeze(-2)
    for _ in range(iterations):
        xu = centred(u)
        u = (xu.unsqueeze(-2) @ x).squeeze(-2) - mean.squeeze(-2) * xu.sum(-1, keepdim=True)
        u = u / u.norm(dim=-1, keepdim=True).clamp_min(1e-30)
    return centred(u).masked_fill(~valid, math.inf)


def build_groups(k: Tensor, valid: Tensor, p: HybridPlan) -> tuple[Tensor, Tensor, int]:
    """Order the keys so that every leaf (``block_size`` slots) and every coarse group is a
    contiguous run of slots.

    k ``(B, H, M, D)``, valid ``(B, M)`` bool (True = a real key). Returns ``order``
    ``(B, H, S)``, a permutation of ``0 .. S-1`` giving the key position in each slot (positions
    ``>= M`` are padding slots), ``slot_valid`` ``(B, H, S)`` and ``coarse_size`` (slots per
    coarse group). Contiguous: slots are positions, ``S`` is ``M`` rounded up to whole coarse
    groups of whole leaves. Tree: ``S = block_size * 2**depth``; at each level every node's
    slots are split at the median of the projection of their keys on the node's top principal
    direction (invalid slots count as +inf, so they go to the upper half; :func:`_halves`)."""
    B, H, M, D = k.shape
    bs = p.block_size
    if p.grouping == "contiguous":
        coarse = -(-M // (p.num_summaries * bs)) * bs
        S = coarse * p.num_summaries
    else:
        depth = max(_tree_depth(M, bs), int(math.log2(p.num_summaries)))
        S = bs << depth
        coarse = S // p.num_summaries
    order = torch.arange(S, device=k.device).expand(B, H, S).contiguous()
    slot_valid = F.pad(valid, (0, S - M)).unsqueeze(1).expand(B, H, S).contiguous()
    if p.grouping == "contiguous":
        return order, slot_valid, coarse
    x = _rows(k, order.clamp_max(M - 1))  # keys in slot order, kept in step with ``order``
    for level in range(int(math.log2(S // bs))):
        nodes = 1 << level
        sv = slot_valid.view(B, H, nodes, S // nodes)
        proj = _principal_projection(x.view(B, H, nodes, S // nodes, D), sv, p.tree_iterations)
        rank = _halves(proj)
        order = order.view(B, H, nodes, -1).gather(-1, rank).view(B, H, S)
        slot_valid = sv.gather(-1, rank).view(B, H, S)
        # rows move within their node only: a local gather, cache-friendly at the deep levels
        x = _rows(x, (rank + torch.arange(0, S, S // nodes, device=k.device)[:, None]).view(B, H, S))
    return order, slot_valid, coarse


# ----------------------------------------------------------------------------------------------
# selection


# gathered window and candidate keys and values of one (batch, head) per run of query blocks (see
# _runs): small enough that a run's gathered rows, logits and weights stay in a 2-core CPU's cache
# (one head, N = 16384, one thread: 118 ms per call at 4 MiB, 137 ms at 16 MiB, 142 ms at 1 MiB)
CHUNK_BYTES = 1 << 22
QUERY_BLOCK = 64  # queries (about) that share one set of candidate leaves (see _block_size)


def leaves_per_node(n_leaves: int, candidates: int) -> int:
    """Leaves per first-stage node: all of them (one stage) when there are at most
    ``candidates``, else the power of two nearest above ``sqrt(n_leaves)``."""
    if n_leaves <= candidates:
        return n_leaves
    return 1 << math.ceil(math.log2(math.sqrt(n_leaves)))


def _phi(q: Tensor, scoring: str) -> Tensor:
    """Query features the group vectors are matched against (``bounds``: the positive and the
    negative part of q, against the group's elementwise key max and min)."""
    return torch.cat([q.clamp_min(0), q.clamp_max(0)], -1) if scoring == "bounds" else q


EXACT_VARIANCE = 4  # groups of at most this many slots score with their exact key variance


def _principal(dev: Tensor, r: int) -> Tensor:
    """``sigma_t v_t`` of the top ``r`` singular pairs of each ``(n, D)`` matrix ``dev``
    ``(..., n, D)`` -> ``(..., r, D)``, from the smaller of its Gram and covariance matrices.
    Groups of at most ``EXACT_VARIANCE`` slots return their rows themselves: every pair, so the
    variance is exact, and no small eigenproblems (slow on CPU when there are many)."""
    n, D = dev.shape[-2:]
    if n <= EXACT_VARIANCE:
        return dev
    r = min(r, n, D)
    if n <= D:
        _, evecs = _eigh(dev @ dev.transpose(-2, -1))
        return evecs[..., -r:].transpose(-2, -1) @ dev
    evals, evecs = _eigh(dev.transpose(-2, -1) @ dev)
    return (evecs[..., -r:] * evals[..., None, -r:].clamp_min(0).sqrt()).transpose(-2, -1)


def _eigh(a: Tensor) -> tuple[Tensor, Tensor]:
    """``torch.linalg.eigh`` of a batch of small matrices, on one thread on CPU (see
    :func:`~subquad.ops._common.one_thread`: 512 matrices of 64 x 64 took 0.5 s on one thread,
    40-80 s on two with the second core loaded; torch 2.13)."""
    with one_thread(a.device.type == "cpu"):
        return torch.linalg.eigh(a)


def group_vectors(x: Tensor, sv: Tensor, scoring: str) -> tuple[Tensor, Tensor]:
    """What a group of keys (a first-stage node; a leaf for ``bounds``) is scored by against the
    query features. x ``(..., G, n, D)``, sv ``(..., G, n)`` (real keys)
    -> vectors ``(..., G, r, Dphi)`` and key counts ``(..., G)``. ``mean``: the mean key;
    ``bounds``: the elementwise max and min, as one vector; ``second_order``: the mean key and
    the rank-2 principal part of the deviations (all of them for groups of up to
    :data:`EXACT_VARIANCE` slots)."""
    count = sv.sum(-1)
    w = sv.unsqueeze(-1).to(x.dtype)
    mean = (x * w).sum(-2) / count.clamp_min(1).unsqueeze(-1).to(x.dtype)
    if scoring == "mean":
        return mean.unsqueeze(-2), count
    if scoring == "bounds":
        big = torch.finfo(x.dtype).max
        hi = x.masked_fill(~sv.unsqueeze(-1), -big).amax(-2)
        lo = x.masked_fill(~sv.unsqueeze(-1), big).amin(-2)
        empty = (count == 0).unsqueeze(-1)
        return torch.cat([hi.masked_fill(empty, 0.0), lo.masked_fill(empty, 0.0)], -1).unsqueeze(-2), count
    return torch.cat([mean.unsqueeze(-2), _principal((x - mean.unsqueeze(-2)) * w, 2)], -2), count


def group_scores(phi: Tensor, vecs: Tensor, count: Tensor, scoring: str, scale: float) -> Tensor:
    """phi ``(..., Q, Dphi)``, vecs ``(..., G, r, Dphi)``, count ``(..., G)`` -> ``(..., Q, G)``;
    -inf for a group without keys."""
    G, r = vecs.shape[-3], vecs.shape[-2]
    # columns vector-major, (r, G): each vector's products with every group is one contiguous
    # plane, so the variance below is a few whole-plane passes (a reduction over a dimension of
    # 2-5 elements is several times slower on CPU)
    proj = (phi @ vecs.transpose(-3, -2).flatten(-3, -2).transpose(-2, -1)).unflatten(-1, (r, G))
    score = proj[..., 0, :] * scale
    if scoring == "second_order":
        n = count.clamp_min(1).to(score.dtype).unsqueeze(-2)
        var = proj[..., 1, :].square() if r > 1 else torch.zeros_like(score)
        for t in range(2, r):
            var.addcmul_(proj[..., t, :], proj[..., t, :])
        score = score + n.log() + 0.5 * scale * scale * var / n
    return score.masked_fill((count == 0).unsqueeze(-2), -math.inf)


def _window_bounds(N: int, M: int, w: int, causal: bool, device) -> Tensor:
    """First key position of each query's window ``(N,)`` (may be negative when causal); it never
    decreases with the query."""
    i = torch.arange(N, device=device)
    if causal:
        return i - w + 1
    center = (2 * i + 1) * M // (2 * N)
    return (center - w // 2).clamp(0, M - w)


def _extend(x: Tensor, n: int, dim: int) -> Tensor:
    """``x`` lengthened to ``n`` along ``dim`` by repeating its last entry."""
    extra = n - x.shape[dim]
    if extra == 0:
        return x
    last = x.narrow(dim, x.shape[dim] - 1, 1)
    return torch.cat([x, last.expand(*x.shape[:dim], extra, *x.shape[dim + 1:])], dim)


def _candidate_nodes(phi, ko, slot_valid, lo, p: HybridPlan, scale: float, causal: bool, qpb: int):
    """First stage of selection: the nodes (runs of :func:`leaves_per_node` leaves, subtrees of
    the tree) whose leaves are the candidates of each block of ``qpb`` (pooled) queries,
    ``(B, H, nb, c)``, and whether each is a real pick. A block takes the ``candidates //
    per_node`` nodes with the highest score for any of its queries (causal: for its first query,
    among nodes that end before that query's window). With at most ``candidates`` leaves there
    is one node, every block's candidate."""
    B, H, S, D = ko.shape
    per_node = leaves_per_node(S // p.block_size, p.candidates)
    nodes, nb = S // (per_node * p.block_size), phi.shape[2] // qpb
    if nodes == 1:
        node = torch.zeros(B, H, nb, 1, dtype=torch.long, device=ko.device)
        return node, torch.ones_like(node, dtype=torch.bool)
    vecs, count = group_vectors(ko.view(B, H, nodes, -1, D), slot_valid.view(B, H, nodes, -1), p.scoring)
    ends = (torch.arange(nodes, device=ko.device) + 1) * per_node * p.block_size
    c = min(max(1, p.candidates // per_node), nodes)
    # the (pooled) queries of a chunk of blocks against every node in one product per head; the
    # chunks keep that product near CHUNK_BYTES (all queries at once would be O(N^1.5) memory)
    step = max(1, CHUNK_BYTES // (B * H * qpb * vecs.shape[-3] * vecs.shape[-2] * phi.element_size()))
    picks = []
    for b0 in range(0, nb, step):
        b1 = min(b0 + step, nb)
        score = group_scores(phi[:, :, b0 * qpb: b1 * qpb], vecs, count, p.scoring, scale).unflatten(2, (-1, qpb))
        if causal:  # query_group is 1: block b starts at query b * qpb
            first = lo[b0 * qpb: b1 * qpb: qpb].clamp_min(0)
            block_score = score[:, :, :, 0].masked_fill(ends[None, :] > first[:, None], -math.inf)
        else:
            block_score = score.amax(3)
        picks.append(_largest(block_score, c))
    top, node = (torch.cat(x, dim=2) for x in zip(*picks))
    return node, top > -math.inf


def logit_scores(x: Tensor, count: Tensor, block_size: int, per_node: int, scoring: str) -> Tensor:
    """Scores of leaves from their keys' logits: x ``(..., Q, c * block_size * per_node)``,
    ``s q.k`` over the slots of ``L = c * per_node`` leaves in the candidate layout (see
    :func:`leaf_columns`), **zero** at slots without a real key; count ``(..., 1, L)`` real keys
    per leaf -> ``(..., Q, L)``: the mean logit (``mean``), plus ``log n`` and half the logits'
    variance (``second_order``, the exact variance); -inf for a leaf without real keys. In that
    layout the sums over a leaf are passes over whole planes of ``per_node`` (a reduction over the
    few slots of each leaf is several times slower on CPU)."""
    x = x.unflatten(-1, (-1, block_size, per_node))
    n = count.clamp_min(1).to(x.dtype)
    score = x.sum(-2).flatten(-2) / n
    if scoring == "second_order":
        sq = x[..., 0, :].square()
        for t in range(1, block_size):
            sq.addcmul_(x[..., t, :], x[..., t, :])
        var = (sq.flatten(-2).div_(n) - score.square()).clamp_min_(0)
        score = score + n.log() + 0.5 * var
    return score.masked_fill(count == 0, -math.inf)


@dataclass
class _Call:
    """What the runs of query blocks of one forward share. Queries are padded to whole blocks of
    ``qpb * query_group`` by repeating the last one; ``keys``/``values`` hold the keys by position
    (rows ``0 .. M-1``) and then by slot, slot-major within each first-stage node (rows from
    ``M``, :func:`_slot_major`; keys zero in invalid slots), so one gather fetches both a block's
    window and its candidates, each node a contiguous run."""

    p: HybridPlan
    scale: float
    causal: bool
    q: Tensor  # (B, H, Np, D)
    lo: Tensor  # (Np,) first window position of each query
    phi: Tensor  # (B, H, Np / query_group, Dphi) what leaves are scored against
    node: Tensor  # (B, H, nb, c) candidate nodes of each block
    node_ok: Tensor
    order: Tensor  # (B, H, S) key position in each slot (>= M: a padding slot)
    slot_valid: Tensor
    group_of: Tensor  # (B, H, M) coarse group of each key position
    valid: Tensor  # (B, M)
    keys: Tensor  # (B, H, M + S, D)
    values: Tensor  # (B, H, M + S, Dv)
    leaf_box: Tensor | None  # (B, H, L, 1, 2 D) leaf key boxes, scoring "bounds"
    per_node: int
    qpb: int
    summaries: object  # see _summaries
    scratch: _Scratch


def _leaf_scores(c: _Call, blocks: slice, slots: Tensor, sv: Tensor, lc: Tensor, kc: Tensor) -> Tensor:
    """Scores of the candidate leaves for every query of ``blocks`` ``(B, H, nb, QB, C)``, from
    the candidate logits ``lc`` (pooled queries: from their own logits against the candidate keys
    ``kc``; ``bounds``: from the leaves' key boxes)."""
    p = c.p
    B, H, nbk, cs = slots.shape
    g = p.query_group
    phi = c.phi[:, :, blocks.start * c.qpb: blocks.stop * c.qpb].unflatten(2, (nbk, c.qpb))
    if p.scoring == "bounds":
        box = _rows(c.leaf_box.reshape(*c.node.shape[:2], -1, c.per_node * c.leaf_box.shape[-1]),
                    c.node[:, :, blocks])
        count = sv.view(B, H, nbk, -1, p.block_size, c.per_node).sum(-2).flatten(-2)
        score = group_scores(phi, box.view(B, H, nbk, -1, 1, c.leaf_box.shape[-1]), count, "bounds", c.scale)
    else:  # keys of invalid slots are zero in c.keys, so are their logits
        x = lc if g == 1 else (phi * c.scale) @ kc.transpose(-2, -1)
        count = sv.view(B, H, nbk, 1, -1, p.block_size, c.per_node).sum(-2).flatten(-2)
        score = logit_scores(x, count, p.block_size, c.per_node, p.scoring)
    score = score.masked_fill(~c.node_ok[:, :, blocks].repeat_interleave(c.per_node, -1).unsqueeze(-2), -math.inf)
    return score.repeat_interleave(g, dim=3) if g > 1 else score


def _exact_columns(c: _Call, blocks: slice, U: int, slots: Tensor, lc: Tensor, kc: Tensor):
    """The keys each query of ``blocks`` attends exactly, as columns of its block's gathered rows
    (``U`` window rows, then the candidate slots ``slots`` ``(B, H, nb, Cs)``, in the layout of
    :func:`leaf_columns`): ``cols``, their key positions ``pos`` and whether each is a real one
    ``ok``, ``(B, H, nb, QB, E)``; the window first, then the selected leaves' real keys outside
    the window (window keys count once)."""
    p = c.p
    bs, w, M = p.block_size, p.window, c.group_of.shape[-1]
    B, H, nbk, cs = slots.shape
    lo = c.lo[blocks.start * c.qpb * p.query_group: blocks.stop * c.qpb * p.query_group].view(nbk, -1, 1)
    sv = c.slot_valid.gather(2, slots.flatten(2)).view(slots.shape)
    score = _leaf_scores(c, blocks, slots, sv, lc, kc)
    if p.grouping == "contiguous":  # slots are positions
        start = slots.view(B, H, nbk, -1, bs, c.per_node)[..., 0, :].flatten(-2).unsqueeze(-2)
        end = start + bs  # exclusive
        if c.causal:  # only leaves that end before the window
            blocked = end > lo.clamp_min(0)
        else:  # skip leaves that lie inside the window
            blocked = (start >= lo) & (end.clamp_max(M) <= lo + w)
        score = score.masked_fill(blocked, -math.inf)
    top, leaf = _largest(score, min(p.num_selected, score.shape[-1]))
    col = leaf_columns(leaf, bs, c.per_node).flatten(-2)
    slot = slots.unsqueeze(3).expand(*col.shape[:4], cs).gather(-1, col)
    pos = c.order.gather(2, slot.flatten(2)).view(slot.shape)
    ok = c.slot_valid.gather(2, slot.flatten(2)).view(slot.shape) & (top > -math.inf).repeat_interleave(bs, -1)
    ok &= (pos < lo) | (pos >= lo + w)
    win = lo + torch.arange(w, device=lo.device)  # (nb, QB, w)
    win_ok = ((win >= 0) & (win < M)).unsqueeze(0) & c.valid[:, win.clamp(0, M - 1)]  # (B, nb, QB, w)
    win_col = (win - lo[:, :1]).expand(B, H, *win.shape)
    cols = torch.cat([win_col, U + col], -1)
    pos = torch.cat([win.clamp(0, M - 1).expand(B, H, *win.shape), pos.clamp_max(M - 1)], -1)
    ok = torch.cat([win_ok.unsqueeze(1).expand(B, H, *win.shape), ok], -1)
    return cols, pos, ok


def _attend(c: _Call, blocks: slice, U: int) -> Tensor:
    """Outputs of the queries of ``blocks`` ``(B, H, nb * QB, Dv)``: one product of the block's
    queries with its ``U`` window keys and its candidate keys gives every logit the block needs
    (selection scores and exact logits); the selected ones are picked from it, and the exact
    keys' weights, scattered back into a dense row, take one product with the values."""
    p = c.p
    B, H, _, D = c.q.shape
    M, nbk = c.group_of.shape[-1], blocks.stop - blocks.start
    qb_size = c.qpb * p.query_group
    rows = slice(blocks.start * qb_size, blocks.stop * qb_size)
    wpos = c.lo[rows][::qb_size, None] + torch.arange(U, device=c.q.device)  # (nb, U)
    span = c.per_node * p.block_size
    stored = (c.node[:, :, blocks, :, None] * span + torch.arange(span, device=c.q.device)).flatten(-2)
    idx = torch.cat([wpos.clamp(0, M - 1).expand(B, H, nbk, U), M + stored], -1)
    # the slot of each gathered candidate row (the layout of leaf_columns)
    within = torch.arange(p.block_size, device=c.q.device)[:, None] + torch.arange(0, span, p.block_size,
                                                                                 device=c.q.device)
    slots = (c.node[:, :, blocks, :, None] * span + within.flatten()).flatten(-2)
    E, Dv = idx.shape[-1], c.values.shape[-1]
    kx = _rows(c.keys, idx, c.scratch.get("keys", (B, H, nbk, E, D), c.q))  # (B, H, nb, U + Cs, D)
    vx = _rows(c.values, idx, c.scratch.get("values", (B, H, nbk, E, Dv), c.q))
    qs = c.q[:, :, rows].unflatten(2, (nbk, qb_size)) * c.scale
    logits_all = c.scratch.get("logits", (B, H, nbk, qb_size, E), c.q)
    logits_all = qs @ kx.transpose(-2, -1) if logits_all is None else torch.matmul(qs, kx.mT, out=logits_all)
    with torch.no_grad():
        cols, pos, ok = _exact_columns(c, blocks, U, slots, logits_all[..., U:], kx[..., U:, :])
        egroup = c.group_of.gather(2, pos.flatten(2)).view(pos.shape)
    logits = logits_all.gather(-1, cols).flatten(2, 3)
    qk, count, sub, egroup, values = c.summaries(rows, pos.flatten(2, 3), ok.flatten(2, 3), egroup.flatten(2, 3))

    def exact_values(we):
        dense = c.scratch.get("weights", logits_all.shape, c.q)
        dense = torch.zeros_like(logits_all) if dense is None else dense.zero_()
        return (dense.scatter_add_(-1, cols, we.unflatten(2, (nbk, qb_size))) @ vx).flatten(2, 3)

    return _combine(logits, exact_values, ok.flatten(2, 3), sub, egroup, qk, count, values)


def _runs(N: int, M: int, window: int, causal: bool, qb_size: int, cs: int, row_bytes: int) -> list[tuple[slice, int]]:
    """Runs of query blocks attended together, each with ``U``, the window positions that cover
    its blocks' windows; a run's gathered keys and values take about ``CHUNK_BYTES`` per (batch, head)
    (``row_bytes``: one key and value row of one head). Plain
    integers (the window bounds of :func:`_window_bounds`, which never decrease), so that
    ``torch.compile`` sees fixed sizes."""

    def lo(i):
        return i - window + 1 if causal else min(max((2 * i + 1) * M // (2 * N) - window // 2, 0), M - window)

    span = [lo(min(b + qb_size, N) - 1) - lo(b) for b in range(0, N, qb_size)]
    nb = len(span)
    step = max(1, CHUNK_BYTES // ((max(span) + window + cs) * row_bytes))
    return [(slice(b, min(b + step, nb)), max(span[b: b + step]) + window) for b in range(0, nb, step)]


# ----------------------------------------------------------------------------------------------
# attention


def _slot_sums(ko, vo, slot_valid, coarse_size):
    """Per slot, grouped by coarse group: valid ``(B, H, G, C, 1)``, keys ``(B, H, G, C, D)`` and
    values ``(B, H, G, C, Dv)``, zero in invalid slots (``ko``, ``vo``: keys, values in slot order)."""
    B, H, S, _ = ko.shape
    w = slot_valid.to(ko.dtype).unsqueeze(-1)
    ks, vs = ko * w, vo * w
    G = S // coarse_size
    return w.view(B, H, G, coarse_size, 1), ks.view(B, H, G, coarse_size, -1), vs.view(B, H, G, coarse_size, -1)


def _slot_major(x: Tensor, per_node: int, block_size: int) -> Tensor:
    """Rows ``(B, H, S, D)`` in slot order, reordered within each first-stage node to slot-major
    (all its leaves' first slots, then their second slots, ...; :func:`leaf_columns`), so a block
    gathers each candidate node as one contiguous run of rows."""
    B, H, S, D = x.shape
    return x.view(B, H, -1, per_node, block_size, D).transpose(3, 4).reshape(B, H, S, D)


def leaf_columns(leaf: Tensor, block_size: int, per_node: int) -> Tensor:
    """Columns ``(..., block_size)`` of the slots of candidate leaves ``leaf`` (index ``i * per_node
    + l``: leaf ``l`` of candidate node ``i``) among a block's candidate rows, which hold the
    candidate nodes one after the other, each slot-major: column ``(i * block_size + t) * per_node
    + l`` is slot ``t`` of that leaf."""
    node, within = leaf.div(per_node, rounding_mode="floor"), leaf.remainder(per_node)
    t = torch.arange(block_size, device=leaf.device)
    return ((node * block_size).unsqueeze(-1) + t) * per_node + within.unsqueeze(-1)


def _pooled(q: Tensor, g: int) -> Tensor:
    """The mean query of each run of ``g`` queries ``(B, H, ceil(N / g), D)`` (the last run may
    be shorter)."""
    N = q.shape[2]
    sums = F.pad(q, (0, 0, 0, -N % g)).unflatten(2, (-1, g)).sum(3)
    sizes = (N - torch.arange(0, N, g, device=q.device)).clamp_max(g)
    return sums / sizes.to(q.dtype)[:, None]


def _block_size(query_group: int) -> tuple[int, int]:
    """Pooled queries and queries per block of queries that share candidates: about
    :data:`QUERY_BLOCK` queries, whole runs of ``query_group``."""
    qpb = max(1, QUERY_BLOCK // query_group)
    return qpb, qpb * query_group


def _hybrid_core(q, k, v, valid, causal: bool, scale: float, p: HybridPlan) -> Tensor:
    B, H, N, D = q.shape
    M, bs = k.shape[2], p.block_size
    qpb, qb_size = _block_size(p.query_group)
    nq = -(-N // qb_size) * qb_size
    with torch.no_grad():
        order, slot_valid, coarse_size = build_groups(k, valid, p)
        S = order.shape[-1]
        per_node = leaves_per_node(S // bs, p.candidates)
        extra = -S % (per_node * bs)  # whole nodes: padding slots at positions S, S + 1, ...
        order = torch.cat([order, torch.arange(S, S + extra, device=q.device).expand(B, H, extra)], -1)
        slot_valid = F.pad(slot_valid, (0, extra))
    ko, vo = _rows(k, order.clamp_max(M - 1)), _rows(v, order.clamp_max(M - 1))
    qp = _extend(q, nq, 2)
    with torch.no_grad():
        lo = _extend(_window_bounds(N, M, p.window, causal, q.device), nq, 0)
        phi = _extend(_phi(q if p.query_group == 1 else _pooled(q, p.query_group), p.scoring), nq // p.query_group, 2)
        node, node_ok = _candidate_nodes(phi, ko.detach(), slot_valid, lo, p, scale, causal, qpb)
        leaf_box = None
        if p.scoring == "bounds":
            leaf_box = group_vectors(ko.detach().view(B, H, -1, bs, D), slot_valid.view(B, H, -1, bs), "bounds")[0]
        # the coarse group of every key position: invert the slot order
        slot_group = (torch.arange(order.shape[-1], device=q.device) // coarse_size).expand_as(order)
        group_of = torch.empty_like(order).scatter_(2, order, slot_group)[..., :M]
    summaries = _summaries(qp, ko[:, :, :S], vo[:, :, :S], slot_valid[:, :, :S], coarse_size, lo, causal, scale)
    c = _Call(p, scale, causal, qp, lo, phi, node, node_ok, order, slot_valid, group_of, valid,
              torch.cat([k, _slot_major(ko * slot_valid.unsqueeze(-1), per_node, bs)], 2),
              torch.cat([v, _slot_major(vo, per_node, bs)], 2), leaf_box, per_node, qpb,
              summaries, _Scratch(not torch.compiler.is_compiling()
                                  and not (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)))))
    cs = node.shape[-1] * per_node * bs
    row_bytes = (D + v.shape[-1]) * q.element_size()  # per (batch, head)
    outs = [_attend(c, blocks, U) for blocks, U in _runs(N, M, p.window, causal, qb_size, cs, row_bytes)]
    return torch.cat(outs, 2)[:, :, :N]


def _summaries(q, ko, vo, slot_valid, coarse_size, lo, causal: bool, scale: float):
    """The coarse columns, as a function of a run of query rows and its exact keys (``pos``,
    ``ok``, ``egroup``: ``(B, H, n, E)``) that returns what :func:`_combine` takes: scaled
    ``q . key sums``, counts, which exact keys leave a summary, each one's column, and the value
    function. Non-causal: the coarse groups whole, and every exact key leaves its group."""
    cnt, ks, vs = _slot_sums(ko, vo, slot_valid, coarse_size)
    if causal:
        return _causal_summaries(q, cnt, ks, vs, lo, scale)
    qk = (q @ ks.sum(3).transpose(-2, -1)) * scale
    count, vsum = cnt.sum(3).squeeze(-1).unsqueeze(2), vs.sum(3)

    def columns(rows, pos, ok, egroup):
        return qk[:, :, rows], count, ok, egroup, lambda pc: pc @ vsum

    return columns


def _causal_summaries(q, cnt, ks, vs, lo, scale: float):
    """Causal: the summarised region of query ``i`` is the keys before its window, ``[0, a_i)``.
    Groups that end by ``a_i`` enter whole; the group holding ``a_i`` enters with the part
    before ``a_i`` (within-group prefix sums) as an extra column ``G``, per query. Only selected
    keys (all before ``a_i``) leave a summary."""
    B, H, G, C, _ = cnt.shape
    a = lo.clamp_min(0)
    g_a, r_a = (a // C).clamp_max(G - 1), a % C  # a_i < N <= G C, so g_a < G
    full = torch.arange(G, device=q.device)[None, :] < g_a[:, None]  # (N, G)
    pre_c, pre_k, pre_v = (F.pad(t.cumsum(3), (0, 0, 1, 0))[:, :, :, :-1] for t in (cnt, ks, vs))
    part_c, part_k, part_v = (t[:, :, g_a, r_a] for t in (pre_c, pre_k, pre_v))  # (B, H, N, .)
    tot_k, tot_v = ks.sum(3), vs.sum(3)
    qk = torch.cat([q @ tot_k.transpose(-2, -1), (q * part_k).sum(-1, keepdim=True)], dim=-1) * scale
    count = torch.cat([cnt.sum(3).squeeze(-1).unsqueeze(2) * full, part_c], dim=-1)

    def columns(rows, pos, ok, egroup):
        egroup = torch.where(egroup == g_a[rows, None], G, egroup)
        sub = ok & (pos < a[rows, None])

        def values(pc):
            return pc[..., :G] @ tot_v + pc[..., G:] * part_v[:, :, rows]

        return qk[:, :, rows], count[:, :, rows], sub, egroup, values

    return columns


def _combine(logits, exact_values, ok, sub, egroup, qk, count, values):
    """Softmax over the exact keys and the summaries.

    ``logits`` ``(B, H, N, E)`` of the exact keys (``ok``: real ones); ``exact_values(w)`` maps
    their weights to ``sum_j w_j v_j``; ``qk`` ``(B, H, N, G)``: scaled ``q . (key sum)`` of
    each summary column before taking out exact keys, ``count`` ``(B, H, N or 1, G)`` its keys;
    ``sub`` marks exact keys to take out of their column ``egroup``; ``values(p)`` maps column
    weights ``(B, H, N, G)`` to ``sum_c p_c (value sum of c)``. A summary's logit is the mean
    logit of what is left in it."""
    subf = sub.to(logits.dtype)
    zeros = torch.zeros_like(qk)
    rest = count - zeros.scatter_add(-1, egroup, subf)
    lc = (qk - zeros.scatter_add(-1, egroup, logits * subf)) / rest.clamp_min(1.0)
    lc = lc.masked_fill(rest < 0.5, -math.inf)
    le = logits.masked_fill(~ok, -math.inf)
    m = torch.maximum(le.amax(-1, keepdim=True), lc.amax(-1, keepdim=True)).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    pe, pc = torch.exp(le - m), torch.exp(lc - m)
    we = pe - pc.gather(-1, egroup) * subf  # exact keys out of their summary's value sum
    num = exact_values(we) + values(pc)
    den = pe.sum(-1, keepdim=True) + (pc * rest.clamp_min(0.0)).sum(-1, keepdim=True)
    return num / torch.where(den > 0, den, torch.ones_like(den))


def _vector_flops(n: int, groups: int, D: int, scoring: str) -> tuple[int, int, int]:
    """Matmul FLOPs of :func:`group_vectors` for ``groups`` groups of ``n`` slots, the vectors
    each group is scored by, and their width."""
    if scoring != "second_order":
        return 0, 1, (2 * D if scoring == "bounds" else D)
    if n <= EXACT_VARIANCE:
        return 0, 1 + n, D
    r = min(2, n, D)
    if n <= D:  # Gram matrix, then the principal rows
        return groups * (2 * n * n * D + 2 * r * n * D), 1 + r, D
    return groups * 2 * n * D * D, 1 + r, D  # covariance


def flops(B, H, N, M, D, Dv, o) -> int:
    """Matmul FLOPs of one non-causal float32 forward (counted as ``torch.utils.flop_counter``
    does)."""
    if o["budget"] >= M:
        return 2 * B * H * N * M * (D + Dv)
    p = plan(HybridOptions(**o), M, False)
    bs = p.block_size
    if p.grouping == "tree":
        S = bs << max(_tree_depth(M, bs), int(math.log2(p.num_summaries)))
        levels = int(math.log2(S // bs))
        it = p.tree_iterations  # per level: mean, distances, power iteration, projection
        total = levels * (6 + 4 * it) * S * D + (it + 1) * 2 * D * ((1 << levels) - 1)
    else:
        S = -(-M // (p.num_summaries * bs)) * bs * p.num_summaries
        total = 0
    L = S // bs
    per_node = leaves_per_node(L, p.candidates)
    nodes = -(-L // per_node)
    qpb, qb_size = _block_size(p.query_group)
    nb = -(-N // qb_size)
    c = 1
    if nodes > 1:
        node_cost, rn, width = _vector_flops(per_node * bs, nodes, D, p.scoring)
        c = min(max(1, p.candidates // per_node), nodes)
        total += node_cost + 2 * nb * qpb * nodes * rn * width
    cs = c * per_node * bs
    for blocks, U in _runs(N, M, p.window, False, qb_size, cs, (D + Dv) * 4):
        n = blocks.stop - blocks.start
        total += 2 * n * qb_size * (U + cs) * (D + Dv)  # every logit of the block, exact keys' values
        if p.scoring == "bounds":
            total += 2 * n * qpb * (cs // bs) * 2 * D
        elif p.query_group > 1:  # the pooled queries' logits
            total += 2 * n * qpb * cs * D
    total += 2 * nb * qb_size * p.num_summaries * (D + Dv)  # summaries' logits and values
    return B * H * total


@register_method(
    "hybrid",
    options=HybridOptions,
    summary="window + selected key groups exactly + coarse summaries of the rest",
    causal=True,
    cross_attention=True,
    complexity="linear",
    flops=flops,
    test_options={"budget": 9, "block_size": 2, "window": 3, "num_selected": 2, "num_summaries": 2},
)
def hybrid_attention(q, k, v, key_padding_mask, causal, scale, *, budget, window, block_size, num_selected,
                     num_summaries, grouping, scoring, query_group, tree_iterations, candidates):
    """Hybrid attention (see the module docstring).

    Shapes: q ``(B, H, N, D)``, k ``(B, H, M, D)``, v ``(B, H, M, Dv)`` -> ``(B, H, N, Dv)``.
    Padded keys are never attended, selected or summarised; a query with no real key outputs
    zeros. Computes in float32 (float64 stays float64), also under autocast."""
    M = k.shape[2]
    if scale is None:
        scale = q.shape[-1] ** -0.5
    o = HybridOptions(budget, window, block_size, num_selected, num_summaries, grouping, scoring, query_group,
                      tree_iterations, candidates)
    p = plan(o, M, causal)
    if budget >= M:
        return softmax_attention(q, k, v, key_padding_mask=key_padding_mask, causal=causal, scale=scale)
    dtype = compute_dtype(q.dtype)
    with compute_precision(q):
        valid = (torch.ones(q.shape[0], M, dtype=torch.bool, device=q.device) if key_padding_mask is None
                 else ~key_padding_mask)
        qc, kc, vc = q.to(dtype), k.to(dtype), v.to(dtype)
        tracked = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        if q.device.type != "cpu" or tracked or torch.compiler.is_compiling():
            out = _hybrid_core(qc, kc, vc, valid, causal, scale, p)
        else:
            out = _per_head(qc, kc, vc, valid, causal, scale, p)
    return out.to(q.dtype)


def _per_head(q, k, v, valid, causal, scale, p: HybridPlan) -> Tensor:
    """:func:`_hybrid_core` one (batch, head) at a time, the heads spread over torch's threads
    with one whole head each (:func:`subquad.ops._common.over_threads`): what the CPU runs
    without autograd. Measured at B=1, H=8, D=64 on 2 cores: 22% faster than all heads batched
    at N = 16384 and 15% slower at 4096 on a quiet machine, and 2.0-2.4x faster with one busy
    neighbour process, where each of the batched path's many small kernels waits at a barrier
    for a descheduled thread."""
    B, H, N, _ = q.shape
    out = q.new_empty(B, H, N, v.shape[-1])

    def head(j: int) -> None:
        b, h = divmod(j, H)
        one = slice(b, b + 1), slice(h, h + 1)
        out[one] = _hybrid_core(q[one], k[one], v[one], valid[b: b + 1], causal, scale, p)

    over_threads(head, B * H)
    return out
