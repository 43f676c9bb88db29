"""Floating-point work of each method's forward pass, and this machine's matmul rate.

A FLOP count here is the matrix-multiply work (2 FLOPs per multiply-add in every matmul, batched
matmul and fused attention kernel), the convention of ``torch.utils.flop_counter``: softmaxes,
exponentials and other elementwise work are left out. Each formula is written from its op's
code path (non-causal, no padding mask, self-attention shapes), and the tests check it against
:func:`counted_flops` for small shapes. A method without a formula is counted at run time.

Shapes: batch B, heads H, queries N, keys M, head dim D, value dim Dv.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from .timing import median_time

__all__ = ["FORMULAS", "forward_flops", "counted_flops", "matmul_rate"]


def _softmax(B, H, N, M, D, Dv, o):
    # scores q k^T and weights @ v
    return 2 * B * H * N * M * (D + Dv)


def _linear(B, H, N, M, D, Dv, o):
    # phi(k)^T v, phi(q) (phi(k)^T v), and the normaliser phi(q) . sum phi(k)
    return 2 * B * H * (M * D * Dv + N * D * Dv + N * D)


def _efficient(B, H, N, M, D, Dv, o):
    return 2 * B * H * (M * D * Dv + N * D * Dv)


def _performer(B, H, N, M, D, Dv, o):
    # projections w.x of queries and keys, then phi(k)^T [v, 1] and phi(q) (phi(k)^T [v, 1])
    m = o["num_features"] if o.get("features") is None else o["features"].shape[0]
    return 2 * B * H * (N + M) * m * (D + Dv + 1)


def _nystrom(B, H, N, M, D, Dv, o):
    m = o["num_landmarks"]
    if m >= min(N, M):  # the op runs exact attention there
        return _softmax(B, H, N, M, D, Dv, o)
    kernel_a = 2 * m * m * D
    pinv = o["pinv_iterations"] * 4 * 2 * m**3  # four m x m x m products per step
    landmarks_to_keys = 2 * m * M * (D + Dv)  # softmax(q~ k^T) v as one fused call
    z_times = 2 * m * m * Dv
    queries_to_landmarks = 2 * N * m * (D + Dv)
    return B * H * (kernel_a + pinv + landmarks_to_keys + z_times + queries_to_landmarks)


def _ra(B, H, N, M, D, Dv, o):
    if o["estimator"] == "mixture_mean":
        # mixture mean softmax(q k^T) k, then f at that point (the extra 1 carries -|k|^2/2)
        return 2 * B * H * N * M * (2 * D) + 2 * B * H * N * M * (D + 1 + Dv)
    s = o["num_samples"]
    sampling = 2 * B * H * N * M * D  # softmax rows to draw key indices from
    return sampling + 2 * B * H * N * s * M * (D + 1 + Dv)


def _lara(B, H, N, M, D, Dv, o):
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


def _sinkhorn(B, H, N, M, D, Dv, o):
    b = min(o["block_size"], N)
    nb = -(-N // b)
    t = o["top_blocks"]
    rows = min(o["sortcut_blocks"], nb) if o["sortcut_blocks"] else nb
    padded = N % b != 0  # padded to whole blocks: slots carry a logit bias for their real mass
    per_head = 0
    if o.get("sort_logits") is None:
        per_head += 2 * nb * nb * D  # block-mean sorting logits
    per_head += 2 * t * rows * nb * b * (D + Dv)  # sorted keys and values
    # queries against their keys; with padding the bias rides along as one more key coordinate
    d_logits = D + 1 if padded else D
    if padded:
        per_head += 2 * t * rows * nb * b  # the real mass of every sorted slot
    if o["sortcut_blocks"]:
        per_head += 2 * nb * b * rows * b * (d_logits + Dv)
    else:
        per_head += 2 * nb * b * (t + 1) * b * (d_logits + Dv)  # each block vs [sorted ; own]
    return B * H * per_head


FORMULAS: dict[str, Callable[..., int]] = {
    "softmax": _softmax,
    "linear": _linear,
    "efficient": _efficient,
    "performer": _performer,
    "nystrom": _nystrom,
    "ra": _ra,
    "lara": _lara,
    "sinkhorn": _sinkhorn,
}


def forward_flops(
    method: str, batch: int, heads: int, n: int, m: int, dim: int, dim_v: int, options: dict[str, Any]
) -> int | None:
    """Matmul FLOPs of one non-causal forward of ``method`` with its full ``options``
    (defaults included), or None when there is no formula for it."""
    formula = FORMULAS.get(method)
    if formula is None:
        return None
    return int(formula(batch, heads, n, m, dim, dim_v, options))


def counted_flops(fn: Callable[[], object]) -> int:
    """Matmul FLOPs of one call of ``fn``, counted by ``torch.utils.flop_counter``.

    ``scaled_dot_product_attention`` runs its math backend here: the counter sees that one's
    matmuls, while CPU's fused kernel is invisible to it (it would count 0)."""
    with FlopCounterMode(display=False) as counter, sdpa_kernel([SDPBackend.MATH]):
        fn()
    return int(counter.get_total_flops())


def matmul_rate(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                size: int | None = None, min_run_time: float = 1.0) -> float:
    """This machine's rate for one large square matmul, in FLOP/s: the roof against which
    achieved rates are quoted, so the fastest of the measured blocks (on a shared machine the
    median is pulled down by whatever else runs). ``size``: 2048 on CPU, 8192 on GPU."""
    device = torch.device(device)
    size = size or (2048 if device.type == "cpu" else 8192)
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, generator=gen, device=device, dtype=dtype)
    b = torch.randn(size, size, generator=gen, device=device, dtype=dtype)
    seconds = median_time(lambda: a @ b, min_run_time).fastest
    return 2 * size**3 / seconds
