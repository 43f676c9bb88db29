"""hybrid's selection: which leaves a block of queries scores exactly (a beam descent of the key
tree, shared by the block), and which of them each query attends (the leaves whose keys' logits
give the highest score).

Scores of a group of keys for a query (scale ``s``), ``"mass"``: the log of the group's attention
mass, ``log sum_j exp(s q.k_j)``: exact for a leaf (from its keys' logits); for a node estimated
as ``s q.mean + log n + s max((q.u) p_max, (q.u) p_min)``: the largest logit a key reaches along
the node's principal direction ``u`` (``p_max``, ``p_min``: the largest and smallest deviation
``(k_j - mean).u``) plus ``log n``. (The second-order estimate ``s^2 Var(q.k) / 2`` grows with
the square of the spread and ranks nodes of a few outlying keys far too high; on SmolLM2 this
estimate selects as well as that one capped by it, at half the elementwise work.) Or
``"mean"``: ``s q.mean`` (MoBA, Lu et al. 2025).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .index import KeyIndex, largest, rows
from . import options as _options
from .options import HybridPlan

__all__ = ["sealed_ends", "descend", "node_vectors", "node_priors", "leaf_scores"]


def sealed_ends(lo_first: int, p: HybridPlan) -> int:
    """Causal: the keys (ranks ``[0, end)``) whose sealed chunks a block whose first query's
    window starts at ``lo_first`` searches through the tree: the chunks before the one before
    the chunk holding that window start. The keys after them and before each query's window are
    its recent keys, candidates in leaves by position."""
    return max(max(lo_first, 0) // p.chunk_size - 1, 0) * p.chunk_size


def _allowed(node: Tensor, level: int, sealed: Tensor | None, p: HybridPlan) -> tuple[Tensor, Tensor] | None:
    """For heap ids ``node`` ``(B, H, nb, K)`` of ``level``: whether each lies in its block's
    sealed region, and whether it straddles its end (a node split by position that must be
    opened); None when everything is allowed (not causal)."""
    if sealed is None:
        return None
    size = p.slots >> level
    start = (node - (1 << level)) * size
    end = start + size
    if level >= p.chunk_level:  # similarity splits: a node holds keys of one chunk, in any order
        start = start // p.chunk_size * p.chunk_size
        end = start + p.chunk_size
    s = sealed.view(-1, 1)
    inside = end <= s
    straddles = (start < s) & (s < end) if level < p.chunk_level else torch.zeros_like(inside)
    return inside, straddles


def descend(q: Tensor, index: KeyIndex, sealed: Tensor | None, p: HybridPlan, scale: float) -> tuple[Tensor, Tensor]:
    """The candidate leaves of each block of queries ``q`` ``(B, H, nb, QB, D)``: start from every
    node of ``start_level``; at each level score the children of the kept nodes by the best
    relative score any query of the block gives them (:func:`_block_scores`) and keep the
    ``beam`` best (+1 when causal, for the node that straddles the sealed end, always opened);
    the leaves of the nodes kept at ``final_level``. Returns the first slot of each candidate leaf
    ``(B, H, nb, L)`` and whether it may be chosen. Causal: ``sealed`` ``(nb,)``, only nodes of sealed chunks count."""
    B, H, nb = q.shape[:3]
    dev = q.device
    keep = p.beam + (sealed is not None)
    vecs = node_vectors(index, p.scoring, scale) if p.final_level > p.start_level else None
    node = torch.arange(1 << p.start_level, 2 << p.start_level, device=dev).expand(B, H, nb, -1)
    score = torch.zeros(node.shape, dtype=q.dtype, device=dev)
    for level in range(p.start_level + 1, p.final_level + 1):
        child = torch.stack([2 * node, 2 * node + 1], -1).flatten(-2)
        alive = (score > -math.inf).repeat_interleave(2, -1)
        allowed = _allowed(child, level, sealed, p)
        usable = alive if allowed is None else alive & allowed[0]
        s = _block_scores(q, index, vecs, child, usable, p)
        if allowed is not None:
            s = s.masked_fill(allowed[1] & alive, math.inf)
        score, pick = largest(s, min(keep, s.shape[-1]))
        node = child.gather(-1, pick)
    per_node = 1 << (p.depth - p.final_level)
    first = (node - (1 << p.final_level)) * (per_node * p.block_size)  # first slot of each node
    leaf = (first.unsqueeze(-1) + torch.arange(0, per_node * p.block_size, p.block_size, device=dev)).flatten(-2)
    ok = (score > -math.inf).repeat_interleave(per_node, -1)
    if sealed is not None:  # only leaves of sealed chunks (a final node may be wider than a chunk)
        ok = ok & ((leaf // p.chunk_size + 1) * p.chunk_size <= sealed.view(-1, 1))
    return leaf, ok


def node_vectors(index: KeyIndex, scoring: str, scale: float) -> Tensor:
    """What a node is scored by, ``(B, H, heap, r * D)``: ``s mean`` and (``mass``) ``s u``."""
    if scoring != "mass":
        return index.mean * scale
    return torch.cat([index.mean * scale, index.direction * scale], -1)


def node_priors(count: Tensor, scoring: str) -> Tensor:
    """A node's score before its keys' logits, from its key ``count``: ``log count`` (``"mass"``)
    or 0 (``"mean"``), -inf where it holds no key."""
    base = count.clamp_min(1).log() if scoring == "mass" else torch.zeros_like(count)
    return base.masked_fill(count == 0, -math.inf)


def _block_scores(q: Tensor, index: KeyIndex, vecs: Tensor, node: Tensor, usable: Tensor, p: HybridPlan) -> Tensor:
    """The best score any query of each block gives each of its nodes ``node`` ``(B, H, nb, K)``,
    each query's scores taken relative to their log-sum-exp over the nodes (so that no query
    whose logits are large everywhere fills the beam alone; relative to the best node's instead,
    many nodes would tie at 0); -inf where not ``usable`` or without keys. A chunk
    of blocks at a time (bounded memory)."""
    B, H, nb, QB, D = q.shape
    K = node.shape[-1]
    r = vecs.shape[-1] // D
    count = index.count.gather(2, node.flatten(2)).view(node.shape)
    base = node_priors(count, p.scoring).masked_fill(~usable, -math.inf).unsqueeze(-2)
    ends = rows(index.ends, node).unsqueeze(-3)  # (B, H, nb, 1, K, 2)
    step = max(1, _options.CHUNK_BYTES // (B * H * QB * K * r * q.element_size()))
    out = []
    for b0 in range(0, nb, step):
        nd = node[:, :, b0: b0 + step]
        v = rows(vecs, nd).view(B, H, nd.shape[2], K * r, D)  # rows: node 0's vectors, node 1's, ...
        proj = (q[:, :, b0: b0 + step] @ v.mT).unflatten(-1, (K, r))
        score = proj[..., 0].add(base[:, :, b0: b0 + step])
        if r > 1:  # + s max((q.u) p_max, (q.u) p_min)
            b, e = proj[..., 1], ends[:, :, b0: b0 + step]
            score.add_(torch.maximum(b * e[..., 0], b * e[..., 1]))
        score = score - score.logsumexp(-1, keepdim=True).nan_to_num(neginf=0.0)
        out.append(score.amax(-2))
    return torch.cat(out, 2)


def leaf_scores(x: Tensor, allowed: Tensor, block_size: int, scoring: str) -> Tensor:
    """Scores of candidate leaves from their keys' logits: x ``(..., Q, block_size * L)``, ``s
    q.k`` of the ``L`` leaves' keys slot-major (column ``t * L + l``: key ``t`` of leaf ``l``);
    allowed ``(..., Q, block_size * L)``: which keys the query may select. Over the allowed keys
    of each leaf: the log-sum-exp of their logits (``mass``) or their mean logit (``mean``);
    -inf for a leaf with none. -> ``(..., Q, L)``. In that layout the reductions over a leaf
    are passes over whole planes (a reduction over the few keys of each leaf is several times
    slower on CPU)."""
    x = x.unflatten(-1, (block_size, -1))
    w = allowed.unflatten(-1, (block_size, -1))
    if scoring == "mass":
        xm = x.masked_fill(~w, -math.inf)
        top = xm.amax(-2)
        safe = top.masked_fill(top == -math.inf, 0.0)
        return (xm - safe.unsqueeze(-2)).exp_().sum(-2).log_().add_(safe)
    wf = w.to(x.dtype)
    n = wf.sum(-2)
    return ((x * wf).sum(-2) / n.clamp_min(1)).masked_fill(n == 0, -math.inf)
