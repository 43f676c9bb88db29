"""Nyström attention (Xiong et al. 2021): softmax attention approximated through m landmarks,
``softmax(Q K~^T) A^+ softmax(Q~ K^T) V`` with ``A = softmax(Q~ K~^T)`` and ``A^+`` from the
iterative Moore-Penrose scheme of Razavi et al. (6 steps by default).

The two N x m softmax products are computed by ``scaled_dot_product_attention`` (queries against
landmarks, landmarks against keys), so no N x m weight matrix is materialised on backends
with fused kernels, and the work is O(N m D + m^3).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ...checks import check_choice, check_int
from ...registry import register_method
from .._common import SMALL_WORK, one_thread
from .._masks import compute_dtype, compute_precision, drop_padded, no_key_rows, padding_bias
from ..softmax import flops as softmax_flops
from ..softmax import sdpa

__all__ = ["NystromOptions", "flops", "iterative_pinv", "nystrom_attention", "segment_lengths", "segment_means"]


def segment_lengths(n: int, m: int) -> list[int]:
    """Lengths of the m contiguous segments of n positions: the first ``m - n % m`` have
    ``n // m`` positions and the last ``n % m`` have one more (no padding)."""
    s, r = n // m, n % m  # not divmod: dynamo cannot trace it on symbolic sizes
    return [s] * (m - r) + [s + 1] * r


def _segment_sum(x: Tensor, m: int) -> Tensor:
    """Sum over the segments of :func:`segment_lengths` along dim -2: ``(..., n, d) -> (..., m, d)``."""
    n = x.shape[-2]
    s, r = n // m, n % m  # not divmod: dynamo cannot trace it on symbolic sizes
    split = (m - r) * s
    head = x[..., :split, :].unflatten(-2, (m - r, s)).sum(-2)
    if r == 0:
        return head
    tail = x[..., split:, :].unflatten(-2, (r, s + 1)).sum(-2)
    return torch.cat([head, tail], dim=-2)


def segment_means(x: Tensor, m: int, keep: Tensor | None = None, *,
                  zeroed: bool = False) -> tuple[Tensor, Tensor | None]:
    """Landmarks: means of x ``(B, H, n, d)`` over m contiguous segments -> ``(B, H, m, d)``.

    With ``keep`` (bool ``(B, n)``, True = real token) the means are masked means over real
    tokens (what the others hold, NaN and inf included, is dropped by a ``torch.where``; with
    ``zeroed=True`` the caller has made it 0 already, and the pass is skipped); the second result
    is then a bool ``(B, m)`` marking empty segments (no real token; their landmark is 0), else
    None.
    """
    n = x.shape[-2]
    if keep is None:
        lengths = torch.tensor(segment_lengths(n, m), dtype=x.dtype, device=x.device)
        return _segment_sum(x, m) / lengths[:, None], None
    w = keep.to(x.dtype)[:, None, :, None]
    sums = _segment_sum(x if zeroed else drop_padded(x, ~keep), m)
    counts = _segment_sum(w, m)  # (B, 1, m, 1)
    means = sums / counts.clamp_min(1.0)
    return means, (counts == 0)[:, 0, :, 0]


def iterative_pinv(a: Tensor, iterations: int = 6, init: str = "per_matrix") -> Tensor:
    """Approximate Moore-Penrose inverse of the row-stochastic ``a`` ``(..., m, m)``:
    ``Z <- Z (13 I - A Z (15 I - A Z (7 I - A Z))) / 4`` from ``Z_0 = A^T / (|A|_1 |A|_inf)``.

    ``init="per_matrix"``: the norms of each matrix (recommended); ``"global"``: the max over
    the whole batch, as the original Nyströmformer code (to reproduce its checkpoints).
    Truncated after ``iterations`` steps it inverts the large singular values only, which is
    what the method needs (an exact pinv of this ill-conditioned matrix is far worse).
    """
    absa = a.abs()
    col = absa.sum(-2).amax(-1)  # max column sum, (...)
    row = absa.sum(-1).amax(-1)  # max row sum (1 for a softmax)
    if init == "per_matrix":
        c = (col * row)[..., None, None]
    elif init == "global":
        c = col.amax() * row.amax()
    else:
        raise ValueError(f"init must be 'per_matrix' or 'global', got {init!r}")
    z = a.transpose(-2, -1) / c
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    # small matrices, many products: on one thread (see one_thread: with busy cores a split
    # product waits at its barrier for a descheduled thread)
    with one_thread(a.device.type == "cpu" and a.numel() <= SMALL_WORK):
        for _ in range(iterations):
            az = a @ z
            z = 0.25 * z @ (13 * eye - az @ (15 * eye - az @ (7 * eye - az)))
    return z


@dataclass
class NystromOptions:
    """num_landmarks: number m of segment-mean landmarks (exact attention when m >= N or M).
    pinv_iterations: steps of the iterative pseudo-inverse (a model hyperparameter: changing
    it after training changes the model).
    pinv_init: ``"per_matrix"`` (default) or ``"global"`` (the original code's).
    """

    num_landmarks: int = 64
    pinv_iterations: int = 6
    pinv_init: str = "per_matrix"

    def __post_init__(self):
        check_int("nystrom", "num_landmarks", self.num_landmarks, minimum=1)
        check_int("nystrom", "pinv_iterations", self.pinv_iterations, minimum=0)
        check_choice("nystrom", "pinv_init", self.pinv_init, ("per_matrix", "global"))


def flops(B, H, N, M, D, Dv, o):
    """Matmul FLOPs of one forward (:mod:`subquad.compare.flops`)."""
    m = o["num_landmarks"]
    if m >= min(N, M):  # the op runs exact attention there
        return softmax_flops(B, H, N, M, D, Dv, o)
    kernel_a = 2 * m * m * D
    pinv = o["pinv_iterations"] * 4 * 2 * m**3  # four m x m x m products per step
    landmarks_to_keys = 2 * m * M * (D + Dv)  # softmax(q~ k^T) v as one fused call
    z_times = 2 * m * m * Dv
    queries_to_landmarks = 2 * N * m * (D + Dv)
    return B * H * (kernel_a + pinv + landmarks_to_keys + z_times + queries_to_landmarks)


@register_method("nystrom", options=NystromOptions,
                 summary="Nyström landmarks with iterative pseudo-inverse (Xiong et al. 2021)",
                 causal=False, cross_attention=True, complexity="linear",
                 core="subquad.layers.nystrom:NystromCore", flops=flops,
                 peer="subquad.compare.peers:NYSTROM_ATTENTION",
                 # few landmarks, so the Nystrom path (not the exact fallback for m >= N) runs at N >= 5
                 test_options={"num_landmarks": 4})
def nystrom_attention(q, k, v, key_padding_mask, causal, scale, *, num_landmarks, pinv_iterations, pinv_init):
    """Nyström attention.

    Shapes: q ``(B, H, N, D)``, k ``(B, H, M, D)``, v ``(B, H, M, Dv)`` -> ``(B, H, N, Dv)``.

    Landmarks are means over ``num_landmarks`` contiguous segments, uneven when the length is
    not a multiple of m (no padding). With a key padding mask the key landmarks are masked means
    over real keys, padded keys are masked in ``softmax(Q~ K^T)``, and landmarks whose segment
    has no real key are removed from all three kernels. In self-attention (N == M) the mask
    also marks padded queries, so the query landmarks are masked means too; then nothing at a
    padded position can change an output at a real one. When m >= min(N, M), exact attention
    is cheaper and is what runs. Math in float32 (float64 stays float64) under autocast; the
    result has the dtype of q. Not causal: segment means mix future tokens into every landmark.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    n, m_keys = q.shape[2], k.shape[2]
    m = num_landmarks
    dtype = compute_dtype(q.dtype)
    with compute_precision(q):
        qc, kc, vc = q.to(dtype), k.to(dtype), v.to(dtype)
        if m >= min(n, m_keys):  # exact attention is the cheaper path here
            return sdpa(qc, kc, vc, key_padding_mask, False, scale).to(q.dtype)
        # padded keys and values dropped once (NaN * weight 0 is NaN): for the landmarks and the SDPA below
        kc, vc = drop_padded(kc, key_padding_mask), drop_padded(vc, key_padding_mask)
        keep_k = None if key_padding_mask is None else ~key_padding_mask
        keep_q = keep_k if n == m_keys else None
        q_land, empty_q = segment_means(qc, m, keep_q)
        k_land, empty_k = segment_means(kc, m, keep_k, zeroed=True)
        # A = softmax(q~ k~^T) over the real key landmarks; empty landmarks become identity
        # rows/columns, so the pinv inverts the block of real landmarks and leaves them out
        a_logits = (q_land * scale) @ k_land.transpose(-2, -1)
        if empty_k is not None:
            a_logits = a_logits + padding_bias(empty_k, dtype)
        a = torch.softmax(a_logits, dim=-1)
        if empty_k is not None:
            void = empty_k[:, None, None, :]
            if empty_q is not None:
                void = void | empty_q[:, None, :, None]
            a = torch.where(void, torch.eye(m, dtype=dtype, device=q.device), a)
        z = iterative_pinv(a, pinv_iterations, pinv_init)
        key_bias = padding_bias(key_padding_mask, dtype)
        bv = F.scaled_dot_product_attention(q_land, kc, vc, attn_mask=key_bias, scale=scale)
        out = F.scaled_dot_product_attention(
            qc, k_land, z @ bv, attn_mask=padding_bias(empty_k, dtype), scale=scale
        )
        if key_padding_mask is not None:
            out = out.masked_fill(no_key_rows(key_padding_mask, n, False), 0.0)
    return out.to(q.dtype)

