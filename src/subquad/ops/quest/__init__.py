"""Quest (Tang et al. 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context LLM
Inference", arXiv 2406.10774): the keys are cut into pages of ``page_size`` consecutive keys, each
page keeps the per-channel minimum and maximum of its keys, and a query scores a page by the upper
bound those give its logits, ``sum_d max(q_d min_d, q_d max_d) >= max over the page's keys of q.k``;
it attends exactly to the ``num_pages`` pages of highest bound.

Quest selects for one decoded query at a time; here every query selects for itself the same way,
so a prefill gives each query the row its decoding would. Causal: a query's candidates are the
pages wholly before its own page, and its own page (its keys up to itself) is always attended
(Quest scores the partial last page too; keeping it whole costs at most one page and never drops
the most recent keys). Not causal: every page is a candidate, none forced. Pages are cut over
the real keys of each item (padding removed first). The selection has no gradient; the softmax
over the chosen keys has.

This form computes each query's full row of logits (exact attention's cost) to measure what the
selection keeps, not to be fast.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ...checks import check_int, check_share
from ...registry import register_method
from .._masks import each_item_without_padding
from ..softmax import sdpa
from ..topk import attend_chosen

__all__ = ["QuestOptions", "attend_pages", "bound", "page_bounds", "page_keys", "quest_attention", "whole_blocks"]

@dataclass
class QuestOptions:
    """``page_size``: keys per page (default 16, Quest's); ``num_pages``: pages each query attends
    exactly (default 64: 1024 keys, plus its own page when causal); ``top_p``: the chosen keys
    pruned to the fewest that hold this share of their softmax (default 1.0: none pruned;
    Twilight's top-p, :func:`subquad.ops.topk.keep_share`)."""

    page_size: int = 16
    num_pages: int = 64
    top_p: float = 1.0

    def __post_init__(self):
        check_int("quest", "page_size", self.page_size, minimum=1)
        check_int("quest", "num_pages", self.num_pages, minimum=1)
        check_share("quest", "top_p", self.top_p)


def flops(B, H, N, M, D, Dv, o):
    """Matmul FLOPs of one forward as computed: the page bounds (two products with the page
    minima and maxima), every logit, and the weights times the values; exact attention's when every
    page is chosen."""
    pages = -(-M // o["page_size"])
    return 2 * B * H * N * ((2 * pages * D if o["num_pages"] < pages else 0) + M * (D + Dv))


def page_bounds(k: Tensor, page_size: int) -> tuple[Tensor, Tensor]:
    """Per page ``(B, H, P, D)``: the minimum and the maximum of its keys per channel (the last
    page may be partial)."""
    B, H, M, D = k.shape
    P = -(-M // page_size)
    pad = P * page_size - M
    kp = torch.nn.functional.pad(k, (0, 0, 0, pad)).view(B, H, P, page_size, D)
    real = (torch.arange(P * page_size, device=k.device) < M).view(P, page_size, 1)
    return kp.masked_fill(~real, torch.inf).amin(3), kp.masked_fill(~real, -torch.inf).amax(3)


def page_keys(scores: Tensor, start: int, M: int, causal: bool, page_size: int, num_pages: int) -> Tensor:
    """``(B, H, n, M)``: the keys of the ``num_pages`` pages of highest ``scores`` ``(B, H, n, P)``
    for the queries at positions ``start ..`` (causal: among the pages wholly before the query's
    own page, and that page too)."""
    n, P = scores.shape[2:]
    page = torch.arange(P, device=scores.device)
    own = (torch.arange(start, start + n, device=scores.device) // page_size)[:, None]  # (n, 1)
    if causal:
        scores = scores.masked_fill(page >= own, -torch.inf)
    values, order = scores.sort(dim=-1, descending=True, stable=True)  # ties: the earlier page
    count = min(num_pages, P)
    chosen = torch.zeros_like(scores, dtype=torch.bool)
    chosen.scatter_(-1, order[..., :count], values[..., :count] > -torch.inf)
    if causal:
        chosen = chosen | (page == own)
    return chosen.repeat_interleave(page_size, -1)[..., :M]


def attend_pages(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None, causal: bool,
                 scale: float | None, page_size: int, num_pages: int,
                 summarise: Callable[[Tensor], tuple[Tensor, ...]],
                 score: Callable[..., Tensor], top_p: float = 1.0) -> Tensor:
    """Softmax attention of each query over the keys of its ``num_pages`` best pages
    (:func:`page_keys`), the pages cut over each item's real keys: ``summarise(k)`` per item once
    (in the compute dtype, no gradient), ``score(q, *summary) -> (B, H, n, P)`` per chunk of
    queries. Padding is removed first (:func:`~subquad.ops._masks.each_item_without_padding`).
    When every page would be chosen this is exact attention, masks as given (SDPA; its outputs at
    padded query positions are its own): no data-dependent branch then, as ``hybrid`` does. With
    ``top_p`` < 1 the chosen keys are pruned (:func:`~subquad.ops.topk.attend_chosen`)."""
    if num_pages >= -(-k.shape[2] // page_size) and top_p >= 1:
        return sdpa(q, k, v, key_padding_mask, causal, scale)

    def attend(q, k, v):
        summary = []

        def choose(qc, start, ranked):
            if not summary:
                summary.extend(summarise(k.detach().to(qc.dtype)))
            return page_keys(score(qc, *summary), start, ranked.shape[-1], causal, page_size, num_pages)

        return attend_chosen(q, k, v, None, causal, scale, choose, top_p=top_p)

    if key_padding_mask is None or not bool(key_padding_mask.any()):
        return attend(q, k, v)
    return each_item_without_padding(attend, q, k, v, key_padding_mask, causal)


def whole_blocks(method: str, keys: int, size: int) -> int:
    """``keys // size`` blocks (rounded down); ValueError when that is none."""
    if keys < size:
        raise ValueError(f"{method}: {keys} keys is fewer than one block of {size}; use smaller blocks")
    return keys // size


def bound(q: Tensor, lo: Tensor, hi: Tensor) -> Tensor:
    """Quest's page score ``sum_d max(q_d lo_d, q_d hi_d)``, at least every logit of the page."""
    return q.clamp(min=0) @ hi.mT + q.clamp(max=0) @ lo.mT


def budget_options(o: QuestOptions, keys: int) -> dict:
    """About ``keys`` keys a query beyond its own page: whole pages."""
    return {"num_pages": whole_blocks("quest", keys, o.page_size)}


@register_method("quest", options=QuestOptions,
                 summary="exact softmax over each query's pages of highest per-channel logit bound (Quest)",
                 causal=True, cross_attention=True, complexity="quadratic", flops=flops, query_local=True,
                 test_options={"page_size": 2, "num_pages": 2}, fullgraph_with_padding=False,
                 budget_options=budget_options, quality_reference=True)
def quest_attention(q, k, v, key_padding_mask, causal, scale, *, page_size, num_pages, top_p):
    """Shapes: q ``(B, H, N, D)``, k ``(B, H, M, D)``, v ``(B, H, M, Dv)`` -> ``(B, H, N, Dv)``. Causal:
    query ``i`` sees the keys ``<= i``. Pages are cut over each item's real keys (padding is removed
    first, as hybrid does: a padded batch computes what each item computes alone); a query at a
    padded position takes the output of the last real query before it (causal: zeros when there is
    none; not causal: the first real query's), an item without real keys outputs zeros (equal query
    and key lengths are read as self-attention:
    :func:`~subquad.ops._masks.each_item_without_padding`). Float32 math under autocast (float64
    stays float64); returns the dtype of q."""
    return attend_pages(q, k, v, key_padding_mask, causal, scale, page_size, num_pages,
                        lambda k: page_bounds(k, page_size), bound, top_p)
