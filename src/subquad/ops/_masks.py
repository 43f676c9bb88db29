"""Mask and dtype helpers shared by every op (input checks are in :mod:`subquad.checks`).

Conventions (DESIGN.md): tensors are ``(B, H, N, D)``; ``key_padding_mask`` is a bool
``(B, M)`` tensor in which **True marks padding**; masked logits get a large finite negative
value so that a fully padded row stays finite; whatever a padded key or value holds (NaN and
inf included) reaches no output: an op drops it with :func:`drop_padded` (a ``torch.where``)
wherever it would otherwise meet a weight of 0, since ``NaN * 0`` is NaN.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

__all__ = [
    "each_item_without_padding",
    "compute_dtype",
    "compute_precision",
    "drop_padded",
    "masked_fill_value",
    "no_key_rows",
    "padding_bias",
    "sdpa_dtype",
]


def masked_fill_value(dtype: torch.dtype) -> float:
    """A large finite negative logit for ``dtype``: exp() of it is 0, and it never overflows
    when a logit of ordinary size is added to it."""
    return torch.finfo(dtype).min / 2


def sdpa_dtype(q: Tensor) -> torch.dtype:
    """The dtype ``scaled_dot_product_attention`` computes in for queries ``q``: under autocast
    every floating input but float64 is cast to the autocast dtype, float64 is left alone. A
    float ``attn_mask`` must have this dtype (a float32 bias next to float64 queries fails, and
    a large negative float32 bias is -inf in float16)."""
    if torch.is_autocast_enabled(q.device.type) and q.dtype != torch.float64:
        return torch.get_autocast_dtype(q.device.type)
    return q.dtype


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; every other floating dtype computes in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def compute_precision(x: Tensor):
    """Context manager that turns autocast off, so sensitive math runs in the dtype the op
    chose (see :func:`compute_dtype`) even inside ``torch.autocast``."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.autocast(x.device.type, enabled=False)
    return contextlib.nullcontext()


def no_key_rows(
    key_padding_mask: Tensor | None, n_queries: int, causal: bool
) -> Tensor | None:
    """Bool ``(B, 1, N, 1)``: True where a query sees no real key (every visible key is
    padding). The library defines the output there as zeros. None without a mask."""
    if key_padding_mask is None:
        return None
    if causal:
        # query t sees keys 0..t; it has a real key iff the first real key index <= t
        real = ~key_padding_mask
        seen = real.cumsum(-1) > 0  # (B, M): some real key at or before position j
        rows = ~seen[:, :n_queries]
    else:
        rows = key_padding_mask.all(-1, keepdim=True).expand(-1, n_queries)
    return rows[:, None, :, None]


def drop_padded(x: Tensor, key_padding_mask: Tensor | None) -> Tensor:
    """``x`` ``(B, H, M, d)`` with exact zeros at the positions ``key_padding_mask`` ``(B, M)``
    marks (True = padding); ``x`` itself without a mask. A ``torch.where``, so NaN and inf at
    padded keys or values are dropped too: multiplying by a 0/1 mask keeps them (``NaN * 0 =
    NaN``), and so does a weight of 0 in a softmax product. One elementwise pass: apply it once
    to k or v, not per use."""
    if key_padding_mask is None:
        return x
    return x.masked_fill(key_padding_mask[:, None, :, None], 0.0)


def padding_bias(key_padding_mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """Additive ``(B, 1, 1, M)`` logit bias from a bool ``(B, M)`` mask: a large finite negative
    value where the mask is True, 0 elsewhere. None without a mask."""
    if key_padding_mask is None:
        return None
    bias = torch.zeros(key_padding_mask.shape, dtype=dtype, device=key_padding_mask.device)
    return bias.masked_fill_(key_padding_mask, masked_fill_value(dtype))[:, None, None, :]


@torch.compiler.disable  # shapes follow the mask: under torch.compile this runs eagerly, not traced per length
def each_item_without_padding(attend, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor,
                              causal: bool) -> Tensor:
    """For methods that cut the sequence by position (blocks, pages): each item of a padded batch
    over its real keys alone, so that it computes what the item computes unpadded; in
    self-attention over its real queries too. ``attend(q, k, v) -> out`` on one unpadded item. A
    query at a padded position takes the output of the last real query before it (not causal: of
    the first real query when none is before; causal: zeros); an item without real keys outputs
    zeros. Whether a call is self-attention is read from the lengths: with as many queries as keys
    it is taken as self-attention, so a cross-attention of equal lengths with padded keys gets, at
    the queries in padded key positions, a copy of an earlier query's output (pass unequal lengths
    or no mask there)."""
    outs = []
    for b in range(q.shape[0]):
        padding = key_padding_mask[b]
        keep = (~padding).nonzero().squeeze(-1)
        qb, kb, vb = q[b: b + 1], k[b: b + 1].index_select(2, keep), v[b: b + 1].index_select(2, keep)
        if len(keep) == 0:
            outs.append(q.new_zeros(1, q.shape[1], q.shape[2], v.shape[-1]))
        elif q.shape[2] != padding.shape[0]:  # cross-attention: every query is real
            outs.append(attend(qb, kb, vb))
        else:
            out = attend(qb.index_select(2, keep), kb, vb)
            rank = (~padding).cumsum(0) - 1  # the last real query at or before each position
            out = out.index_select(2, rank.clamp_min(0))
            outs.append(out.masked_fill((rank < 0).view(-1, 1), 0.0) if causal else out)
    return torch.cat(outs)
