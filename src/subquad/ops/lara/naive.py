"""Slow, obvious reference of LARA's estimator, for the tests (the library never imports it)."""

from __future__ import annotations

import math

import torch

from . import _ALPHA_MIN

__all__ = ["lara_attention_reference"]


def lara_attention_reference(
    q, k, v, omega, q_landmarks, k_landmarks, key_padding_mask=None, scale=None, mis="opt", alpha_coeff=1.0,
):
    """Slow, obvious reference of LARA's estimator from its definition, with explicit densities.

    For samples ``omega`` ``(B, H, K, D)`` (paper units, row j from proposal ``j % C``) and
    landmarks ``(B, H, C, D)`` (units of q, k): with ``g_c = N(mu_c, I)``,
    ``p~_n(w) = N(w; 0, I) xi(q'_n, w) sum_m xi(k'_m, w)`` over real keys, the output of query n is
    ``sum_j w_nj f(w_j) / sum_j w_nj`` with ``w_nj = alpha_nc(w_j) p~_n(w_j) / g_c(w_j)``.
    Self-attention (N == M) with a mask leaves padded queries out of ``r'``.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    root = math.sqrt(scale)
    B, H, N, D = q.shape
    M = k.shape[2]
    C = q_landmarks.shape[2]
    K = omega.shape[2]
    qp, kp = q * root, k * root
    mu = (q_landmarks + k_landmarks) * root
    key_keep = torch.ones(B, M, dtype=torch.bool) if key_padding_mask is None else ~key_padding_mask
    query_keep = key_keep if (key_padding_mask is not None and N == M) else torch.ones(B, N, dtype=torch.bool)

    def gauss(w, mean):  # N(w; mean, I) over the last dim
        return torch.exp(-0.5 * (w - mean).square().sum(-1)) / (2 * math.pi) ** (D / 2)

    def xi(x, w):
        return torch.exp((w * x).sum(-1) - 0.5 * x.square().sum(-1))

    out = torch.zeros(B, H, N, v.shape[-1], dtype=q.dtype)
    for b in range(B):
        for h in range(H):
            real_k = key_keep[b].nonzero().flatten()
            if len(real_k) == 0:
                continue
            r_logits = (q_landmarks[b, h] * root) @ qp[b, h].T  # (C, N)
            r_logits[:, ~query_keep[b]] = float("-inf")
            r = torch.softmax(r_logits, dim=-1)
            for n in range(N):
                num = torch.zeros(v.shape[-1], dtype=q.dtype)
                den = torch.zeros((), dtype=q.dtype)
                for j in range(K):
                    c = j % C
                    w = omega[b, h, j]
                    xi_k = torch.stack([xi(kp[b, h, m], w) for m in real_k])
                    f = (xi_k[:, None] * v[b, h, real_k]).sum(0) / xi_k.sum()
                    p_tilde = gauss(w, torch.zeros_like(w)) * xi(qp[b, h, n], w) * xi_k.sum()
                    g_all = torch.stack([gauss(w, mu[b, h, cc]) for cc in range(C)])
                    bh = g_all[c] / g_all.sum()
                    if mis == "bh":
                        alpha = bh
                    else:
                        alpha = bh + alpha_coeff * (r[c, n] - r[:, n].mean())
                        alpha = torch.clamp(alpha, min=_ALPHA_MIN)
                    weight = alpha * p_tilde / g_all[c]
                    num = num + weight * f
                    den = den + weight
                out[b, h, n] = num / den
    return out

