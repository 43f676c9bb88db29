"""Slow, obvious reference of double-softmax attention, for the tests (the library never
imports it)."""

from __future__ import annotations

import torch

__all__ = ["efficient_attention_reference"]


def efficient_attention_reference(q, k, v, key_padding_mask=None):
    """Slow, obvious reference: the explicit ``(N, M)`` weight matrix."""
    qs = torch.softmax(q, dim=-1)
    kl = k
    if key_padding_mask is not None:
        kl = k.masked_fill(key_padding_mask[:, None, :, None], float("-inf"))
    ks = torch.softmax(kl, dim=-2).nan_to_num(0.0)
    w = qs @ ks.transpose(-2, -1)  # (B, H, N, M), rows sum to 1
    return w @ v
