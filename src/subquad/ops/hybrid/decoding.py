"""hybrid for decoding: new tokens one at a time, each getting the output its row gets in a
causal prefill.

The causal selection already decodes: query block ``i`` (positions ``[i QB, (i + 1) QB)``) attends
to key blocks chosen by the queries of block ``i - 1``, among the blocks wholly before position
``i QB``, plus its diagonal keys under the causal mask. So when token ``i QB`` arrives, everything
that chooses its block's keys is known, and the choice holds for the next ``QB`` tokens.
:class:`HybridDecodeState` keeps, per batch row, the real keys and values seen so far, the sum
of the keys of every complete key block, the queries of the current query block (they score the
next one) and the current block's selected key blocks, gathered once. A step then costs
``(sinks + local + num_blocks) key_block`` keys plus up to ``query_block + key_block`` diagonal
ones; once per ``query_block`` tokens the blocks are scored (``query_block x nk`` products, ``nk``
the complete key blocks) and gathered.

Same numbers as the op up to rounding: the block scores are the same sums in another order, so a
near-tie between two blocks' scores may fall the other way. A first call with several tokens (a
prefill) runs the op and keeps what the next tokens need; tokens marked as padding join nothing and
output zeros; each row counts its own real tokens, as the op does for a padded batch.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import Tensor

from .select import estimated_share, past_blocks, sampled_mass

__all__ = ["HybridDecodeState"]


class _Row:
    """One batch row: keys ``k`` ``(H, cap, D)``, values ``v`` ``(H, cap, Dv)`` (the first ``count``
    real), key-block sums ``sums`` ``(H, cap / KB, D)`` (complete blocks), the current query
    block's queries ``queries`` ``(H, QB, D)`` (the first ``count - start`` of them), and the past
    keys the current block attends exactly: ``past`` = None (every key before ``lo KB``) or the
    gathered keys and values of its selected blocks, with a logit bias ``(H, S KB)`` (-inf at the
    blocks a head pruned by ``top_p``; None when no head pruned any)."""

    def __init__(self):
        self.count = 0
        self.k = self.v = self.sums = self.queries = None
        self.lo = 0  # the current query block's first diagonal key block
        self.past: tuple[Tensor, Tensor, Tensor | None] | None = None

    def nbytes(self) -> int:
        ts = [self.k, self.v, self.sums, self.queries, *(self.past or ())]
        return sum(t.numel() * t.element_size() for t in ts if t is not None)


class HybridDecodeState:
    """hybrid's decoding state for one attention layer (see the module docstring).

    :meth:`attend` takes the new tokens' q ``(B, H, n, D)``, k ``(B, H, n, D)``, v ``(B, H, n, Dv)``
    and ``key_padding_mask`` ``(B, n)`` (True = padding) and returns their causal outputs
    ``(B, H, n, Dv)`` over every earlier real token of the row and themselves."""

    def __init__(self, options=None):
        from . import HybridOptions

        self.options = options or HybridOptions()
        self.rows: list[_Row] = []

    @property
    def seen(self) -> int:
        """Real tokens held by the longest row."""
        return max((r.count for r in self.rows), default=0)

    def nbytes(self) -> int:
        return sum(r.nbytes() for r in self.rows)

    def select(self, index: Tensor) -> None:
        """Keep the batch rows ``index`` (beam search's reordering)."""
        self.rows = [copy.deepcopy(self.rows[i]) for i in index.tolist()]

    def attend(self, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None = None,
               scale: float | None = None) -> Tensor:
        from . import hybrid_attention

        B, H, n, D = q.shape
        scale = D**-0.5 if scale is None else scale
        if not self.rows:
            self.rows = [_Row() for _ in range(B)]
        if len(self.rows) != B:
            raise ValueError(f"HybridDecodeState holds {len(self.rows)} batch rows; this call has {B}")
        out = q.new_zeros(B, H, n, v.shape[-1])
        o = self.options
        for b, row in enumerate(self.rows):
            keep = None if key_padding_mask is None else (~key_padding_mask[b]).nonzero()[:, 0]
            qb, kb, vb = (t[b] if keep is None else t[b].index_select(1, keep) for t in (q, k, v))
            m = qb.shape[1]
            if m == 0:
                continue
            if row.count == 0 and m > 1:  # a prefill: the op, then the state its last tokens leave
                res = hybrid_attention(qb[None], kb[None], vb[None], causal=True, scale=scale,
                                             **{f: getattr(o, f) for f in o.__dataclass_fields__})[0]
                self._prefill(row, qb, kb, vb, scale)
            else:
                res = torch.stack([self._step(row, qb[:, j], kb[:, j], vb[:, j], scale) for j in range(m)], 1)
            if keep is None:
                out[b] = res.to(out.dtype)
            else:
                out[b].index_copy_(1, keep, res.to(out.dtype))
        return out

    # ------------------------------------------------------------------ the row's bookkeeping

    def _append(self, row: _Row, k: Tensor, v: Tensor) -> None:
        """Append keys ``(H, n, D)`` and values ``(H, n, Dv)``; sum the key blocks they complete."""
        KB, n = self.options.key_block, k.shape[1]
        if row.k is None or row.count + n > row.k.shape[1]:  # grow by a quarter: amortised O(1)
            cap = max(row.count + n, (row.count + n) * 5 // 4, 256)
            cap = -(-cap // KB) * KB
            grow = [k.new_zeros(k.shape[0], cap, k.shape[2]), v.new_zeros(v.shape[0], cap, v.shape[2]),
                    k.new_zeros(k.shape[0], cap // KB, k.shape[2])]
            if row.k is not None:
                grow[0][:, :row.count], grow[1][:, :row.count] = row.k[:, :row.count], row.v[:, :row.count]
                grow[2][:, :row.sums.shape[1]] = row.sums
            row.k, row.v, row.sums = grow
        done = row.count // KB
        row.k[:, row.count: row.count + n], row.v[:, row.count: row.count + n] = k, v
        row.count += n
        new = row.count // KB
        if new > done:
            row.sums[:, done:new] = row.k[:, done * KB: new * KB].unflatten(1, (new - done, KB)).sum(2)

    def _prefill(self, row: _Row, q: Tensor, k: Tensor, v: Tensor, scale: float) -> None:
        """The state after a prefill of ``T`` tokens: its keys, the selection of the block of the
        last token (chosen by the block before it) and that block's queries so far."""
        QB = self.options.query_block
        T = k.shape[1]
        self._append(row, k, v)
        start = (T - 1) // QB * QB
        self._enter_block(row, start, q[:, start - QB: start] if start else None, scale)
        row.queries = q.new_zeros(q.shape[0], QB, q.shape[2])
        row.queries[:, : T - start] = q[:, start:]

    def _step(self, row: _Row, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        """The output ``(H, Dv)`` of the token at the row's next position (query ``q`` ``(H, D)``,
        key ``k``, value ``v``), which then joins the row."""
        QB = self.options.query_block
        t = row.count
        self._append(row, k[:, None], v[:, None])
        if t % QB == 0:  # a new query block: choose its keys by the queries of the block before
            self._enter_block(row, t, row.queries if t else None, scale)
            if row.queries is None:
                row.queries = q.new_zeros(q.shape[0], QB, q.shape[1])
        row.queries[:, t % QB] = q
        lo = row.lo * self.options.key_block
        if row.past is None:
            lo = 0
        parts = [] if row.past is None else [row.past]
        parts.append((row.k[:, lo: t + 1], row.v[:, lo: t + 1], None))
        # the logits of each part (pruned blocks of a head at -inf), one softmax over all of them
        logits = torch.cat([torch.bmm(keys, q.unsqueeze(-1)).squeeze(-1).mul_(scale).add_(0 if bias is None else bias)
                            for keys, _, bias in parts], 1)
        weights = torch.softmax(logits, -1).unsqueeze(1).split([keys.shape[1] for keys, _, _ in parts], -1)
        return sum(torch.bmm(w, values) for w, (_, values, _) in zip(weights, parts)).squeeze(1)

    def _enter_block(self, row: _Row, start: int, scoring: Tensor | None, scale: float) -> None:
        """Choose the past key blocks of the query block that starts at ``start``, scored by the
        queries ``scoring`` ``(H, QB, D)`` of the block before it (None for the first block)."""
        o = self.options
        KB = o.key_block
        lo = start // KB
        row.lo = lo
        if scoring is None or (lo <= past_blocks(o.num_blocks, o.sinks, o.local) and o.top_p >= 1):
            row.past = None  # every candidate is selected: the exact keys before lo KB
            return
        H = scoring.shape[0]
        j = torch.arange(lo, device=scoring.device)
        if o.score == "mean":
            s = scale * (scoring.mean(1, keepdim=True) @ (row.sums[:, :lo] / KB).mT).squeeze(1)
        elif o.score == "mean_query":  # the mean scoring query's softmax over every earlier key, per block
            logits = scale * (scoring.mean(1, keepdim=True) @ row.k[:, : lo * KB].mT).squeeze(1)
            s = torch.softmax(logits, -1).view(H, lo, KB).sum(-1)
        elif o.score == "sampled":  # the scoring queries over every earlier key, as the op's causal rows
            s = sampled_mass(scoring[None], row.k[None, :, :start], scale, query_block=o.query_block, key_block=KB,
                             stride=o.stride, causal=True, offset=start - o.query_block)[0, :, 0, :lo]
        else:  # each scoring query's softmax over the blocks (a block as KB copies of its mean), summed
            s = torch.softmax(scale * scoring @ (row.sums[:, :lo] / KB).mT + math.log(KB), -1).sum(1)
        forced = (j < o.sinks) | (j >= lo - o.local)
        top = s.masked_fill(forced, -math.inf).sort(dim=-1, descending=True, stable=True).indices[:, : o.num_blocks]
        keep = torch.ones_like(top, dtype=torch.bool)
        if o.top_p < 1:  # the op's rule (select.choose_blocks): the share held before a block below top_p
            share = estimated_share(s, torch.ones(lo, dtype=torch.bool, device=s.device), lo * KB, KB, o.score)
            ranked = share.gather(1, top)
            keep = (share * forced).sum(-1, keepdim=True) + ranked.cumsum(-1) - ranked < o.top_p
        chosen = torch.zeros(H, lo, dtype=torch.bool, device=s.device)
        chosen.scatter_(1, top, keep)
        chosen |= forced
        count = chosen.sum(1, keepdim=True)  # heads may keep different numbers of blocks (top_p)
        blocks = torch.where(chosen, j, lo + j).sort(dim=-1).values[:, : int(count.max())].clamp(max=lo - 1)
        keys = (blocks.unsqueeze(-1) * KB + torch.arange(KB, device=s.device)).flatten(1)  # (H, S KB)
        pruned = torch.arange(blocks.shape[1], device=s.device).repeat_interleave(KB) >= count  # (H, S KB)
        row.past = (row.k.gather(1, keys.unsqueeze(-1).expand(-1, -1, row.k.shape[2])),
                   row.v.gather(1, keys.unsqueeze(-1).expand(-1, -1, row.v.shape[2])),
                    torch.zeros(pruned.shape, dtype=row.k.dtype, device=s.device).masked_fill_(pruned, -math.inf)
                    if pruned.any() else None)
