"""Slow, obvious reference of RA's evaluation step, for the tests (the library never imports it)."""

from __future__ import annotations

import math

import torch

__all__ = ["ra_attention_reference"]


def ra_attention_reference(q, k, v, omega, key_padding_mask=None, scale=None):
    """Slow, obvious reference for the evaluation step of RA: for samples ``omega``
    ``(B, H, N, S, D)`` (paper units), the mean over s of
    ``sum_m xi(k'_m, w_s) v_m / sum_m xi(k'_m, w_s)`` over real keys, with explicit features."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    k_paper = k * math.sqrt(scale)
    log_xi = torch.einsum("bhnsd,bhmd->bhnsm", omega, k_paper) - 0.5 * k_paper.square().sum(-1)[:, :, None, None]
    xi = torch.exp(log_xi)
    if key_padding_mask is not None:
        xi = xi.masked_fill(key_padding_mask[:, None, None, None, :], 0.0)
    den = xi.sum(-1, keepdim=True)
    f = torch.einsum("bhnsm,bhmd->bhnsd", xi / den, v)
    out = f.mean(-2)
    if key_padding_mask is not None:
        out = out.nan_to_num(0.0).masked_fill(key_padding_mask.all(-1)[:, None, None, None], 0.0)
    return out

