"""Slow, obvious references of kernel (linear) attention, for the tests (the library never
imports them): the explicit ``(N, M)`` weight matrix."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["kernel_attention_reference", "linear_attention_reference"]


def kernel_attention_reference(phi_q, phi_k, v, key_padding_mask=None, causal=False):
    """Slow, obvious reference: the explicit ``(N, M)`` weight matrix, masked and normalised."""
    w = phi_q @ phi_k.transpose(-2, -1)
    if causal:
        w = w.tril()
    if key_padding_mask is not None:
        w = w.masked_fill(key_padding_mask[:, None, None, :], 0.0)
    den = w.sum(-1, keepdim=True)
    return torch.where(den > 0, (w @ v) / den, torch.zeros_like(den))


def linear_attention_reference(q, k, v, key_padding_mask=None, causal=False):
    """Linear attention with the feature map ``elu(x) + 1`` (Katharopoulos et al. 2020, Eq. 7)."""
    return kernel_attention_reference(F.elu(q) + 1, F.elu(k) + 1, v, key_padding_mask, causal)
