"""Double-softmax linear attention ("efficient attention", Shen et al. 2021):
``softmax_features(q) @ (softmax_sequence(k)^T @ v)``.

Each row of ``softmax_features(q)`` sums to 1 over the D features and each column of
``softmax_sequence(k)`` sums to 1 over the M keys, so every output row is a convex combination
of value rows, with O((N + M) D Dv) work. Nyströmformer starts from this form (seed 004).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ...registry import register_method
from .._masks import compute_dtype, compute_precision, drop_padded, masked_fill_value, no_key_rows
from .._sharded import Shards

__all__ = ["EfficientOptions", "efficient_attention", "flops"]


@dataclass
class EfficientOptions:
    """Double-softmax attention has no options."""


def flops(B, H, N, M, D, Dv, o):
    """Matmul FLOPs of one forward (:mod:`subquad.compare.flops`): softmax(k)^T v, then
    softmax(q) times that."""
    return 2 * B * H * (M * D * Dv + N * D * Dv)


def _context_parallel(q, k, v, key_padding_mask, causal, scale, options: EfficientOptions, shards: Shards) -> Tensor:
    """The entry's ``context_parallel`` (non-causal, like the method): the softmax over the
    sequence spans every rank's keys. Each rank takes ``exp(k - c)`` with ``c`` the maximum over
    all ranks' real keys (one all-reduce, no gradient), sums ``exp(k - c)^T [v, 1]`` over its keys,
    and one all-gather of these ``(D, Dv + 1)`` states gives ``softmax_sequence(k)^T v`` on every
    rank (LASP-2's exchange, Sun et al. 2025, arXiv 2502.07563)."""
    if scale is not None:
        raise ValueError("efficient: this method has no logit scale; pass scale=None")
    dtype = compute_dtype(q.dtype)
    with compute_precision(q):
        kl = k.to(dtype)
        if key_padding_mask is not None:
            kl = kl.masked_fill(key_padding_mask[:, None, :, None], masked_fill_value(dtype))
        ek = torch.exp(kl - shards.max(kl.amax(-2, keepdim=True)))
        v1 = torch.nn.functional.pad(drop_padded(v.to(dtype), key_padding_mask), (0, 1), value=1.0)
        state = shards.gather(ek.transpose(-2, -1) @ v1).sum(0)  # (B, H, D, Dv + 1)
        out = torch.softmax(q.to(dtype), dim=-1) @ (state[..., :-1] / state[..., -1:])
    return out.to(q.dtype)


@register_method("efficient", options=EfficientOptions, summary="double-softmax linear attention (Shen et al. 2021)",
                 causal=False, cross_attention=True, complexity="linear", flops=flops, logit_scale=False,
                 context_parallel=_context_parallel)
def efficient_attention(q, k, v, key_padding_mask, causal, scale):
    """Shapes: q ``(B, H, N, D)``, k ``(B, H, M, D)``, v ``(B, H, M, Dv)`` -> ``(B, H, N, Dv)``.

    The method has no logit scale: ``scale`` must be None. Padded keys get zero weight in the
    softmax over the sequence and their values are dropped (NaN or inf there reaches no output);
    queries of a fully padded sequence output 0. Float32 math under
    autocast; returns the dtype of q.
    """
    if scale is not None:
        raise ValueError("efficient: this method has no logit scale; pass scale=None")
    dtype = compute_dtype(q.dtype)
    with compute_precision(q):
        qs = torch.softmax(q.to(dtype), dim=-1)
        kl = k.to(dtype)
        if key_padding_mask is not None:
            kl = kl.masked_fill(key_padding_mask[:, None, :, None], masked_fill_value(dtype))
        ks = torch.softmax(kl, dim=-2)
        out = qs @ (ks.transpose(-2, -1) @ drop_padded(v.to(dtype), key_padding_mask))
        if key_padding_mask is not None:
            out = out.masked_fill(no_key_rows(key_padding_mask, q.shape[2], False), 0.0)
    return out.to(q.dtype)

