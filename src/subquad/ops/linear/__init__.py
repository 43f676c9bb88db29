"""Linear attention (Katharopoulos et al. 2020) and the kernel-attention core it shares with
Performer: ``out_n = phi(q_n) . sum_m phi(k_m) v_m^T / phi(q_n) . sum_m phi(k_m)``.

Causal attention is computed in chunks: quadratic inside a chunk of ``chunk_size`` tokens,
and a running state ``sum phi(k) v^T`` of shape ``(F, Dv)`` per chunk between chunks, so memory
grows like ``N/chunk_size * F * Dv`` and never like ``N * F * Dv``.

Context parallel (:func:`subquad.distributed.attention`), the scheme of LASP-2 (Sun et al. 2025,
"LASP-2: Rethinking Sequence Parallelism for Linear Attention and Its Hybrid", arXiv 2502.07563):
each rank sums ``phi(k)^T [v, 1]`` over its own keys, one all-gather exchanges these ``(F, Dv + 1)``
states, and a rank's queries add the states of every rank (non-causal) or of the ranks before it
to their own chunked form (causal). What is sent does not depend on N.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ...checks import check_int
from ...registry import register_method
from .._masks import compute_dtype, compute_precision, drop_padded
from .._sharded import Shards

__all__ = ["linear_attention", "kernel_attention", "elu_feature_map", "LinearOptions", "flops"]


def kernel_attention(
    phi_q: Tensor,
    phi_k: Tensor,
    v: Tensor,
    key_padding_mask: Tensor | None,
    causal: bool,
    chunk_size: int,
    shards: Shards | None = None,
) -> Tensor:
    """Normalised attention with non-negative features.

    phi_q ``(B, H, N, F)``, phi_k ``(B, H, M, F)``, v ``(B, H, M, Dv)`` -> ``(B, H, N, Dv)``.
    Padded keys are removed from numerator and normaliser alike (their features and values
    dropped, so NaN or inf there reaches no output). A query whose normaliser is 0 (it sees no
    real key) outputs 0. With ``shards``, the inputs are this rank's shard of a sequence split
    over a process group (causal: ``N = M`` on each rank) and every rank's keys count.
    """
    phi_k, v = drop_padded(phi_k, key_padding_mask), drop_padded(v, key_padding_mask)
    if shards is not None:
        shards.need_contiguous(causal, "kernel attention (linear, performer, hedgehog)")  # LASP-2's work is even
        v1 = F.pad(v, (0, 1), value=1.0)
        states = shards.gather(phi_k.transpose(-2, -1) @ v1)  # (ranks, B, H, F, Dv + 1)
        if causal:  # every rank adds its prefix, also rank 0 (an empty sum): each runs the gather's backward
            out = _causal_chunked(phi_q, phi_k, v1, chunk_size) + phi_q @ states[: shards.rank].sum(0)
        else:
            out = phi_q @ states.sum(0)
        return out[..., :-1] / _safe_den(out[..., -1:])
    if causal:
        # one chunked pass gives numerator and normaliser: v gets a column of ones
        out = _causal_chunked(phi_q, phi_k, F.pad(v, (0, 1), value=1.0), chunk_size)
        return out[..., :-1] / _safe_den(out[..., -1:])
    num = phi_q @ (phi_k.transpose(-2, -1) @ v)
    # (1, F) @ (F, N) rather than (N, F) @ (F, 1): several times faster on CPU
    den = (phi_k.sum(-2, keepdim=True) @ phi_q.transpose(-2, -1)).transpose(-2, -1)
    return num.div_(_safe_den(den))  # in place: num is not saved for backward


def _safe_den(den: Tensor) -> Tensor:
    """The normaliser with exact zeros (a query that sees no real key, whose numerator is 0
    too) replaced by 1, so that the output and its gradient are 0 there, never NaN."""
    return torch.where(den > 0, den, torch.ones_like(den))


def _causal_chunked(phi_q: Tensor, phi_k: Tensor, v1: Tensor, chunk: int) -> Tensor:
    B, H, N, Fd = phi_q.shape
    Dv = v1.shape[-1]
    chunk = min(chunk, N)
    n_chunks = -(-N // chunk)
    pad = n_chunks * chunk - N
    if pad:  # zero features: padded keys add nothing, padded queries are cut off below
        phi_q = F.pad(phi_q, (0, 0, 0, pad))
        phi_k = F.pad(phi_k, (0, 0, 0, pad))
        v1 = F.pad(v1, (0, 0, 0, pad))
    qc = phi_q.reshape(B, H, n_chunks, chunk, Fd)
    kc = phi_k.reshape(B, H, n_chunks, chunk, Fd)
    vc = v1.reshape(B, H, n_chunks, chunk, Dv)
    # inside each chunk: the masked quadratic form
    scores = qc @ kc.transpose(-2, -1)
    keep = torch.ones(chunk, chunk, dtype=torch.bool, device=phi_q.device).tril()
    intra = scores.masked_fill(~keep, 0.0) @ vc
    # between chunks: state before chunk c = sum of phi_k^T v1 over chunks < c (exclusive scan)
    kv = kc.transpose(-2, -1) @ vc  # (B, H, C, F, Dv)
    state = torch.cumsum(kv, dim=2)
    state = F.pad(state[:, :, :-1], (0, 0, 0, 0, 1, 0))
    inter = qc @ state
    out = (intra + inter).reshape(B, H, n_chunks * chunk, Dv)
    return out[:, :, :N]


def elu_feature_map(x: Tensor) -> Tensor:
    """``elu(x) + 1``: positive, and linear for x > 0. The 1 is added in place: a fresh output
    of the size of x costs page faults comparable to the elu itself (elu's backward reads its
    input, not its output, so autograd allows it)."""
    return F.elu(x).add_(1.0)


@dataclass
class LinearOptions:
    """``chunk_size``: tokens per chunk of the causal computation."""

    chunk_size: int = 64

    def __post_init__(self):
        check_int("linear", "chunk_size", self.chunk_size, minimum=1)


def flops(B, H, N, M, D, Dv, o):
    """Matmul FLOPs of one non-causal forward (:mod:`subquad.compare.flops`): phi(k)^T v,
    phi(q) (phi(k)^T v), and the normaliser phi(q) . sum phi(k)."""
    return 2 * B * H * (M * D * Dv + N * D * Dv + N * D)


def _features(q: Tensor, k: Tensor, scale: float | None) -> tuple[Tensor, Tensor]:
    """``elu(x) + 1`` of q and k in the op's compute dtype."""
    dtype = compute_dtype(q.dtype)
    return elu_feature_map(q.to(dtype)), elu_feature_map(k.to(dtype))


def _kernel_features(o: LinearOptions):
    """The entry's ``kernel_features``: the same ``elu(x) + 1`` for every option."""
    return _features


def _context_parallel(q, k, v, key_padding_mask, causal, scale, options: LinearOptions, shards: Shards) -> Tensor:
    """The entry's ``context_parallel``: the op on this rank's shard (see the module docstring)."""
    return _linear(q, k, v, key_padding_mask, causal, scale, options.chunk_size, shards)


@register_method("linear", options=LinearOptions, summary="elu(x)+1 linear attention (Katharopoulos et al. 2020)",
                 causal=True, cross_attention=True, complexity="linear", flops=flops,
                 # small chunks, so causal tests cross several chunk boundaries
                 test_options={"chunk_size": 4}, logit_scale=False, query_local=True,
                 kernel_features=_kernel_features, context_parallel=_context_parallel)
def linear_attention(q, k, v, key_padding_mask, causal, scale, *, chunk_size):
    """Linear attention with the ``elu(x) + 1`` feature map.

    Shapes: q ``(B, H, N, D)``, k ``(B, H, M, D)``, v ``(B, H, M, Dv)`` -> ``(B, H, N, Dv)``.
    The method has no logit scale: ``scale`` must be None. Runs in float32 (float64 stays
    float64) even under autocast; returns the dtype of q.
    """
    return _linear(q, k, v, key_padding_mask, causal, scale, chunk_size)


def _linear(q, k, v, key_padding_mask, causal, scale, chunk_size, shards=None):
    if scale is not None:
        raise ValueError("linear: this method has no logit scale; pass scale=None")
    dtype = compute_dtype(q.dtype)
    with compute_precision(q):
        out = kernel_attention(
            elu_feature_map(q.to(dtype)),
            elu_feature_map(k.to(dtype)),
            v.to(dtype),
            key_padding_mask,
            causal,
            chunk_size,
            shards,
        )
    return out.to(q.dtype)

