"""Slow, obvious reference of FAVOR+, for the tests (the library never imports it)."""

from __future__ import annotations

from ..linear.naive import kernel_attention_reference
from . import performer_features

__all__ = ["performer_attention_reference"]


def performer_attention_reference(q, k, v, features, key_padding_mask=None, causal=False, scale=None):
    """Slow, obvious reference: unstabilised features and the explicit ``(N, M)`` matrix."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    phi_q = performer_features(q, features, kind="raw", scale=scale)
    phi_k = performer_features(k, features, kind="raw", scale=scale)
    return kernel_attention_reference(phi_q, phi_k, v, key_padding_mask, causal)
