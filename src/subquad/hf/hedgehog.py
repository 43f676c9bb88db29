"""Hedgehog: linear attention with a learned, per-head feature map.

Zhang, Bhatia, Kumbong and Ré (2024), "The Hedgehog & the Porcupine: Expressive Linear
Attentions with Softmax Mimicry", ICLR 2024, Section 4.1: a per-head linear layer followed by
``[softmax(x W + b), softmax(-(x W + b))]`` over the feature axis, trained so that linear
attention with these features mimics softmax attention. LoLCATs (Zhang et al. 2024, "LoLCATs:
On Low-Rank Linearizing of Large Language Models", Section 3.1) trains the same maps against
the exact layer's *output*, which is what :func:`subquad.hf.transfer` does.

``window > 0`` adds the LoLCATs hybrid (Section 3.2): each query attends to its ``window`` most
recent-and-following keys (``|i - j| < window``; only ``j <= i`` when causal) with exact
``exp(q.k * scale)`` weights, and to all other keys with the linear term, under one shared
normaliser. The window term costs ``O(N * window)``, so the whole stays linear in N.

This is implemented here with torch directly (it is a retrofit piece, not a registry op): the
module owns its parameters and calls :func:`subquad.ops.linear.kernel_attention` for the linear
term, so masking and the chunked causal form are the library's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..ops.linear import kernel_attention

__all__ = ["HedgehogFeatureMap", "hedgehog_attention", "hedgehog_attention_reference"]


class HedgehogFeatureMap(nn.Module):
    """``phi(x) = [softmax(x W_h + b_h), softmax(-(x W_h + b_h))]`` per head h.

    x ``(B, H, L, D)`` -> ``(B, H, L, 2F)``, non-negative, each half summing to 1. ``W`` starts at
    the identity (``F = D``; extra columns start at zero), ``b`` at zero, so the untrained map is
    softmax of the raw q or k.
    """

    def __init__(self, heads: int, head_dim: int, feature_dim: int | None = None):
        super().__init__()
        feature_dim = head_dim if feature_dim is None else int(feature_dim)
        if feature_dim < 1:
            raise ValueError(f"hedgehog: feature_dim must be >= 1, got {feature_dim}")
        eye = torch.eye(head_dim, feature_dim)
        self.weight = nn.Parameter(eye.expand(heads, head_dim, feature_dim).clone())
        self.bias = nn.Parameter(torch.zeros(heads, 1, feature_dim))

    def forward(self, x: Tensor) -> Tensor:
        z = torch.einsum("bhld,hdf->bhlf", x, self.weight) + self.bias
        return torch.cat([torch.softmax(z, dim=-1), torch.softmax(-z, dim=-1)], dim=-1)


def _window_scores(q: Tensor, k: Tensor, window: int, causal: bool, scale: float):
    """Exact logits of each query against keys ``j`` with ``|i - j| < window`` (``j <= i`` when
    causal), gathered into ``(B, H, N, W)`` plus the key index of each slot and a validity mask;
    never an ``N x M`` tensor."""
    n, m = q.shape[2], k.shape[2]
    lo = -(window - 1)
    hi = 0 if causal else window - 1
    offsets = torch.arange(lo, hi + 1, device=q.device)
    idx = torch.arange(n, device=q.device)[:, None] + offsets[None, :]  # (N, W)
    valid = (idx >= 0) & (idx < m)
    idx_c = idx.clamp(0, m - 1)
    kw = k[:, :, idx_c]  # (B, H, N, W, D)
    logits = torch.einsum("bhnd,bhnwd->bhnw", q, kw) * scale
    return logits, idx_c, valid


def hedgehog_attention(
    phi_q: Tensor,
    phi_k: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_padding_mask: Tensor | None,
    causal: bool,
    *,
    window: int = 0,
    scale: float | None = None,
    chunk_size: int = 64,
    linear_weight: Tensor | None = None,
) -> Tensor:
    """Linear attention on the features ``phi_q`` ``(B, H, N, F)``, ``phi_k`` ``(B, H, M, F)``,
    plus the optional exact sliding window (on the raw q ``(B, H, N, D)``, k ``(B, H, M, D)``).

    Returns ``(B, H, N, Dv)``. ``key_padding_mask`` bool ``(B, M)``, True = padding. Keys inside
    the window are removed from the linear term, so every key counts once. ``linear_weight``
    ``(H,)`` (positive) weighs the linear term against the window's ``exp`` weights (LoLCATs
    learns this balance too); default 1.
    """
    if window <= 0:
        return kernel_attention(phi_q, phi_k, v, key_padding_mask, causal, chunk_size)
    if q.shape[2] != k.shape[2]:
        raise ValueError("hedgehog: window > 0 needs equal query and key lengths")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if key_padding_mask is not None:
        phi_k = phi_k.masked_fill(key_padding_mask[:, None, :, None], 0.0)
    logits, idx, valid = _window_scores(q, k, window, causal, scale)
    if key_padding_mask is not None:
        valid = valid & ~key_padding_mask[:, idx][:, None]  # (B, 1, N, W)
    # linear term over all keys, then the window's keys taken out again: sum_j phi_q.phi_k_j
    v1 = F.pad(v, (0, 1), value=1.0)  # last column: the normaliser
    if causal:
        from ..ops.linear import _causal_chunked

        lin = _causal_chunked(phi_q, phi_k, v1, chunk_size)
    else:
        lin = phi_q @ (phi_k.transpose(-2, -1) @ v1)
    lin_w = torch.einsum("bhnf,bhnwf->bhnw", phi_q, phi_k[:, :, idx]).masked_fill(~valid, 0.0)
    v1w = v1[:, :, idx]  # (B, H, N, W, Dv+1)
    lin = lin - torch.einsum("bhnw,bhnwe->bhne", lin_w, v1w)
    # exact window term, stabilised by the row max; the linear term is scaled to match
    logits = logits.masked_fill(~valid, -1e30)
    # (clamped at 0, so exp(-mx) <= 1 never overflows; tiny window weights then underflow, which
    # is right: the linear term, of order 1, dominates them)
    mx = logits.amax(-1, keepdim=True).clamp_min(0.0)
    ew = torch.exp(logits - mx).masked_fill(~valid, 0.0)
    lin = lin * torch.exp(-mx)
    if linear_weight is not None:
        lin = lin * linear_weight.view(1, -1, 1, 1)
    out = torch.einsum("bhnw,bhnwe->bhne", ew, v1w) + lin
    den = out[..., -1:]
    return out[..., :-1] / torch.where(den > 0, den, torch.ones_like(den))


def hedgehog_attention_reference(phi_q, phi_k, q, k, v, key_padding_mask=None, causal=False, window=0,
                                 scale=None, linear_weight=None):
    """Slow, obvious reference with the explicit ``(N, M)`` weight matrix."""
    n, m = q.shape[2], k.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    w = phi_q @ phi_k.transpose(-2, -1)
    if linear_weight is not None and window > 0:
        w = w * linear_weight.view(1, -1, 1, 1)
    i = torch.arange(n)[:, None]
    j = torch.arange(m)[None, :]
    if window > 0:
        near = (i - j).abs() < window
        w = torch.where(near, torch.exp(q @ k.transpose(-2, -1) * scale), w)
    if causal:
        w = w.masked_fill(j > i, 0.0)
    if key_padding_mask is not None:
        w = w.masked_fill(key_padding_mask[:, None, None, :], 0.0)
    den = w.sum(-1, keepdim=True)
    return torch.where(den > 0, (w @ v) / den, torch.zeros_like(den))


