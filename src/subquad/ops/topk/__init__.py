"""Top-k attention: each query attends with exact softmax to the ``top_k`` keys with its largest
logits (causal: among the keys at or before it), the others get no weight. The reference every
training-free sparse method approximates: for a given number of exact keys per query, no choice
of keys leaves less softmax mass out. It forms each query's full row of logits, so it costs what
exact attention costs; it measures how close a budget of keys can get, not speed (MagicPIG, Chen
et al. 2024, arXiv 2410.16179, compares against it; so does this library's sparse-method table).

Ties at the ``top_k``-th largest logit are all kept (a row may then hold more than ``top_k`` keys);
a query with at most ``top_k`` visible keys gets exact attention over them. The selection has no
gradient; the softmax over the selected keys has.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ...checks import check_int, check_share
from ...registry import register_method
from .._masks import compute_dtype, compute_precision, drop_padded, masked_fill_value

__all__ = ["TopkOptions", "attend_chosen", "keep_share", "topk_attention"]

#: bytes of logits formed at once (queries are taken in chunks)
_CHUNK_BYTES = 1 << 26


@dataclass
class TopkOptions:
    """``top_k``: keys each query attends exactly (default 256); ``top_p``: of those, only the
    fewest (largest logits first) that hold ``top_p`` of the softmax over them (default 1.0: all
    ``top_k``; :func:`attend_chosen`). With ``top_k`` at least the keys a query sees, this is the
    number of keys it needs for a share ``p`` of its attention."""

    top_k: int = 256
    top_p: float = 1.0

    def __post_init__(self):
        check_int("topk", "top_k", self.top_k, minimum=1)
        check_share("topk", "top_p", self.top_p)


def flops(B, H, N, M, D, Dv, o):
    """Matmul FLOPs of one forward as computed: every logit, and the weights (zero outside the top
    keys) times the values."""
    return 2 * B * H * N * M * (D + Dv)


def visible_logits(q: Tensor, k: Tensor, start: int, key_padding_mask: Tensor | None, causal: bool,
                   scale: float) -> tuple[Tensor, Tensor]:
    """Logits of the queries ``q`` (``(B, H, n, D)``, positions ``start ..``) against every key,
    and which keys each may see ``(B, 1 or H, n, M)`` (not padded; causal: at or before it)."""
    logits = (q * scale) @ k.mT
    n, M = q.shape[2], k.shape[2]
    visible = torch.ones(1, 1, n, M, dtype=torch.bool, device=q.device)
    if causal:
        positions = torch.arange(start, start + n, device=q.device)[:, None]
        visible = visible & (torch.arange(M, device=q.device) <= positions)
    if key_padding_mask is not None:
        visible = visible & ~key_padding_mask[:, None, None, :]
    return logits, visible


def keep_share(ranked: Tensor, keep: Tensor, top_p: float) -> Tensor:
    """Of the keys ``keep`` marks, the fewest by largest logit (``ranked``) whose softmax over the
    kept keys reaches ``top_p``, and every key tying the last of them: Twilight's top-p pruning
    (Lin et al. 2025, "Twilight: Adaptive Attention Sparsity with Hierarchical Top-p Pruning",
    arXiv 2502.02770), which prunes the keys a selection rule chose down to a share of their mass
    (here on the exact logits)."""
    chosen = ranked.masked_fill(~keep, -torch.inf)
    ordered = chosen.sort(-1, descending=True).values
    share = torch.softmax(ordered, -1).nan_to_num(0.0)
    needed = ((share.cumsum(-1) - share) < top_p).sum(-1, keepdim=True).clamp_min(1)
    return keep & (chosen >= ordered.gather(-1, needed - 1))


def attend_chosen(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None, causal: bool,
                  scale: float | None, choose: Callable[[Tensor, int, Tensor], Tensor],
                  chunk_multiple: int = 1, top_p: float = 1.0) -> Tensor:
    """Softmax attention of each query over the keys ``choose`` picks for it: per chunk of queries
    (positions ``start ..``, a multiple of ``chunk_multiple``), ``choose(q_chunk, start, ranked) ->
    (B, H, n, M)`` bool, where ``ranked`` holds the chunk's logits with the keys it may not see
    (padded; causal: later) at -inf; it runs without gradient. With ``top_p`` < 1 the chosen keys
    are pruned to those holding ``top_p`` of their softmax (:func:`keep_share`). A NaN logit is
    always kept, so a NaN input reaches the output as exact attention's would. A query without a
    visible key outputs zeros. Float32 math under autocast (float64 stays float64); returns the
    dtype of q."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    dtype = compute_dtype(q.dtype)
    B, H, N, _ = q.shape
    M = k.shape[2]
    step = max(1, _CHUNK_BYTES // max(1, 4 * B * H * M * 4) // chunk_multiple) * chunk_multiple
    with compute_precision(q):
        qc, kc, vc = q.to(dtype), k.to(dtype), drop_padded(v.to(dtype), key_padding_mask)
        out = []
        for a in range(0, N, step):
            logits, visible = visible_logits(qc[:, :, a: a + step], kc, a, key_padding_mask, causal, scale)
            with torch.no_grad():
                ranked = logits.detach().masked_fill(~visible, -torch.inf)
                keep = visible & choose(qc[:, :, a: a + step].detach(), a, ranked)
                if top_p < 1:
                    keep = keep_share(ranked, keep, top_p)
                keep = keep | (visible & ranked.isnan())
            weights = torch.softmax(logits.masked_fill(~keep, masked_fill_value(dtype)), -1) * keep
            out.append(weights @ vc)
    return torch.cat(out, 2).to(q.dtype)


def budget_options(o: TopkOptions, keys: int) -> dict:
    """``keys`` keys a query."""
    return {"top_k": max(1, keys)}


@register_method("topk", options=TopkOptions, summary="exact softmax over each query's top-k keys by logit",
                 causal=True, cross_attention=True, complexity="quadratic", flops=flops, query_local=True,
                 test_options={"top_k": 3}, budget_options=budget_options, quality_reference=True)
def topk_attention(q, k, v, key_padding_mask, causal, scale, *, top_k, top_p):
    """Shapes: q ``(B, H, N, D)``, k ``(B, H, M, D)``, v ``(B, H, M, Dv)`` -> ``(B, H, N, Dv)``.
    Causal: query ``i`` sees the keys ``<= i``. Padded keys get no weight; a query without a
    visible key outputs zeros. Float32 math under autocast (float64 stays float64); returns the
    dtype of q."""

    def choose(_q, _start, ranked):
        return ranked >= ranked.topk(min(top_k, ranked.shape[-1]), dim=-1).values[..., -1:]

    return attend_chosen(q, k, v, key_padding_mask, causal, scale, choose, top_p=top_p)
