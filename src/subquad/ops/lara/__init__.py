"""Linear Randomized Attention (LARA), Zheng et al. 2022: C Gaussian proposals ``N(mu_c, I)``
shared by all queries, ``mu_c = q~'_c + k~'_c`` (query and key landmarks), one sample per
proposal, and a self-normalised multiple-importance-sampling estimate of softmax attention;
``f`` is evaluated once per sample, so only an (N, C) weight matrix depends on the queries and
the cost is linear in N and M.

Notation and the noise scale (option ``noise``) are RA's, see :mod:`subquad.ops.ra`. LARA uses
``"reference"`` noise in training mode (the regime it is trained in; at one sample per proposal
the paper noise makes its error as large as Performer's, see ``benchmarks/results/fidelity.md``).
Its eval mode draws no noise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ...checks import check_bool, check_choice, check_float, check_int
from ...registry import register_method
from .._common import SMALL_WORK, check_generator, one_thread, randn
from .._masks import compute_dtype, compute_precision, drop_padded, masked_fill_value, no_key_rows
from ..nystrom import segment_means
from ..ra import noise_std

__all__ = ["LaraOptions", "flops", "lara_attention", "lara_samples", "lara_weights"]

# alpha is clamped here before its log (the mis="opt" weights can go negative)
_ALPHA_MIN = 1e-8


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
    eps = randn((B, H, num_samples, C, D), generator, mu) * noise_std(noise, scale)
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
    if mis not in ("bh", "opt"):
        raise ValueError(f"mis must be 'opt' or 'bh', got {mis!r}")
    # proposals: log g_c'(w_j) up to a term in |w_j|^2 only; (K, C) matrices, on one thread
    # on CPU (see one_thread: busy cores make each split of a tiny kernel wait a time slice)
    with one_thread(omega.device.type == "cpu" and B * H * K * C <= SMALL_WORK):
        log_g = omega @ mu.transpose(-2, -1) - 0.5 * mu.square().sum(-1).unsqueeze(-2)  # (B, H, K, C)
        log_mix = torch.logsumexp(log_g, dim=-1)  # (B, H, K)
        log_own = log_g.view(B, H, reps, C, C).diagonal(dim1=-2, dim2=-1).reshape(B, H, K)
        bh = torch.exp(log_own - log_mix)  # balance heuristic
        column = log_z - log_own
    if mis == "bh":
        return w_scaled, values, (log_z - log_mix).unsqueeze(-2)
    if not alpha_coeff:
        return w_scaled, values, (bh.clamp_min(_ALPHA_MIN).log() + column).unsqueeze(-2)
    r_logits = q @ (q_landmarks * scale).transpose(-2, -1)  # (B, H, N, C)
    if query_padding_mask is not None:
        r_logits = r_logits.masked_fill(query_padding_mask[:, None, :, None], neg)
    r = torch.softmax(r_logits, dim=-2)  # r'_nc: softmax over queries
    # alpha = bh + lambda (r' - mean_c r'), clamped, then its log; tiled over the sample blocks
    mean = r.mean(-1, keepdim=True).mul_(alpha_coeff)
    # in place when autograd does not keep r (softmax's backward reads it): no fresh (N, C) tensor
    alpha = (r.mul(alpha_coeff) if r.requires_grad else r.mul_(alpha_coeff)).sub_(mean)
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
        check_generator("lara", self.generator)
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


def flops(B, H, N, M, D, Dv, o):
    """Matmul FLOPs of one forward (:mod:`subquad.compare.flops`)."""
    if o.get("q_landmarks") is not None:
        c = o["q_landmarks"].shape[2]
    else:
        c = min(o["num_landmarks"], N, M)
    k = c * o["num_samples"] * (2 if o["antithetic"] else 1) if o["training"] else c
    per_head = (
        2 * k * M * D  # log xi(k', w) for every sample and key
        + 2 * k * M * Dv  # f(w) = softmax over keys times v
        + 2 * k * c * D  # proposal densities
        + 2 * N * k * D  # log xi(q', w)
        + 2 * N * k * Dv  # weights @ values
    )
    if o["mis"] == "opt" and o["alpha_coeff"]:
        per_head += 2 * N * c * D  # r' = softmax over queries of q . q~
    return B * H * per_head


@register_method("lara", options=LaraOptions,
                 summary="linear randomized attention: multiple importance sampling with landmark proposals "
                 "(Zheng et al. 2022); landmark networks are optional (MultiheadAttention proposal=...)",
                 causal=False, cross_attention=True, complexity="linear", stochastic=True,
                 core="subquad.layers.lara:LaraCore", flops=flops,
                 # LARA samples only in training mode (in eval it uses omega = mu, deterministic by design)
                 sampling_options={"training": True})
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
        # padded keys and values dropped once (a NaN there times its weight 0 is NaN)
        kc, vc = drop_padded(kc, key_padding_mask), drop_padded(vc, key_padding_mask)
        query_pad = key_padding_mask if (key_padding_mask is not None and N == M) else None
        if q_landmarks is None:
            c = min(num_landmarks, N, M)
            q_land, _ = segment_means(qc, c, None if query_pad is None else ~query_pad)
            k_land, _ = segment_means(kc, c, None if key_padding_mask is None else ~key_padding_mask, zeroed=True)
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

