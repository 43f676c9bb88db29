"""Performer / FAVOR+ (Choromanski et al. 2021): softmax attention approximated with positive
random features, ``exp(q.k) = E_w[phi_w(q) phi_w(k)]`` with
``phi_w(x) = m^{-1/2} exp(w.x - |x|^2 / 2)`` and ``w ~ N(0, I)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..registry import register_method
from ._masks import compute_dtype, compute_precision, masked_fill_value
from ._options import check_bool, check_float, check_int
from .linear import kernel_attention

__all__ = [
    "performer_attention",
    "random_projection",
    "performer_features",
    "performer_attention_reference",
]


def random_projection(
    num_features: int,
    dim: int,
    *,
    orthogonal: bool = True,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> Tensor:
    """A ``(num_features, dim)`` matrix of Gaussian directions.

    ``orthogonal=True``: rows are exactly orthogonal within each block of ``dim`` rows (Q of the
    QR decomposition of a Gaussian matrix, sign-corrected so it is Haar-distributed), and each
    row is rescaled to the norm of an independent N(0, I_dim) draw (chi_dim), so every row is
    still marginally N(0, I). ``orthogonal=False``: i.i.d. N(0, 1) entries.
    The draw happens on the generator's device (CPU by default), then moves to ``device``.
    """
    gen_device = generator.device if generator is not None else torch.device("cpu")
    draw_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    if not orthogonal:
        w = torch.randn(num_features, dim, generator=generator, dtype=draw_dtype, device=gen_device)
    else:
        n_blocks = -(-num_features // dim)
        g = torch.randn(n_blocks, dim, dim, generator=generator, dtype=draw_dtype, device=gen_device)
        qm, r = torch.linalg.qr(g)
        qm = qm * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)
        blocks = qm.transpose(-2, -1)  # rows of each block are orthonormal
        w = blocks.reshape(n_blocks * dim, dim)[:num_features]
        norms = torch.randn(num_features, dim, generator=generator, dtype=draw_dtype, device=gen_device)
        w = w * norms.norm(dim=-1, keepdim=True)
    return w.to(device=device if device is not None else gen_device, dtype=dtype)


def performer_features(
    x: Tensor,
    projection: Tensor,
    *,
    kind: str,
    key_padding_mask: Tensor | None = None,
    causal: bool = False,
    eps: float = 0.0,
) -> Tensor:
    """Positive random features of ``x`` ``(B, H, L, D)`` (already scaled to paper units,
    ``x * sqrt(scale)``) for ``projection`` ``(m, D)``; returns ``(B, H, L, m)``.

    ``kind="raw"``: the unbiased ``m^{-1/2} exp(w.x - |x|^2/2)``.
    ``kind="query"``: ``exp(w.x - |x|^2/2 - c_n) + eps`` with ``c_n`` the max over features of
    query n (a per-row factor that cancels in the normalised output).
    ``kind="key"``: the same with one constant per (batch, head) that cancels too: the max over
    real keys and features, or, when ``causal``, the data-independent bound ``max_i |w_i|^2/2``
    (``w.x - |x|^2/2 <= |w|^2/2``), so that no future key can change a past output.
    The stabilisers are detached. The ``m^{-1/2}`` factor is left out of the stabilised kinds,
    where it cancels.
    """
    logits = torch.baddbmm(
        (x * x).sum(-1, keepdim=True).flatten(0, 1).mul(-0.5),
        x.flatten(0, 1),
        projection.transpose(0, 1).expand(x.shape[0] * x.shape[1], -1, -1),
    ).unflatten(0, x.shape[:2])
    if kind == "raw":
        return torch.exp(logits) * projection.shape[0] ** -0.5
    if kind == "query":
        stab = logits.detach().amax(-1, keepdim=True)
    elif kind == "key":
        if causal:
            stab = (projection.detach() ** 2).sum(-1).amax() / 2
        elif key_padding_mask is None:
            stab = logits.detach().amax((-2, -1), keepdim=True)
        else:
            masked = logits.detach().masked_fill(
                key_padding_mask[:, None, :, None], masked_fill_value(logits.dtype)
            )
            stab = masked.amax((-2, -1), keepdim=True)
    else:
        raise ValueError(f"kind must be 'raw', 'query' or 'key', got {kind!r}")
    feats = torch.exp(logits - stab)
    return feats + eps if eps else feats


@dataclass
class PerformerOptions:
    """Options of :func:`performer_attention`.

    num_features: number m of random features.
    orthogonal: orthogonal random features (True) or i.i.d. Gaussian rows.
    features: a user-supplied ``(m, D)`` projection; when given it is used as is and
        ``num_features``, ``orthogonal`` and ``generator`` are not used.
    generator: source of the random projection drawn when ``features`` is None.
    eps: numerical stabiliser added to every feature (1e-6 as in the JAX reference).
    chunk_size: tokens per chunk of the causal computation.
    """

    num_features: int = 256
    orthogonal: bool = True
    features: Tensor | None = None
    generator: torch.Generator | None = None
    eps: float = 1e-6
    chunk_size: int = 64

    def __post_init__(self):
        check_int("performer", "num_features", self.num_features, minimum=1)
        check_bool("performer", "orthogonal", self.orthogonal)
        check_float("performer", "eps", self.eps, minimum=0.0)
        check_int("performer", "chunk_size", self.chunk_size, minimum=1)
        if self.features is not None:
            f = self.features
            if not isinstance(f, Tensor) or f.ndim != 2 or not f.is_floating_point():
                raise ValueError(
                    "performer: features must be a floating (m, D) tensor, got "
                    f"{getattr(f, 'shape', type(f).__name__)}"
                )
        if self.generator is not None and not isinstance(self.generator, torch.Generator):
            raise TypeError(
                f"performer: generator must be a torch.Generator, got {type(self.generator).__name__}"
            )


@register_method(
    "performer",
    options=PerformerOptions,
    summary="FAVOR+ positive orthogonal random features (Choromanski et al. 2021)",
    causal=True,
    cross_attention=True,
    complexity="linear",
    stochastic=True,
)
def performer_attention(
    q, k, v, key_padding_mask, causal, scale, *, num_features, orthogonal, features, generator, eps,
    chunk_size,
):
    """FAVOR+ attention.

    Shapes: q ``(B, H, N, D)``, k ``(B, H, M, D)``, v ``(B, H, M, Dv)`` -> ``(B, H, N, Dv)``.
    One projection is shared by all batches and heads. Padded keys are removed from the
    numerator and the normaliser (performer-pytorch only zeroes their values). Causal attention
    uses chunked prefix sums. Feature math in float32 (float64 stays float64) even under
    autocast; the result has the dtype of q.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    dtype = compute_dtype(q.dtype)
    D = q.shape[-1]
    if features is None:
        features = random_projection(
            num_features, D, orthogonal=orthogonal, generator=generator, dtype=dtype, device=q.device
        )
    elif features.shape[1] != D:
        raise ValueError(f"performer: features must have shape (m, {D}), got {tuple(features.shape)}")
    with compute_precision(q):
        w = features.to(device=q.device, dtype=dtype)
        root = math.sqrt(scale)
        phi_q = performer_features(q.to(dtype) * root, w, kind="query", eps=eps)
        phi_k = performer_features(
            k.to(dtype) * root, w, kind="key", key_padding_mask=key_padding_mask, causal=causal, eps=eps
        )
        out = kernel_attention(phi_q, phi_k, v.to(dtype), key_padding_mask, causal, chunk_size)
    return out.to(q.dtype)


def performer_attention_reference(q, k, v, features, key_padding_mask=None, causal=False, scale=None):
    """Slow, obvious reference: unstabilised features and the explicit ``(N, M)`` matrix."""
    from .linear import kernel_attention_reference

    scale = q.shape[-1] ** -0.5 if scale is None else scale
    root = math.sqrt(scale)
    phi_q = performer_features(q * root, features, kind="raw")
    phi_k = performer_features(k * root, features, kind="raw")
    return kernel_attention_reference(phi_q, phi_k, v, key_padding_mask, causal)
