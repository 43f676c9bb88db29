"""Performer / FAVOR+ (Choromanski et al. 2021): softmax attention approximated with positive
random features, ``exp(q.k) = E_w[phi_w(q) phi_w(k)]`` with
``phi_w(x) = m^{-1/2} exp(w.x - |x|^2 / 2)`` and ``w ~ N(0, I)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..registry import register_method
from ._masks import compute_dtype, compute_precision, masked_fill_value, no_key_rows
from ._options import check_bool, check_float, check_int
from .linear import _safe_den, kernel_attention

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


# rows per block of the streamed path are chosen so a (B, H, rows, m) block has this many
# elements (2 MiB in float32): it stays in cache between the matmul, exp and matmul
_BLOCK_ELEMENTS = 1 << 19


class _ShiftedExp(torch.autograd.Function):
    """``exp(logits - shift) + eps`` computed in place over the (B, H, L, m) logits: the
    feature maps are the largest tensors of the method, and each extra pass over them costs
    as much as a matmul. ``shift`` is a detached stabiliser (no gradient)."""

    @staticmethod
    def forward(ctx, logits, shift, eps):
        out = logits.sub_(shift).exp_()
        if eps:
            out.add_(eps)
        ctx.mark_dirty(logits)
        ctx.save_for_backward(out)
        ctx.eps = eps
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        return grad * (out - ctx.eps if ctx.eps else out), None, None


def performer_features(
    x: Tensor,
    projection: Tensor,
    *,
    kind: str,
    scale: float = 1.0,
    key_padding_mask: Tensor | None = None,
    causal: bool = False,
    eps: float = 0.0,
) -> Tensor:
    """Positive random features of ``x`` ``(B, H, L, D)`` for ``projection`` ``(m, D)``,
    with ``x`` taken in paper units ``x' = sqrt(scale) x``; returns ``(B, H, L, m)``.

    ``kind="raw"``: the unbiased ``m^{-1/2} exp(w.x' - |x'|^2/2)``.
    ``kind="query"``: the raw features times a per-row constant, which cancels in the normalised
    output: ``softmax_i(w_i.x')`` (the ``|x'|^2/2`` term is per-row too). Its largest entry is
    at least ``1/m``, so a query's features are never all zero and need no ``eps``.
    ``kind="key"``: ``exp(w.x' - |x'|^2/2 - c) + eps`` with one constant ``c`` per (batch, head)
    that cancels too: the max over real keys and features, or, when ``causal``, the
    data-independent bound ``max_i |w_i|^2/2`` (``w.x' - |x'|^2/2 <= |w|^2/2``), so that no
    future key can change a past output. Stabilisers are detached.
    """
    B, H, L, D = x.shape
    # w.x' as one matmul over all (B, H, L) rows
    logits = torch.mm(x.reshape(-1, D), projection.t() * math.sqrt(scale)).view(B, H, L, -1)
    if kind == "query":
        return torch.softmax(logits, dim=-1)
    half_sq = torch.linalg.vector_norm(x, dim=-1, keepdim=True).square().mul(0.5 * scale)
    logits = logits.sub_(half_sq)  # in place: the matmul does not need its output for backward
    if kind == "raw":
        return torch.exp(logits) * projection.shape[0] ** -0.5
    if kind == "key":
        if causal:
            shift = (projection.detach() ** 2).sum(-1).amax() / 2
        elif key_padding_mask is None:
            shift = logits.detach().amax((-2, -1), keepdim=True)
        else:
            masked = logits.detach().masked_fill(
                key_padding_mask[:, None, :, None], masked_fill_value(logits.dtype)
            )
            shift = masked.amax((-2, -1), keepdim=True)
    else:
        raise ValueError(f"kind must be 'raw', 'query' or 'key', got {kind!r}")
    return _ShiftedExp.apply(logits, shift, eps)


@dataclass
class PerformerOptions:
    """Options of :func:`performer_attention`.

    num_features: number m of random features.
    orthogonal: orthogonal random features (True) or i.i.d. Gaussian rows.
    features: a user-supplied ``(m, D)`` projection; when given it is used as is and
        ``num_features``, ``orthogonal`` and ``generator`` are not used.
    generator: source of the random projection drawn when ``features`` is None.
    eps: numerical stabiliser added to every key feature of the non-causal path (1e-6 as in
        the JAX reference, relative to the largest key feature). The causal path adds none: its
        key stabiliser is a data-independent bound far above the real logits, so an absolute
        eps would swamp the features (see ``performer_attention``). Query features need none.
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

    Causal key features are stabilised by ``max_i |w_i|^2 / 2``, which depends on no token, so
    no future key can change a past output, not even through rounding; ``eps`` is not used
    there. In float32 these features underflow only for keys whose scaled norm
    ``|k| * scale^(1/2)`` exceeds about 10, where the estimator's variance (which grows like
    ``exp(|q' + k'|^2)``) already makes FAVOR+ unusable.
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
        qc, kc, vc = q.to(dtype), k.to(dtype), v.to(dtype)
        if not causal:
            out = _bidirectional_streamed(qc, kc, vc, w, scale, key_padding_mask, eps)
        else:
            phi_q = performer_features(qc, w, kind="query", scale=scale)
            phi_k = performer_features(kc, w, kind="key", scale=scale, causal=True)
            out = kernel_attention(phi_q, phi_k, vc, key_padding_mask, True, chunk_size)
    return out.to(q.dtype)


def _bidirectional_streamed(q, k, v, w, scale, key_padding_mask, eps):
    """Non-causal FAVOR+ over blocks of the sequence, so that the (B, H, rows, m) feature blocks
    stay in cache instead of streaming whole (B, H, L, m) tensors through memory several times.

    Keys are accumulated into ``S = sum phi(k) v^T`` and ``z = sum phi(k)`` with an online
    maximum (the running sums are rescaled when a later block raises it), which equals the
    single global key stabiliser of the spec. The ``eps`` of the key features is added in
    closed form: ``eps * sum_real v`` to every row of S and ``eps * count_real`` to z.
    """
    B, H, M, D = k.shape
    m, Dv = w.shape[0], v.shape[-1]
    block = max(64, _BLOCK_ELEMENTS // (B * H * m))
    wt = w.t() * math.sqrt(scale)
    neg = masked_fill_value(k.dtype)
    kv = run = None  # kv: (B, H, m, Dv + 1), the last column is z = sum phi(k)
    # torch.split, not slicing in the loop: the backward of a slice writes a zero tensor of the
    # whole input, once per block (quadratic in N); split's backward is one concatenation
    for s, kb, vb in zip(range(0, M, block), k.split(block, dim=2), v.split(block, dim=2)):
        vb = F.pad(vb, (0, 1), value=1.0)
        logits = kb @ wt
        logits = logits.sub_(torch.linalg.vector_norm(kb, dim=-1, keepdim=True).square().mul(0.5 * scale))
        if key_padding_mask is not None:
            logits = logits.masked_fill_(key_padding_mask[:, None, s : s + block, None], neg)
        top = logits.detach().amax((-2, -1), keepdim=True)
        new = top if run is None else torch.maximum(run, top)
        kv_b = _ShiftedExp.apply(logits, new, 0.0).transpose(-2, -1) @ vb
        # a (batch, head) with no real key yet has run = neg: its sums are scaled to 0 here
        kv = kv_b if kv is None else kv * torch.exp(run - new) + kv_b
        run = new
    if eps:
        v1 = F.pad(v, (0, 1), value=1.0)
        if key_padding_mask is not None:
            v1 = v1.masked_fill(key_padding_mask[:, None, :, None], 0.0)
        kv = kv + eps * v1.sum(-2, keepdim=True)
    # blocks are joined with one cat: slice assignment into a preallocated output would make
    # autograd copy the whole output gradient once per block in backward
    outs = []
    for qb in q.split(block, dim=2):
        res = torch.softmax(qb @ wt, dim=-1) @ kv
        outs.append(res[..., :Dv] / _safe_den(res[..., Dv:]))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    if key_padding_mask is not None:
        out = out.masked_fill(no_key_rows(key_padding_mask, q.shape[2], False), 0.0)
    return out


def performer_attention_reference(q, k, v, features, key_padding_mask=None, causal=False, scale=None):
    """Slow, obvious reference: unstabilised features and the explicit ``(N, M)`` matrix."""
    from .linear import kernel_attention_reference

    scale = q.shape[-1] ** -0.5 if scale is None else scale
    phi_q = performer_features(q, features, kind="raw", scale=scale)
    phi_k = performer_features(k, features, kind="raw", scale=scale)
    return kernel_attention_reference(phi_q, phi_k, v, key_padding_mask, causal)
