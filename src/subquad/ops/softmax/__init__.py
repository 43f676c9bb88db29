"""Exact softmax attention: the baseline every other method is measured against."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ...checks import check_float
from ...registry import register_method
from .._masks import drop_padded, masked_fill_value, no_key_rows, sdpa_dtype
from .._sharded import Shards
from .ring import ring_attention

__all__ = ["SoftmaxOptions", "attention_bias", "flops", "softmax_attention"]


@dataclass
class SoftmaxOptions:
    """``dropout_p``: dropout on the attention weights (as in SDPA); the caller sets it to 0
    in eval."""

    dropout_p: float = 0.0

    def __post_init__(self):
        check_float("softmax", "dropout_p", self.dropout_p, minimum=0.0)
        if self.dropout_p >= 1.0:
            raise ValueError(f"softmax: dropout_p must be < 1, got {self.dropout_p}")


def attention_bias(
    key_padding_mask: Tensor | None, n: int, m: int, causal: bool, dtype: torch.dtype, device
) -> Tensor | None:
    """Additive bias ``(B, 1, N, M)`` (or ``(N, M)`` if only causal) with a finite large negative
    value at padded keys and, if causal, at future keys. None when nothing is masked."""
    neg = masked_fill_value(dtype)
    bias = None
    if causal:
        future = torch.ones(n, m, dtype=torch.bool, device=device).triu_(1)
        bias = torch.zeros(n, m, dtype=dtype, device=device).masked_fill_(future, neg)
    if key_padding_mask is not None:
        pad = torch.zeros(key_padding_mask.shape, dtype=dtype, device=device)
        pad = pad.masked_fill_(key_padding_mask, neg)[:, None, None, :]
        # where both apply the sum stays finite: neg is finfo.min / 2
        bias = pad if bias is None else bias + pad
    return bias


def flops(B, H, N, M, D, Dv, o):
    """Matmul FLOPs of one forward (:mod:`subquad.compare.flops`): scores q k^T and weights @ v."""
    return 2 * B * H * N * M * (D + Dv)


def _context_parallel(q, k, v, key_padding_mask, causal, scale, options: SoftmaxOptions, shards: Shards) -> Tensor:
    """The entry's ``context_parallel``: ring attention (:mod:`subquad.ops.softmax.ring`)."""
    if options.dropout_p:
        raise NotImplementedError("softmax: context parallelism runs without dropout; pass dropout_p=0")
    return ring_attention(q, k, v, key_padding_mask, causal, scale, shards)


@register_method("softmax", options=SoftmaxOptions, summary="exact softmax attention (SDPA)",
                 causal=True, cross_attention=True, complexity="quadratic",
                 core="subquad.layers.softmax:SoftmaxCore", flops=flops, exact=True, query_local=True,
                 context_parallel=_context_parallel)
def softmax_attention(q, k, v, key_padding_mask, causal, scale, *, dropout_p):
    """Exact attention ``softmax(s q k^T) v`` through ``F.scaled_dot_product_attention``.

    Shapes: q ``(B, H, N, D)``, k ``(B, H, M, D)``, v ``(B, H, M, Dv)`` -> ``(B, H, N, Dv)``.
    Padded keys get a finite large negative logit and their keys and values are dropped (NaN or
    inf there reaches no output); queries that see no real key output 0.
    """
    return sdpa(q, k, v, key_padding_mask, causal, scale, dropout_p)


def sdpa(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None = None, causal: bool = False,
         scale: float | None = None, dropout_p: float = 0.0) -> Tensor:
    """The softmax op without its checks, for other ops that fall back to exact attention on inputs
    they have checked already (same conventions)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if key_padding_mask is None:
        return F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout_p, is_causal=causal, scale=scale
        )
    n, m = q.shape[2], k.shape[2]
    k, v = drop_padded(k, key_padding_mask), drop_padded(v, key_padding_mask)  # a NaN there * weight 0 is NaN
    bias = attention_bias(key_padding_mask, n, m, causal, sdpa_dtype(q), q.device)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout_p, scale=scale)
    return out.masked_fill(no_key_rows(key_padding_mask, n, causal), 0.0)

