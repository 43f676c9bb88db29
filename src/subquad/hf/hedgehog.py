"""Hedgehog: linear attention with a learned, per-head feature map.

Zhang, Bhatia, Kumbong and Ré (2024), "The Hedgehog & the Porcupine: Expressive Linear
Attentions with Softmax Mimicry", ICLR 2024, Section 4.1: a per-head linear layer followed by
``[softmax(x W + b), softmax(-(x W + b))]`` over the feature axis, trained so that linear
attention with these features mimics softmax attention. LoLCATs (Zhang et al. 2024, "LoLCATs:
On Low-Rank Linearizing of Large Language Models", Section 3.1) trains the same maps against
the exact layer's *output*, which is what :func:`subquad.hf.transfer` does.

``window > 0`` adds the LoLCATs hybrid (Section 3.2, there a sliding window): each query attends
to the keys of its own block of ``window`` tokens and of the neighbouring blocks (the previous one
only, and no later position, when causal) with exact ``exp(q.k * scale)`` weights, and to all
other keys with the linear term, under one shared normaliser. The window term costs
``O(N * window)``, so the whole stays linear in N.

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


def _blocks(x: Tensor, size: int, n_blocks: int) -> Tensor:
    """``(B, H, L, E)`` -> ``(B, H, n_blocks, size, E)``, zero-padded at the end."""
    pad = n_blocks * size - x.shape[2]
    return F.pad(x, (0, 0, 0, pad)).unflatten(2, (n_blocks, size))


def _neighbours(xb: Tensor, causal: bool) -> Tensor:
    """Each block with its neighbours along the key axis: ``(B, H, nb, S, E)`` ->
    ``(B, H, nb, k*S, E)`` with blocks ``[i-1, i]`` (causal) or ``[i-1, i, i+1]``; zeros outside."""
    prev = F.pad(xb, (0, 0, 0, 0, 1, 0))[:, :, :-1]
    parts = [prev, xb] if causal else [prev, xb, F.pad(xb, (0, 0, 0, 0, 0, 1))[:, :, 1:]]
    return torch.cat(parts, dim=3)


def window_keys(n: int, m: int, window: int, causal: bool, device=None) -> Tensor:
    """Bool ``(nb, window, k*window)``: which key slot of :func:`_neighbours` is a real key in the
    exact window of each query (same or adjacent block of ``window`` tokens; causal: earlier or
    same position)."""
    nb = -(-n // window)
    span = 2 if causal else 3
    qpos = torch.arange(nb * window, device=device).view(nb, window, 1)
    blk = torch.arange(nb, device=device).view(nb, 1, 1)
    kpos = (blk - 1) * window + torch.arange(span * window, device=device).view(1, 1, -1)
    ok = (kpos >= 0) & (kpos < m) & (qpos < n)
    if causal:
        ok = ok & (kpos <= qpos)
    return ok


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
    sinks: int = 0,
) -> Tensor:
    """Linear attention on the features ``phi_q`` ``(B, H, N, F)``, ``phi_k`` ``(B, H, M, F)``,
    plus the optional exact window (on the raw q ``(B, H, N, D)``, k ``(B, H, M, D)``).

    The window is block-banded: the tokens are cut in blocks of ``window``; a query sees exactly
    the keys of its own block and the previous one (and the next one, non-causal), so between
    ``window`` and ``3 * window`` keys, computed as small dense block products; every other key
    goes through the linear term. Returns ``(B, H, N, Dv)``. ``key_padding_mask`` bool
    ``(B, M)``, True = padding. ``linear_weight`` ``(H,)`` (positive) weighs the linear term
    against the window's ``exp`` weights (LoLCATs learns this balance too); default 1.
    ``sinks`` (``<= window``): the first ``sinks`` keys are exact for every query too (the
    "attention sinks" of Xiao et al. 2024, "Efficient Streaming Language Models with Attention
    Sinks", Section 3; BERT's [CLS] takes 10-16% of the attention mass in MiniLM's middle layers).
    """
    if sinks > 0 and not 0 < sinks <= window:
        raise ValueError(f"hedgehog: sinks must be <= window, got sinks={sinks}, window={window}")
    if window <= 0:
        return kernel_attention(phi_q, phi_k, v, key_padding_mask, causal, chunk_size)
    n, m = q.shape[2], k.shape[2]
    if n != m:
        raise ValueError("hedgehog: window > 0 needs equal query and key lengths")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if key_padding_mask is not None:
        phi_k = phi_k.masked_fill(key_padding_mask[:, None, :, None], 0.0)
    v1 = F.pad(v, (0, 1), value=1.0)  # last column: the normaliser
    if causal:
        from ..ops.linear import _causal_chunked

        lin = _causal_chunked(phi_q, phi_k, v1, chunk_size)
    else:
        lin = phi_q @ (phi_k.transpose(-2, -1) @ v1)
    nb = -(-n // window)
    ok = window_keys(n, m, window, causal, q.device)  # (nb, S, K)
    if key_padding_mask is not None:
        real = _neighbours(_blocks((~key_padding_mask)[:, None, :, None].float(), window, nb), causal)
        ok = ok & (real.squeeze(-1) > 0)[:, 0, :, None, :]  # (B, nb, S, K)
        ok = ok[:, None]
    qb, kn = _blocks(q, window, nb), _neighbours(_blocks(k, window, nb), causal)
    fqb, fkn = _blocks(phi_q, window, nb), _neighbours(_blocks(phi_k, window, nb), causal)
    vn = _neighbours(_blocks(v1, window, nb), causal)
    if sinks > 0:  # extra key slots: the first keys, for query blocks whose window misses block 0
        s_ok = (torch.arange(nb, device=q.device) >= 2).view(nb, 1, 1).expand(nb, window, sinks)
        if key_padding_mask is not None:
            s_ok = s_ok & ~key_padding_mask[:, None, None, None, :sinks]  # (B, 1, nb, S, s)
            ok = torch.cat([ok.expand(*s_ok.shape[:-1], ok.shape[-1]), s_ok], -1)
        else:
            ok = torch.cat([ok, s_ok], -1)

        def add(xn, x):
            return torch.cat([xn, x[:, :, None, :sinks].expand(-1, -1, nb, -1, -1)], 3)

        kn, fkn, vn = add(kn, k), add(fkn, phi_k), add(vn, v1)
    # the window's keys leave the linear term (every key counts once) ...
    lin_w = (fqb @ fkn.transpose(-2, -1)).masked_fill(~ok, 0.0)
    lin = lin - (lin_w @ vn).flatten(2, 3)[:, :, :n]
    # ... and enter with exact weights, stabilised by the row max (clamped at 0 so exp(-mx) <= 1:
    # tiny window weights then underflow, which is right, the linear term of order 1 dominates)
    logits = (qb @ kn.transpose(-2, -1) * scale).masked_fill(~ok, -1e30)
    mx = logits.amax(-1, keepdim=True).clamp_min(0.0)
    ew = torch.exp(logits - mx).masked_fill(~ok, 0.0)
    lin = lin * torch.exp(-mx).flatten(2, 3)[:, :, :n]
    if linear_weight is not None:
        lin = lin * linear_weight.view(1, -1, 1, 1)
    out = (ew @ vn).flatten(2, 3)[:, :, :n] + lin
    den = out[..., -1:]
    return out[..., :-1] / torch.where(den > 0, den, torch.ones_like(den))


def hedgehog_attention_reference(phi_q, phi_k, q, k, v, key_padding_mask=None, causal=False, window=0,
                                 scale=None, linear_weight=None, sinks=0):
    """Slow, obvious reference with the explicit ``(N, M)`` weight matrix."""
    n, m = q.shape[2], k.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    w = phi_q @ phi_k.transpose(-2, -1)
    if linear_weight is not None and window > 0:
        w = w * linear_weight.view(1, -1, 1, 1)
    i = torch.arange(n)[:, None]
    j = torch.arange(m)[None, :]
    if window > 0:
        near = ((i // window - j // window).abs() <= 1) | (j < sinks)
        w = torch.where(near, torch.exp(q @ k.transpose(-2, -1) * scale), w)
    if causal:
        w = w.masked_fill(j > i, 0.0)
    if key_padding_mask is not None:
        w = w.masked_fill(key_padding_mask[:, None, None, :], 0.0)
    den = w.sum(-1, keepdim=True)
    return torch.where(den > 0, (w @ v) / den, torch.zeros_like(den))


