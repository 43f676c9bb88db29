"""Randomized Attention (RA), Zheng et al. 2022; the notation and the noise scale shared with
LARA (:mod:`subquad.ops.lara`).

Notation. With logit scale ``s``, "paper units" are ``q' = sqrt(s) q`` and ``k' = sqrt(s) k``,
so ``q'.k' = s q.k``. The positive random feature of x at ``w`` is ``xi(x, w) = exp(w.x - |x|^2/2)``.

Softmax attention is an expectation: for query n,

    softmax_attn(q_n) = E_{w ~ p_n}[f(w)],   f(w) = sum_m softmax_m(w.k'_m - |k'_m|^2/2) v_m,
    p_n(w) = sum_m pi_nm N(w; q'_n + k'_m, I),   pi_n = softmax(s q_n.k).

**RA** samples ``w ~ p_n`` (a key index from the softmax row, then Gaussian noise) and outputs
``f(w)``: unbiased, but quadratic. **LARA** uses C Gaussian proposals ``N(mu_c, I)`` shared by all
queries, ``mu_c = q~'_c + k~'_c`` (query and key landmarks), one sample per proposal, and a
self-normalised multiple-importance-sampling estimate; ``f`` is evaluated once per sample, so
only an (N, C) weight matrix depends on the queries and the cost is linear in N and M.

Noise scale (option ``noise``): ``"paper"`` draws ``w = mu + eps`` with ``eps ~ N(0, I)`` in paper
units, the exact (unbiased / consistent) estimator; ``"reference"`` uses std ``sqrt(s)``
(``D^{-1/4}`` at the default scale), the authors' code convention (unit noise in unscaled
units). The densities in the weights always assume unit variance, so ``"reference"`` is biased:
lower variance at one sample, but it does not converge to softmax attention. Defaults: RA uses
``"paper"`` (its point is unbiasedness); LARA uses ``"reference"`` in training mode (the regime it
is trained in; at one sample per proposal the paper noise makes its error as large as
Performer's, see ``benchmarks/results/fidelity.md``). Its eval mode draws no noise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ...checks import check_choice, check_int
from ...registry import register_method
from .._common import check_generator, randn
from .._masks import compute_dtype, compute_precision, drop_padded, no_key_rows, padding_bias

__all__ = ["RaOptions", "flops", "noise_std", "ra_attention", "ra_samples"]

# elements of one (rows, M) block of softmax probabilities when RA samples key indices
_SAMPLE_BLOCK = 1 << 22


def noise_std(noise: str, scale: float) -> float:
    """Std of the sampling noise in paper units: 1 for ``"paper"``, ``sqrt(scale)`` for
    ``"reference"``."""
    if noise == "paper":
        return 1.0
    if noise == "reference":
        return math.sqrt(scale)
    raise ValueError(f"noise must be 'paper' or 'reference', got {noise!r}")


def _feature_attention(omega: Tensor, k_paper: Tensor, v: Tensor, key_padding_mask: Tensor | None) -> Tensor:
    """``f(w) = softmax_m(w.k'_m - |k'_m|^2/2) v`` for every row w of ``omega`` ``(B, H, R, D)``
    -> ``(B, H, R, Dv)``. The ``-|k'|^2/2`` term rides along as an extra coordinate (w gets a 1,
    k' gets ``-|k'|^2/2``), so SDPA evaluates it without forming an (R, M) matrix where it can."""
    half_sq = k_paper.square().sum(-1, keepdim=True).mul(-0.5)
    k_aug = torch.cat([k_paper, half_sq], dim=-1)
    w_aug = F.pad(omega, (0, 1), value=1.0)
    bias = padding_bias(key_padding_mask, omega.dtype)
    return F.scaled_dot_product_attention(w_aug, k_aug, v, attn_mask=bias, scale=1.0)


@torch.no_grad()
def _sample_key_indices(q, k, key_padding_mask, scale, num_samples, generator) -> Tensor:
    """``(B, H, N, S)`` key indices, each drawn from the (masked) softmax row of its query;
    padded keys have probability exactly 0. Blocks of queries keep the (rows, M) probability
    matrix small. A row that is not finite (NaN or inf in q or k) draws uniformly instead of
    failing inside ``multinomial``: its output is NaN, as every other method's is."""
    B, H, N, _ = q.shape
    M = k.shape[2]
    bias = padding_bias(key_padding_mask, q.dtype)
    rows = max(1, _SAMPLE_BLOCK // max(1, B * H * M))
    out = []
    for s in range(0, N, rows):
        logits = (q[:, :, s : s + rows] @ k.transpose(-2, -1)) * scale
        if bias is not None:
            logits = logits + bias
        probs = torch.softmax(logits, dim=-1).reshape(-1, M)
        probs = probs.masked_fill(~probs.isfinite().all(-1, keepdim=True), 1.0)
        if generator is not None and probs.device != generator.device:
            probs = probs.to(generator.device)
        idx = torch.multinomial(probs, num_samples, replacement=True, generator=generator)
        out.append(idx.to(q.device).view(B, H, min(rows, N - s), num_samples))
    return torch.cat(out, dim=2)


def ra_samples(
    q: Tensor,
    k: Tensor,
    key_padding_mask: Tensor | None = None,
    *,
    scale: float | None = None,
    num_samples: int = 1,
    noise: str = "paper",
    generator: torch.Generator | None = None,
) -> Tensor:
    """RA's samples ``w ~ p_n`` in paper units: ``(B, H, N, S, D)``.

    For each query n and draw s: a key index j from ``softmax(s q_n.k)`` (no gradient; padded
    keys are never drawn), then ``w = sqrt(s) (q_n + k_j) + std * eps`` with ``eps ~ N(0, I)`` and
    ``std = noise_std(noise, scale)``. Gradients reach q and the drawn keys. Indices are drawn
    first, then the noise, both from ``generator``.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    B, H, N, D = q.shape
    idx = _sample_key_indices(q, k, key_padding_mask, scale, num_samples, generator)
    k_drawn = k.gather(2, idx.reshape(B, H, N * num_samples, 1).expand(-1, -1, -1, D))
    mean = (q.unsqueeze(-2) + k_drawn.view(B, H, N, num_samples, D)) * math.sqrt(scale)
    eps = randn(mean.shape, generator, mean)
    return mean + noise_std(noise, scale) * eps


@dataclass
class RaOptions:
    """Options of :func:`ra_attention`.

    num_samples: number S of independent draws per query; the output is their mean.
    noise: ``"paper"`` (unit noise in paper units: the unbiased estimator) or ``"reference"``
        (std ``sqrt(scale)``: the authors' code; biased).
    estimator: ``"sample"`` (draw as above) or ``"mixture_mean"``: the deterministic
        ``w = sqrt(s) (q_n + sum_m pi_nm k_m)`` without noise (biased; for eval).
    generator: source of the index and noise draws.
    """

    num_samples: int = 1
    noise: str = "paper"
    estimator: str = "sample"
    generator: torch.Generator | None = None

    def __post_init__(self):
        check_int("ra", "num_samples", self.num_samples, minimum=1)
        check_choice("ra", "noise", self.noise, ("paper", "reference"))
        check_choice("ra", "estimator", self.estimator, ("sample", "mixture_mean"))
        check_generator("ra", self.generator)


def flops(B, H, N, M, D, Dv, o):
    """Matmul FLOPs of one forward (:mod:`subquad.compare.flops`)."""
    if o["estimator"] == "mixture_mean":
        # mixture mean softmax(q k^T) k, then f at that point (the extra 1 carries -|k|^2/2)
        return 2 * B * H * N * M * (2 * D) + 2 * B * H * N * M * (D + 1 + Dv)
    s = o["num_samples"]
    sampling = 2 * B * H * N * M * D  # softmax rows to draw key indices from
    return sampling + 2 * B * H * N * s * M * (D + 1 + Dv)


@register_method("ra", options=RaOptions,
                 summary="randomized attention: unbiased sampling estimate of softmax attention (Zheng et al. 2022)",
                 causal=False, cross_attention=True, complexity="quadratic", stochastic=True,
                 core="subquad.layers.ra:RaCore", flops=flops)
def ra_attention(q, k, v, key_padding_mask, causal, scale, *, num_samples, noise, estimator, generator):
    """Randomized attention (quadratic).

    Shapes: q ``(B, H, N, D)``, k ``(B, H, M, D)``, v ``(B, H, M, Dv)`` -> ``(B, H, N, Dv)``.

    ``estimator="sample"``: the mean over ``num_samples`` draws ``w ~ p_n`` (:func:`ra_samples`) of
    ``f(w) = softmax_m(w.k'_m - |k'_m|^2/2) v``; with ``noise="paper"`` its expectation is exactly
    softmax attention. ``estimator="mixture_mean"``: ``f`` at the mixture mean, deterministic.
    Padded keys are never drawn and are masked in ``f`` (the authors' code ignores the mask);
    a query that sees no real key outputs 0. Math in float32 (float64 stays float64) under
    autocast; the result has the dtype of q.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    dtype = compute_dtype(q.dtype)
    B, H, N, _ = q.shape
    with compute_precision(q):
        qc, kc, vc = q.to(dtype), k.to(dtype), v.to(dtype)
        # padded keys and values dropped (a NaN there times its weight 0 is NaN)
        kc, vc = drop_padded(kc, key_padding_mask), drop_padded(vc, key_padding_mask)
        root = math.sqrt(scale)
        k_paper = kc * root
        if estimator == "mixture_mean":
            bias = padding_bias(key_padding_mask, dtype)
            k_mean = F.scaled_dot_product_attention(qc, kc, kc, attn_mask=bias, scale=scale)
            out = _feature_attention((qc + k_mean) * root, k_paper, vc, key_padding_mask)
        else:
            omega = ra_samples(
                qc, kc, key_padding_mask, scale=scale, num_samples=num_samples, noise=noise,
                generator=generator,
            )
            f = _feature_attention(omega.flatten(2, 3), k_paper, vc, key_padding_mask)
            out = f.unflatten(2, (N, num_samples)).mean(-2)
        if key_padding_mask is not None:
            out = out.masked_fill(no_key_rows(key_padding_mask, N, False), 0.0)
    return out.to(q.dtype)

