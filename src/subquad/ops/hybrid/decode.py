"""hybrid for decoding: new queries one at a time against a growing key cache and its index.

The parallel op builds its key tree per call, O(N log N): a decoder calling it for every new
token would pay that per token. :class:`HybridDecodeState` keeps, per batch row, the real keys and
values seen so far (padding dropped, so keys are counted by rank as in the op) and **prefix sums
over their leaves** (``block_size`` consecutive keys): the sum of keys, of squared keys and of
values of every leaf prefix. Any run of leaves then has its count, mean key, per-coordinate key
variance and mean value in O(D), so the index costs no rebuild as tokens arrive: a completed leaf
appends one row to each sum.

One new query at position ``t`` (``T = t + 1`` keys including its own) sees:

- the **window**: the keys from ``w0`` to ``t``, where ``w0`` is ``T - window`` rounded down to a
  leaf boundary (``window`` to ``window + block_size - 1`` keys);
- the **selected leaves**: among the ``L = w0 / block_size`` leaves before the window, the
  ``num_selected`` with the largest exact log-sum-exp of the query's logits over their keys,
  chosen from ``candidates`` leaves (all of them when ``L <= candidates``; the first ``sinks``
  leaves always). The candidates come from a **descent over runs of leaves by position**: runs
  of ``candidates / beam`` leaves, eight to a parent run eight times as long, each aligned to
  multiples of its length; starting from the finest level with at most ``8 beam`` runs, each
  level keeps the ``beam`` runs whose estimated log-sum-exp is largest and splits them into their
  eight children. A run of ``n`` keys with mean ``mu`` and
  per-coordinate variance ``var`` is estimated ``s q.mu + s^2/2 sum_d q_d^2 var_d + log n``, the
  log-sum-exp of Gaussian logits with that mean and (diagonal) variance. Cost per query:
  ``O(beam log(L) D)`` for the descent and ``O(candidates block_size D)`` for the leaves;
- the **summaries**: the ``L`` leaves in ``num_summaries`` runs of equal length, each entering as
  one term ``n' exp(s q.k')`` with value ``v'``: ``n'``, ``k'``, ``v'`` the count, mean key and
  mean value of the run's keys not selected. No key is dropped; with every leaf selected there
  are no summaries and the output is exact attention.

**Leaves by similarity.** Once a chunk of ``chunk_size`` keys has fallen behind the window, its
keys (and values) are reordered by the parallel op's similarity tree within the chunk, so each
leaf holds similar keys and each run of consecutive leaves inside the chunk is a subtree; above
the chunk, runs go by position, as in the op's sealed chunks. The chunks that hold the sink
leaves keep their order (moving SmolLM2's first token out of leaf 0 more than doubled its
perplexity). ``grouping="contiguous"``: no reordering.

The same estimator family as the parallel causal op (window, selected leaves, coarse summaries
with the selected keys taken out; the parts from :func:`subquad.ops.hybrid.plan`), but not the
same numbers: the op's queries share a descent per block of 64 and score nodes by their principal
direction, while a decoder has one query and scores runs by the Gaussian estimate. A prefill (the
first call, several tokens) runs the parallel causal op and indexes its keys; later tokens decode
here, on CPU by a compiled kernel (``decode_kernel.py``, numba) that computes what the torch
path here computes. Tested against dense references of the selection and of the attention it
implies.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from .index import numpy_path, rows
from .options import HybridOptions, candidate_count, plan

__all__ = ["HybridDecodeState"]

FANOUT = 8  # children per run in the descent


class _Row:
    """One batch row's real keys ``(H, T, D)`` and values ``(H, T, Dv)`` (room for an eighth more
    than the prefill, then growing by a quarter) and the leaf prefix sums ``ps`` ``(H, leaves + 1,
    2 D + Dv)``: of keys, squared keys and values, side by side (one gather reads all three).

    For the compiled descent also ``pyramid`` ``(H, rows, 2 D)``: level ``l`` (rows from
    ``offsets[l]``) holds the key parts of ``ps`` at every multiple of ``base * FANOUT**l``
    leaves, so that the runs a level scores read consecutive rows rather than rows far apart in
    ``ps`` (a copy of a quarter of its key part and less; the same numbers)."""

    def __init__(self, block_size: int, base: int, chunk: int = 0, behind: int = 0, sink_keys: int = 0):
        self.bs, self.base = block_size, base
        # chunks regrouped by similarity so far; the chunks holding the sink keys keep their order
        self.chunk, self.behind = chunk, behind
        self.grouped = -(-sink_keys // chunk) if chunk else 0
        self.count = 0
        self.k = self.v = self.ps = self.pyramid = None
        self.offsets: list[int] = []
        self._numpy: tuple | None = None  # numpy views of the buffers and offsets, for the kernel

    def extend(self, k: Tensor, v: Tensor) -> None:
        """Append keys ``(H, n, D)`` and values ``(H, n, Dv)``."""
        n, bs = k.shape[1], self.bs
        if self.k is None:
            H, cap = k.shape[0], n + max(64, n // 8)
            self.k, self.v = k.new_empty(H, cap, k.shape[2]), v.new_empty(H, cap, v.shape[2])
            self.ps = k.new_zeros(H, cap // bs + 1, 2 * k.shape[2] + v.shape[2])
            self._layout_pyramid()
        if self.count + n > self.k.shape[1]:  # grow by a quarter: amortised O(1), at most 25 % unused
            self._grow(max(self.k.shape[1] + self.k.shape[1] // 4, self.count + n))
        old_leaves = self.count // bs
        self.k[:, self.count: self.count + n] = k
        self.v[:, self.count: self.count + n] = v
        self.count += n
        if self.count // bs > old_leaves:
            self._sum_leaves(old_leaves, self.count // bs)
        if self.chunk:
            self._regroup()

    def __getstate__(self) -> dict:
        """Copies and pickles leave the numpy views behind: a copy's views are made from its own
        tensors (a copied view would be a detached copy of the original's buffers)."""
        return {**self.__dict__, "_numpy": None}

    def simple_append(self) -> bool:
        """Whether one more token fits and regroups nothing, so the compiled step may append it
        (:func:`.decode_kernel.decode_step`) instead of :meth:`extend`."""
        if self.k is None or self.count >= self.k.shape[1]:
            return False
        return not self.chunk or max(0, self.count + 1 - self.behind) // self.chunk <= self.grouped

    def arrays(self) -> tuple:
        """Numpy views of ``k``, ``v``, ``ps``, ``pyramid`` and the level offsets with a sentinel
        (kept until the buffers are reallocated)."""
        if self._numpy is None:
            self._numpy = (self.k.numpy(), self.v.numpy(), self.ps.numpy(), self.pyramid.numpy(),
                           np.asarray(self.offsets + [0], dtype=np.int64))
        return self._numpy

    def _sum_leaves(self, old: int, new: int) -> None:
        """Prefix rows of leaves ``old .. new`` (exclusive .. inclusive) from the keys and values."""
        bs = self.bs
        keys = self.k[:, old * bs: new * bs]
        x = torch.cat([keys, keys.square(), self.v[:, old * bs: new * bs]], -1)
        leaf = x.unflatten(1, (-1, bs)).sum(2)  # (H, new - old, 2 D + Dv)
        self.ps[:, old + 1: new + 1] = self.ps[:, old: old + 1] + leaf.cumsum(1)
        self._sample(old, new)

    def _regroup(self) -> None:
        """Reorder the keys (and values) of every chunk that has fallen ``behind`` keys behind the
        last one so that its leaves are groups of similar keys: the parallel op's tree within a
        sealed chunk (:func:`.index.build_index`, splits at the median of the principal
        projections), so that runs of consecutive leaves are its subtrees. Only the leaf sums
        inside those chunks change; no key's window or causal position does (they are before
        every window). The chunks that hold the sink leaves stay in order, so the sinks stay the
        first keys (where pretrained models park attention)."""
        from .index import build_index

        target = max(0, self.count - self.behind) // self.chunk
        if target <= self.grouped:
            return
        C, H, D = self.chunk, self.k.shape[0], self.k.shape[2]
        span = slice(self.grouped * C, target * C)
        k = self.k[:, span].reshape(1, -1, C, D)  # (1, H * chunks, C, D)
        p = plan(HybridOptions(budget=1, block_size=self.bs, candidates=C // self.bs, beam=1), C, False)
        order = build_index(k, p).order.view(H, -1)
        at = order + (torch.arange(order.shape[1] // C, device=order.device) * C).repeat_interleave(C)
        self.k[:, span] = self.k[:, span].gather(1, at.unsqueeze(-1).expand(-1, -1, D))
        self.v[:, span] = self.v[:, span].gather(1, at.unsqueeze(-1).expand(-1, -1, self.v.shape[2]))
        self._sum_leaves(self.grouped * C // self.bs, target * C // self.bs)
        self.grouped = target

    def _sample(self, old: int, new: int) -> None:
        """Copy the prefix rows at multiples of each level's run length between leaf ``old``
        (exclusive) and ``new`` into the pyramid."""
        D = self.k.shape[2]
        for level, offset in enumerate(self.offsets):
            size = self.base * FANOUT**level
            first, last = old // size + 1, new // size
            if first <= last:
                rows = self.ps[:, first * size: last * size + 1: size, : 2 * D]
                self.pyramid[:, offset + first: offset + last + 1] = rows

    def _grow(self, cap: int) -> None:
        def grown(t: Tensor, rows: int) -> Tensor:
            out = t.new_zeros(t.shape[0], rows, t.shape[2])
            out[:, : t.shape[1]] = t
            return out

        self.k, self.v, self.ps = grown(self.k, cap), grown(self.v, cap), grown(self.ps, cap // self.bs + 1)
        self._layout_pyramid()

    def _layout_pyramid(self) -> None:
        """Levels of runs up to the capacity's leaves, each with room for every multiple."""
        cap_leaves, D = self.ps.shape[1] - 1, self.k.shape[2]
        self.offsets, rows, level = [], 0, 0
        while self.base * FANOUT**level <= cap_leaves:
            self.offsets.append(rows)
            rows += cap_leaves // (self.base * FANOUT**level) + 1
            level += 1
        self.pyramid = self.ps.new_zeros(self.ps.shape[0], max(rows, 1), 2 * D)
        self._numpy = None
        self._sample(-1, self.count // self.bs)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.ps, self.pyramid) if t is not None)

    def run_sums(self, start: Tensor, end: Tensor) -> tuple[Tensor, Tensor]:
        """Runs of leaves ``[start, end)`` ``(H, R)`` -> their sums ``(H, R, 2 D + Dv)`` (keys,
        squared keys, values) and key counts ``(H, R)``."""
        both = _rows(self.ps, torch.cat([end, start], 1))
        R = start.shape[1]
        return both[:, :R] - both[:, R:], ((end - start) * self.bs).to(self.ps.dtype)


def _rows(x: Tensor, index: Tensor) -> Tensor:
    """``x[h, index[h, i]]``: x ``(H, T, D)``, index ``(H, I)`` -> ``(H, I, D)`` (:func:`.index.rows`)."""
    return rows(x[None], index[None])[0]


def run_scores(row: _Row, q: Tensor, start: Tensor, end: Tensor, scale: float) -> Tensor:
    """Estimated log-sum-exp of ``scale q.k`` over each run of leaves ``[start, end)`` ``(H, R)``
    (q ``(H, D)``): Gaussian logits with the run's mean and per-coordinate variance; -inf for an
    empty run."""
    D = q.shape[1]
    sums, n = row.run_sums(start, end)
    safe = n.clamp_min(1.0)
    weighted = sums[..., :D] * q.unsqueeze(1)  # n mu_d q_d
    mean_logit = weighted.sum(-1) / safe
    # sum_d q_d^2 var_d = sum_d q_d^2 E[k_d^2] - sum_d (q_d mu_d)^2
    spread = torch.bmm(sums[..., D: 2 * D], q.square().unsqueeze(-1)).squeeze(-1) / safe
    spread = (spread - weighted.square().sum(-1) / safe.square()).clamp_min(0.0)
    score = scale * mean_logit + 0.5 * scale**2 * spread + safe.log()
    return score.masked_fill(n <= 0, float("-inf"))


def start_level(first: int, leaves: int, base: int, beam: int) -> int:
    """The descent's first level: the finest whose runs (``base * FANOUT**level`` leaves, aligned
    to multiples of that length) over ``[first, leaves)`` number at most ``FANOUT * beam``."""
    level = 0
    while -(-leaves // (base * FANOUT**level)) - first // (base * FANOUT**level) > FANOUT * beam:
        level += 1
    return level


def candidate_leaves(row: _Row, q: Tensor, first: int, leaves: int, candidates: int, beam: int,
                     scale: float) -> Tensor:
    """``(H, C)`` leaf indices in ``[first, leaves)`` for the exact scoring (-1: none): every leaf
    when there are at most ``candidates``, else the leaves of the ``beam`` runs of ``candidates /
    beam`` leaves the descent ends on (see the module docstring). Runs are aligned to multiples of
    their length and clipped to ``[first, leaves)``."""
    H, device = q.shape[0], q.device
    if leaves - first <= candidates:
        return (first + torch.arange(leaves - first, device=device)).expand(H, -1)
    base = candidates // beam  # leaves per final run
    level = start_level(first, leaves, base, beam)
    size = base * FANOUT**level
    start = torch.arange(first // size * size, leaves, size, device=device).expand(H, -1)
    while True:
        scores = run_scores(row, q, start.clamp(first, leaves), (start + size).clamp(first, leaves), scale)
        keep = scores.topk(min(beam, scores.shape[1]), dim=1).indices
        start = start.gather(1, keep)
        if level == 0:
            break
        level -= 1
        size //= FANOUT
        start = (start.unsqueeze(-1) + size * torch.arange(FANOUT, device=device)).flatten(1)
    leaf = (start.unsqueeze(-1) + torch.arange(base, device=device)).flatten(1)
    return leaf.masked_fill((leaf < first) | (leaf >= leaves), -1)


class HybridDecodeState:
    """hybrid's decoding state for one attention layer (see the module docstring): per batch row,
    its real keys and values and their leaf prefix sums.

    :meth:`attend` takes the new tokens' q ``(B, H, n, D)``, k ``(B, H, n, D)``, v ``(B, H, n, Dv)``
    and ``key_padding_mask`` ``(B, n)`` (True = padding: such tokens join nothing and output zeros)
    and returns their causal outputs ``(B, H, n, Dv)`` over every earlier real token and
    themselves. Its first call with several tokens (a prefill) runs the parallel op."""

    def __init__(self, options: HybridOptions | None = None):
        self.options = options or HybridOptions()
        self.candidates = candidate_count(self.options)
        # the parts of the budget (at any length past the window; a shorter row's window is all of it)
        self.plan = plan(self.options, 1 << 20, True)
        self.rows: list[_Row] = []

    def new_row(self) -> _Row:
        """An empty row for these options (its pyramid's runs: ``candidates / beam`` leaves and up)."""
        o = self.options
        grouped = o.grouping == "tree" and o.chunk_size > o.block_size
        return _Row(o.block_size, self.candidates // self.plan.beam, o.chunk_size if grouped else 0,
                    self.plan.window + o.block_size, self.plan.sinks * o.block_size)

    @property
    def seen(self) -> int:
        """Real tokens held by the longest row."""
        return max((r.count for r in self.rows), default=0)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None = None,
               scale: float | None = None) -> Tensor:
        from . import hybrid_attention

        B, H, n, D = q.shape
        scale = D**-0.5 if scale is None else scale
        if not self.rows:
            self.rows = [self.new_row() for _ in range(B)]
        if len(self.rows) != B:
            raise ValueError(f"HybridDecodeState holds {len(self.rows)} batch rows; this call has {B}")
        if n == 1 and key_padding_mask is None and B == 1 and self.rows[0].count > 0:  # the common step
            return self._step(self.rows[0], q[0, :, 0], scale, k[0, :, 0], v[0, :, 0]).to(q.dtype).view(1, H, 1, -1)
        out = q.new_zeros(B, H, n, v.shape[-1])
        options = {f: getattr(self.options, f) for f in self.options.__dataclass_fields__}
        for b, row in enumerate(self.rows):
            keep = (torch.arange(n, device=q.device) if key_padding_mask is None
                    else (~key_padding_mask[b]).nonzero()[:, 0])
            if keep.numel() == 0:
                continue
            qb, kb, vb = (t[b].index_select(1, keep) for t in (q, k, v))
            if row.count == 0 and keep.numel() > 1:  # a prefill: the parallel causal op
                o = hybrid_attention(qb[None], kb[None], vb[None], causal=True, scale=scale, **options)[0]
                row.extend(kb, vb)
            else:
                steps = []
                for j in range(keep.numel()):
                    steps.append(self._step(row, qb[:, j], scale, kb[:, j], vb[:, j]))
                o = torch.stack(steps, 1)
            out[b].index_copy_(1, keep, o.to(out.dtype))
        return out

    def choose(self, row: _Row, q: Tensor, scale: float) -> tuple[int, int, Tensor]:
        """For query q ``(H, D)`` at the row's last position: the window start ``w0``, the leaves
        before it ``L`` and the selected leaves ``(H, S)`` (-1: none)."""
        p = self.plan
        w0 = max(0, row.count - p.window) // row.bs * row.bs
        L = w0 // row.bs
        if L == 0:
            return w0, L, q.new_zeros(q.shape[0], 0, dtype=torch.long)
        sinks = min(p.sinks, L)
        found = candidate_leaves(row, q, sinks, L, self.candidates, p.beam, scale)
        cand = torch.cat([torch.arange(sinks, device=q.device).expand(q.shape[0], sinks), found], 1)
        return w0, L, select_leaves(row, q, cand, p.num_selected, scale)

    def _step(self, row: _Row, q: Tensor, scale: float, k: Tensor | None = None, v: Tensor | None = None) -> Tensor:
        """The output ``(H, Dv)`` of query q ``(H, D)`` at the row's last position, after appending
        the key ``k`` ``(H, D)`` and value ``v`` ``(H, Dv)`` when given: on CPU by the compiled
        kernel (``decode_kernel.py``, which also appends unless the row must grow or regroup),
        elsewhere (and inside ``hybrid.torch_path()``) in torch."""
        kernel = _kernel(q)
        if k is not None and (kernel is None or not row.simple_append()):
            row.extend(k[:, None], v[:, None])
            k = None
        if kernel is not None:
            import numba

            p = self.plan
            # one array: the query, then the key and value the kernel appends
            x = (q if k is None else torch.cat([q, k, v], -1)).to(row.k.dtype).contiguous().numpy()
            numba.set_num_threads(max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)))
            out = kernel.decode_step(*row.arrays(), x, k is not None, row.count + (k is not None), row.bs, scale,
                                     p.window, p.sinks, self.candidates, p.beam, p.num_selected, p.num_summaries,
                                     FANOUT)
            row.count += k is not None  # only once the kernel has written the token
            return torch.from_numpy(out)
        w0, L, selected = self.choose(row, q, scale)
        logits = [scale * torch.bmm(row.k[:, w0: row.count], q.unsqueeze(-1)).squeeze(-1)]
        values = [row.v[:, w0: row.count]]
        if L > 0:
            for part in (_leaf_terms(row, q, selected, scale), _summaries(row, q, selected, L, self.plan.num_summaries,
                                                                          scale)):
                logits.append(part[0])
                values.append(part[1])
        weights = torch.softmax(torch.cat(logits, 1), dim=1)
        return torch.bmm(weights.unsqueeze(1), torch.cat(values, 1)).squeeze(1)

    def select(self, index: Tensor) -> None:
        """Keep the batch rows ``index`` (beam search's reordering)."""
        import copy

        self.rows = [copy.deepcopy(self.rows[i]) for i in index.tolist()]

    def nbytes(self) -> int:
        return sum(r.nbytes() for r in self.rows)


def _kernel(q: Tensor):
    """The compiled decode step when q may run in numpy and the kernel is on, else None."""
    from . import _KERNEL_ON

    if not (_KERNEL_ON[0] and numpy_path(q)):
        return None
    try:
        from . import decode_kernel
    except ImportError:  # pragma: no cover - numba is a dependency; a platform without its wheels
        return None
    return decode_kernel


def _leaf_keys(leaves: Tensor, bs: int) -> Tensor:
    """Key indices ``(H, C bs)`` of leaves ``(H, C)`` (-1 counts as leaf 0)."""
    return (leaves.clamp_min(0).unsqueeze(-1) * bs + torch.arange(bs, device=leaves.device)).flatten(1)


def select_leaves(row: _Row, q: Tensor, cand: Tensor, num_selected: int, scale: float) -> Tensor:
    """The ``num_selected`` distinct leaves among ``cand`` ``(H, C)`` (-1: none) whose keys' logits
    have the largest log-sum-exp, ``(H, S)``; -1 where fewer leaves exist."""
    cand = cand.sort(1).values
    dup = torch.zeros_like(cand, dtype=torch.bool)
    dup[:, 1:] = cand[:, 1:] == cand[:, :-1]  # a sink the descent reached again counts once
    cand = cand.masked_fill(dup, -1)
    logits = scale * torch.bmm(_rows(row.k, _leaf_keys(cand, row.bs)), q.unsqueeze(-1)).squeeze(-1)
    lse = logits.unflatten(1, (-1, row.bs)).logsumexp(-1).masked_fill(cand < 0, float("-inf"))
    best = lse.topk(min(num_selected, cand.shape[1]), dim=1)
    return cand.gather(1, best.indices).masked_fill(best.values == float("-inf"), -1)


def _leaf_terms(row: _Row, q: Tensor, selected: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Logits ``(H, S bs)`` (-inf for -1 leaves) and values ``(H, S bs, Dv)`` of the selected keys."""
    keys = _leaf_keys(selected, row.bs)
    logits = scale * torch.bmm(_rows(row.k, keys), q.unsqueeze(-1)).squeeze(-1)
    none = (selected < 0).repeat_interleave(row.bs, dim=1)
    return logits.masked_fill(none, float("-inf")), _rows(row.v, keys)


def _summaries(row: _Row, q: Tensor, selected: Tensor, leaves: int, num_summaries: int,
               scale: float) -> tuple[Tensor, Tensor]:
    """The coarse terms: leaves ``[0, leaves)`` in ``num_summaries`` runs of equal length, each
    without its ``selected`` leaves ``(H, S)``: logits ``(H, G)`` (``scale q.mean + log count``,
    -inf when empty) and mean values ``(H, G, Dv)``."""
    H, device = q.shape[0], q.device
    G = min(num_summaries, leaves)
    bounds = torch.tensor([g * leaves // G for g in range(G + 1)], device=device)
    start, end = bounds[:-1].expand(H, G), bounds[1:].expand(H, G)
    D = q.shape[1]
    sums, count = row.run_sums(start, end)
    ksum, vsum = sums[..., :D], sums[..., 2 * D:]
    real = selected >= 0
    leaf = selected.clamp_min(0)
    group = torch.bucketize(leaf, bounds[1:], right=True)  # (H, S): the run holding each selected leaf
    own = (_rows(row.ps, leaf + 1) - _rows(row.ps, leaf)) * real.unsqueeze(-1)  # the selected leaves' sums
    ksum = ksum.scatter_add(1, group.unsqueeze(-1).expand(-1, -1, D), -own[..., :D])
    vsum = vsum.scatter_add(1, group.unsqueeze(-1).expand(-1, -1, vsum.shape[2]), -own[..., 2 * D:])
    count = count.scatter_add(1, group, -(real * row.bs).to(count.dtype))
    safe = count.clamp_min(1.0)
    logits = scale * torch.bmm(ksum, q.unsqueeze(-1)).squeeze(-1) / safe + safe.log()
    return logits.masked_fill(count < 0.5, float("-inf")), vsum / safe.unsqueeze(-1)
