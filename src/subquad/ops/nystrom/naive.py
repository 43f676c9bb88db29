"""Slow, obvious reference of Nyström attention, for the tests (the library never imports it)."""

from __future__ import annotations

import torch

from . import iterative_pinv, segment_lengths

__all__ = ["nystrom_attention_reference"]


def nystrom_attention_reference(
    q, k, v, key_padding_mask=None, scale=None, num_landmarks=64, pinv_iterations=6, pinv_init="per_matrix"
):
    """Slow, obvious reference: landmarks by a loop over segments, the three kernels as explicit
    matrices, and ``(F Z) (B V)`` written out (no exact fallback)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    B, H, n, _ = q.shape
    mk = k.shape[2]
    m = num_landmarks
    keep_k = torch.ones(B, mk, dtype=torch.bool) if key_padding_mask is None else ~key_padding_mask
    keep_q = keep_k if (key_padding_mask is not None and n == mk) else torch.ones(B, n, dtype=torch.bool)

    def landmarks(x, keep):
        out = torch.zeros(B, H, m, x.shape[-1], dtype=x.dtype)
        valid = torch.zeros(B, m, dtype=torch.bool)
        start = 0
        for j, length in enumerate(segment_lengths(x.shape[2], m)):
            for b in range(B):
                sel = keep[b, start : start + length]
                if sel.any():
                    out[b, :, j] = x[b, :, start : start + length][:, sel].mean(1)
                    valid[b, j] = True
            start += length
        return out, valid

    q_land, valid_q = landmarks(q, keep_q)
    k_land, valid_k = landmarks(k, keep_k)
    neg = float("-inf")
    f = (q @ k_land.transpose(-2, -1) * scale).masked_fill(~valid_k[:, None, None, :], neg).softmax(-1)
    a = (q_land @ k_land.transpose(-2, -1) * scale).masked_fill(~valid_k[:, None, None, :], neg).softmax(-1)
    a = a.nan_to_num(0.0)
    void = ~valid_k[:, None, None, :] | ~valid_q[:, None, :, None]
    a = torch.where(void, torch.eye(m, dtype=a.dtype), a)
    bk = (q_land @ k.transpose(-2, -1) * scale).masked_fill(~keep_k[:, None, None, :], neg).softmax(-1)
    z = iterative_pinv(a, pinv_iterations, pinv_init)
    out = (f @ z) @ (bk @ v)
    no_key = ~keep_k.any(-1)
    return out.nan_to_num(0.0).masked_fill(no_key[:, None, None, None], 0.0)
