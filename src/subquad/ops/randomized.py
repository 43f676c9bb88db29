"""Randomized Attention (RA) and Linear Randomized Attention (LARA), Zheng et al. 2022.

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

from ..registry import register_method
from ._masks import compute_dtype, compute_precision, masked_fill_value, no_key_rows
from ..checks import check_bool, check_choice, check_float, check_int
from .nystrom import segment_means

__all__ = [
    "ra_attention",
    "ra_samples",
    "ra_attention_reference",
    "lara_attention",
    "lara_samples",
    "lara_weights",
    "lara_attention_reference",
    "noise_std",
]

# elements of one (rows, M) block of softmax probabilities when RA samples key indices
_SAMPLE_BLOCK = 1 << 22
# alpha is clamped here before its log (the mis="opt" weights can go negative)
_ALPHA_MIN = 1e-8


def noise_std(noise: str, scale: float) -> float:
    """Std of the sampling noise in paper units: 1 for ``"paper"``, ``sqrt(scale)`` for
    ``"reference"``."""
    if noise == "paper":
        return 1.0
    if noise == "reference":
        return math.sqrt(scale)
    raise ValueError(f"noise must be 'paper' or 'reference', got {noise!r}")


def _check_generator(method: str, generator) -> None:
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"{method}: generator must be a torch.Generator, got {type(generator).__name__}")


def _randn(shape, generator: torch.Generator | None, like: Tensor) -> Tensor:
    """Standard normal draws with the dtype and device of ``like``; drawn on the generator's
    device (CPU for a CPU generator) and moved, so a CPU generator works for any device."""
    if generator is None:
        return torch.randn(shape, dtype=like.dtype, device=like.device)
    out = torch.randn(shape, generator=generator, dtype=like.dtype, device=generator.device)
    return out.to(like.device)


def _key_bias(key_padding_mask: Tensor | None, dtype) -> Tensor | None:
    """Additive ``(B, 1, 1, M)`` logit bias: a large finite negative value at padded keys."""
    if key_padding_mask is None:
        return None
    bias = torch.zeros(key_padding_mask.shape, dtype=dtype, device=key_padding_mask.device)
    return bias.masked_fill_(key_padding_mask, masked_fill_value(dtype))[:, None, None, :]


def _feature_attention(omega: Tensor, k_paper: Tensor, v: Tensor, key_padding_mask: Tensor | None) -> Tensor:
    """``f(w) = softmax_m(w.k'_m - |k'_m|^2/2) v`` for every row w of ``omega`` ``(B, H, R, D)``
    -> ``(B, H, R, Dv)``. The ``-|k'|^2/2`` term rides along as an extra coordinate (w gets a 1,
    k' gets ``-|k'|^2/2``), so SDPA evaluates it without forming an (R, M) matrix where it can."""
    half_sq = k_paper.square().sum(-1, keepdim=True).mul(-0.5)
    k_aug = torch.cat([k_paper, half_sq], dim=-1)
    w_aug = F.pad(omega, (0, 1), value=1.0)
    bias = _key_bias(key_padding_mask, omega.dtype)
    return F.scaled_dot_product_attention(w_aug, k_aug, v, attn_mask=bias, scale=1.0)


# ----------------------------------------------------------------------------------------------
# RA
# ----------------------------------------------------------------------------------------------


@torch.no_grad()
def _sample_key_indices(q, k, key_padding_mask, scale, num_samples, generator) -> Tensor:
    """``(B, H, N, S)`` key indices, each drawn from the (masked) softmax row of its query;
    padded keys have probability exactly 0. Blocks of queries keep the (rows, M) probability
    matrix small."""
    B, H, N, _ = q.shape
    M = k.shape[2]
    bias = _key_bias(key_padding_mask, q.dtype)
    rows = max(1, _SAMPLE_BLOCK // max(1, B * H * M))
    out = []
    for s in range(0, N, rows):
        logits = (q[:, :, s : s + rows] @ k.transpose(-2, -1)) * scale
        if bias is not None:
            logits = logits + bias
        probs = torch.softmax(logits, dim=-1).reshape(-1, M)
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
    eps = _randn(mean.shape, generator, mean)
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
        _check_generator("ra", self.generator)


@register_method(
    "ra",
    options=RaOptions,
    summary="randomized attention: unbiased sampling estimate of softmax attention (Zheng et al. 2022)",
    causal=False,
    cross_attention=True,
    complexity="quadratic",
    stochastic=True,
)
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
        root = math.sqrt(scale)
        k_paper = kc * root
        if estimator == "mixture_mean":
            bias = _key_bias(key_padding_mask, dtype)
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


# ----------------------------------------------------------------------------------------------
# LARA
# ----------------------------------------------------------------------------------------------


def lara_samples(
    mu: Tensor,
    *,
    num_samples: int = 1,
    antithetic: bool = False,
    noise: str,
    scale: float,
    generator: torch.Generator | None = None,
) -> Tensor:
    """LARA's samples in paper units: ``(B, H, K, D)`` from proposal means ``mu`` ``(B, H, C, D)``.

    Row ``j`` is drawn from proposal ``j % C``: ``num_samples`` blocks of C rows
    ``mu + std * eps`` (``eps ~ N(0, I)`` of shape ``(B, H, num_samples, C, D)``, drawn in one call),
    followed, when ``antithetic``, by the mirrored blocks ``mu - std * eps``; so
    ``K = C * num_samples * (2 if antithetic else 1)``. Gradients flow to ``mu``.
    """
    B, H, C, D = mu.shape
    eps = _randn((B, H, num_samples, C, D), generator, mu) * noise_std(noise, scale)
    if antithetic:
        eps = torch.cat([eps, -eps], dim=2)
    return (mu.unsqueeze(2) + eps).flatten(2, 3)


def _lara_terms(q, k, v, mu, omega, q_landmarks, scale, key_padding_mask, query_padding_mask, mis, alpha_coeff):
    """The pieces of LARA's estimator (see :func:`lara_weights`): ``w_scaled = sqrt(s) w``
    ``(B, H, K, D)``, so that ``log xi(q'_n, w_j) = q_n.w_scaled_j - |q'_n|^2/2``; the values
    ``f(w_j)`` ``(B, H, K, Dv)``; and the additive bias of the log weights, ``(B, H, N, K)`` for
    ``mis="opt"`` with ``alpha_coeff > 0``, else ``(B, H, 1, K)``. The log weights are
    ``q @ w_scaled^T + bias``. Large temporaries are updated in place where autograd allows."""
    B, H, C, D = mu.shape
    K = omega.shape[2]
    M = k.shape[2]
    reps = K // C
    neg = masked_fill_value(omega.dtype)
    w_scaled = omega * math.sqrt(scale)  # w.k' = (sqrt(s) w).k
    # keys: log xi(k'_m, w_j) as one batched GEMM onto the -|k'|^2/2 bias, then log Z and f(w)
    half_sq = torch.linalg.vector_norm(k, dim=-1).square().mul_(-0.5 * scale)  # (B, H, M)
    if key_padding_mask is not None:
        half_sq = half_sq.masked_fill(key_padding_mask[:, None, :], neg)
    log_k = torch.baddbmm(
        half_sq.reshape(B * H, 1, M), w_scaled.reshape(B * H, K, D), k.reshape(B * H, M, D).transpose(1, 2)
    ).view(B, H, K, M)
    shift = log_k.detach().amax(-1, keepdim=True)
    e = log_k.sub_(shift).exp_()  # in place: the GEMM needs only its inputs for backward
    z = e.sum(-1, keepdim=True)
    values = (e @ v) / z  # (B, H, K, Dv)
    log_z = (shift + z.log()).squeeze(-1)  # (B, H, K); the detached shift cancels in gradients
    # proposals: log g_c'(w_j) up to a term in |w_j|^2 only
    log_g = omega @ mu.transpose(-2, -1) - 0.5 * mu.square().sum(-1).unsqueeze(-2)  # (B, H, K, C)
    log_mix = torch.logsumexp(log_g, dim=-1)  # (B, H, K)
    if mis == "bh":
        return w_scaled, values, (log_z - log_mix).unsqueeze(-2)
    if mis != "opt":
        raise ValueError(f"mis must be 'opt' or 'bh', got {mis!r}")
    log_own = log_g.view(B, H, reps, C, C).diagonal(dim1=-2, dim2=-1).reshape(B, H, K)
    bh = torch.exp(log_own - log_mix)  # balance heuristic
    column = log_z - log_own
    if not alpha_coeff:
        return w_scaled, values, (bh.clamp_min(_ALPHA_MIN).log() + column).unsqueeze(-2)
    r_logits = q @ (q_landmarks * scale).transpose(-2, -1)  # (B, H, N, C)
    if query_padding_mask is not None:
        r_logits = r_logits.masked_fill(query_padding_mask[:, None, :, None], neg)
    r = torch.softmax(r_logits, dim=-2)  # r'_nc: softmax over queries
    # alpha = bh + lambda (r' - mean_c r'), clamped, then its log; tiled over the sample blocks
    alpha = r.mul(alpha_coeff).sub_(r.mean(-1, keepdim=True).mul_(alpha_coeff))
    if reps == 1:
        alpha = alpha.add_(bh.unsqueeze(-2))
    else:
        alpha = torch.add(bh.view(B, H, 1, reps, C), alpha.unsqueeze(-2)).view(B, H, -1, K)
    return w_scaled, values, alpha.clamp_min_(_ALPHA_MIN).log_().add_(column.unsqueeze(-2))


def lara_weights(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mu: Tensor,
    omega: Tensor,
    q_landmarks: Tensor,
    *,
    scale: float,
    key_padding_mask: Tensor | None = None,
    query_padding_mask: Tensor | None = None,
    mis: str = "opt",
    alpha_coeff: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """The two factors of LARA's output ``weights @ values`` (the op fuses the product into one
    ``scaled_dot_product_attention`` call and never keeps the weights).

    Args:
        q: ``(B, H, N, D)``, k: ``(B, H, M, D)``, v: ``(B, H, M, Dv)``, in the units of the op's
            inputs (logits ``scale * q.k``).
        mu: proposal means ``(B, H, C, D)`` and omega: samples ``(B, H, K, D)``, in paper units;
            row j of omega is drawn from proposal ``j % C`` (K a multiple of C).
        q_landmarks: ``(B, H, C, D)`` query landmarks (units of q) for the ``r'`` term.
        scale: the logit scale s (paper units are ``sqrt(s) x``).
        key_padding_mask: bool ``(B, M)``, True = padding. query_padding_mask: bool ``(B, N)``,
            queries left out of the softmax over queries in ``r'`` (self-attention).

    Returns:
        weights ``(B, H, N, K)``: self-normalised importance weights, each row sums to 1; and
        values ``(B, H, K, Dv)``: ``f(w_j) = sum_m softmax_m(w_j.k'_m - |k'_m|^2/2) v_m``,
        independent of the queries.

    Log weight of query n on sample j (proposal c): ``log alpha_nc + log xi(q'_n, w_j)
    + log Z(w_j) - log g_c(w_j)``, with ``Z(w) = sum_m xi(k'_m, w)`` over real keys. Terms that
    cancel are dropped: ``N(w; 0, I)`` against the Gaussian normaliser of g (both depend on j only
    through ``|w_j|^2``), and ``-|q'_n|^2/2``, constant over j. ``mis="bh"``:
    ``alpha_nc / g_c = 1 / sum_c' g_c'``. ``mis="opt"``: ``alpha_nc = g_c / sum_c' g_c'
    + alpha_coeff (r'_nc - mean_c r'_nc)`` with ``r'_nc = softmax_n(q'_n.q~'_c)``, clamped at
    1e-8 before its log. Nothing of size N x M is formed.
    """
    w_scaled, values, bias = _lara_terms(q, k, v, mu, omega, q_landmarks, scale, key_padding_mask,
                                         query_padding_mask, mis, alpha_coeff)
    return torch.softmax(q @ w_scaled.transpose(-2, -1) + bias, dim=-1), values


@dataclass
class LaraOptions:
    """Options of :func:`lara_attention`.

    num_landmarks: number C of proposals when the landmarks are computed by the op (segment
        means); C = min(num_landmarks, N, M). Not used when landmarks are given.
    mis: ``"opt"`` (balance heuristic + ``alpha_coeff * (r' - mean r')``, the paper's weights) or
        ``"bh"`` (balance heuristic only).
    alpha_coeff: lambda, the weight of the query-specific ``r'`` term of ``mis="opt"``.
    noise: ``"reference"`` (default: std ``sqrt(scale)``, the authors' code, which trains well
        and has the lower error at one sample per proposal, but is biased) or ``"paper"`` (unit
        noise in paper units: the consistent estimator, high variance at one sample). Used only
        when ``training``; ``benchmarks/results/fidelity.md`` compares the two.
    num_samples: samples per proposal when ``training`` (the authors use 1).
    antithetic: also use the mirrored samples ``mu - eps`` (doubles the samples).
    training: draw samples ``w = mu + noise``; False (default) uses ``w = mu``, the method's
        deterministic eval mode (``MultiheadAttention`` sets this from ``.train()/.eval()``).
    generator: source of the noise when ``training``.
    q_landmarks, k_landmarks: ``(B, H, C, D)`` query and key landmarks, in the units of q and
        k (from a landmark network); both or neither. Default: masked segment means.
    """

    num_landmarks: int = 64
    mis: str = "opt"
    alpha_coeff: float = 1.0
    noise: str = "reference"
    num_samples: int = 1
    antithetic: bool = False
    training: bool = False
    generator: torch.Generator | None = None
    q_landmarks: Tensor | None = None
    k_landmarks: Tensor | None = None

    def __post_init__(self):
        check_int("lara", "num_landmarks", self.num_landmarks, minimum=1)
        check_choice("lara", "mis", self.mis, ("opt", "bh"))
        check_float("lara", "alpha_coeff", self.alpha_coeff, minimum=0.0)
        check_choice("lara", "noise", self.noise, ("paper", "reference"))
        check_int("lara", "num_samples", self.num_samples, minimum=1)
        check_bool("lara", "antithetic", self.antithetic)
        check_bool("lara", "training", self.training)
        _check_generator("lara", self.generator)
        given = [t is not None for t in (self.q_landmarks, self.k_landmarks)]
        if any(given) and not all(given):
            raise ValueError("lara: pass both q_landmarks and k_landmarks, or neither")
        for name in ("q_landmarks", "k_landmarks"):
            t = getattr(self, name)
            if t is not None and (not isinstance(t, Tensor) or t.ndim != 4 or not t.is_floating_point()):
                raise ValueError(
                    f"lara: {name} must be a floating (B, H, C, D) tensor, got "
                    f"{getattr(t, 'shape', type(t).__name__)}"
                )


@register_method(
    "lara",
    options=LaraOptions,
    summary="linear randomized attention: multiple importance sampling with landmark proposals "
    "(Zheng et al. 2022); landmark networks are optional (MultiheadAttention proposal=...)",
    causal=False,
    cross_attention=True,
    complexity="linear",
    stochastic=True,
)
def lara_attention(
    q, k, v, key_padding_mask, causal, scale, *, num_landmarks, mis, alpha_coeff, noise, num_samples,
    antithetic, training, generator, q_landmarks, k_landmarks,
):
    """Linear randomized attention.

    Shapes: q ``(B, H, N, D)``, k ``(B, H, M, D)``, v ``(B, H, M, Dv)`` -> ``(B, H, N, Dv)``.

    Proposals ``N(mu_c, I)`` with ``mu_c = sqrt(s) (q~_c + k~_c)``; the landmarks are given, or
    masked means over C = min(num_landmarks, N, M) contiguous segments (uneven when the length
    is not a multiple of C; see :func:`subquad.ops.nystrom.segment_means`). In training mode,
    samples from :func:`lara_samples`; in eval mode (``training=False``, the default of the op)
    ``w_c = mu_c``, deterministic. The output is ``weights @ values`` of :func:`lara_weights`
    (log weights throughout; the softmax over samples and the product run as one
    ``scaled_dot_product_attention`` call with the samples as keys). Padded keys are masked;
    in self-attention (N == M) the mask also marks padded queries, which are left out of the
    query landmarks and of the softmax over queries in ``r'``, so nothing at a padded position
    changes an output at a real one. Cost O(K (N + M) D) time and O(K (N + M)) memory per head
    for K samples. Math in float32 (float64 stays float64) under autocast; the result has the
    dtype of q.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    dtype = compute_dtype(q.dtype)
    B, H, N, D = q.shape
    M = k.shape[2]
    with compute_precision(q):
        qc, kc, vc = q.to(dtype), k.to(dtype), v.to(dtype)
        query_pad = key_padding_mask if (key_padding_mask is not None and N == M) else None
        if q_landmarks is None:
            c = min(num_landmarks, N, M)
            q_land, _ = segment_means(qc, c, None if query_pad is None else ~query_pad)
            k_land, _ = segment_means(kc, c, None if key_padding_mask is None else ~key_padding_mask)
        else:
            for name, t in (("q_landmarks", q_landmarks), ("k_landmarks", k_landmarks)):
                if t.shape[:2] != (B, H) or t.shape[3] != D or t.shape != q_landmarks.shape:
                    raise ValueError(
                        f"lara: {name} must have shape (B, H, C, D) = ({B}, {H}, C, {D}) and match the "
                        f"other landmarks, got {tuple(t.shape)} and {tuple(q_landmarks.shape)}"
                    )
            q_land = q_landmarks.to(device=q.device, dtype=dtype)
            k_land = k_landmarks.to(device=q.device, dtype=dtype)
        root = math.sqrt(scale)
        mu = (q_land + k_land) * root
        if training:
            omega = lara_samples(
                mu, num_samples=num_samples, antithetic=antithetic, noise=noise, scale=scale,
                generator=generator,
            )
        else:
            omega = mu
        w_scaled, values, bias = _lara_terms(
            qc, kc, vc, mu, omega, q_land, scale, key_padding_mask, query_pad, mis, alpha_coeff
        )
        # softmax over samples of (q_n . w_scaled_j + bias_nj), times f(w_j): one fused call
        out = F.scaled_dot_product_attention(qc, w_scaled, values, attn_mask=bias, scale=1.0)
        if key_padding_mask is not None:
            out = out.masked_fill(no_key_rows(key_padding_mask, N, False), 0.0)
    return out.to(q.dtype)


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
