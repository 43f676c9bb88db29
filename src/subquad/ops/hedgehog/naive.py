"""The slow, obvious reference of hedgehog attention: the explicit ``(N, M)`` weight matrix."""

from __future__ import annotations

import torch


def _features(x, weight, bias):
    z = torch.einsum("bhld,hdf->bhlf", x, weight) + bias
    return torch.cat([torch.softmax(z, dim=-1), torch.softmax(-z, dim=-1)], dim=-1)


def hedgehog_attention(q, k, v, key_padding_mask=None, causal=False, scale=None, *, feature_dim=None, window=0,
                       sinks=0, weight=None, bias=None, linear_log_weight=None):
    """Weights ``phi(q) . phi(k)`` (times ``exp(linear_log_weight)`` with a window), replaced by
    ``exp(q . k * scale)`` for keys in the same or an adjacent block of ``window`` tokens and the
    first ``sinks`` keys; causal and padding masks zero weights; rows normalised (0 if empty).
    ``weight`` / ``bias`` None: the identity map (``F = feature_dim`` or D) and zero."""
    heads, d = q.shape[1], q.shape[-1]
    f = d if feature_dim is None else feature_dim
    weight = torch.eye(d, f, dtype=q.dtype).expand(heads, d, f) if weight is None else weight
    bias = torch.zeros(heads, 1, f, dtype=q.dtype) if bias is None else bias
    phi_q, phi_k = _features(q, weight, bias), _features(k, weight, bias)
    n, m = q.shape[2], k.shape[2]
    scale = d ** -0.5 if scale is None else scale
    w = phi_q @ phi_k.transpose(-2, -1)
    if window > 0 and linear_log_weight is not None:
        w = w * linear_log_weight.exp().view(1, -1, 1, 1)
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
