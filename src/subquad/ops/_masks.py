"""Input validation and mask helpers shared by every op.

Conventions (DESIGN.md): tensors are ``(B, H, N, D)``; ``key_padding_mask`` is a bool
``(B, M)`` tensor in which **True marks padding**; masked logits get a large finite negative
value so that a fully padded row stays finite.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

__all__ = [
    "check_qkv",
    "compute_dtype",
    "compute_precision",
    "masked_fill_value",
    "no_key_rows",
    "sdpa_dtype",
]


def masked_fill_value(dtype: torch.dtype) -> float:
    """A large finite negative logit for ``dtype``: exp() of it is 0, and it never overflows
    when a logit of ordinary size is added to it."""
    return torch.finfo(dtype).min / 2


def check_qkv(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_padding_mask: Tensor | None,
    *,
    name: str,
    cross_attention: bool = True,
) -> None:
    """Validate shapes, dtypes and devices; raise ``TypeError``/``ValueError`` naming the
    argument, what was given and what is allowed."""
    for arg, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name}: {arg} must be a torch.Tensor, got {type(t).__name__}")
        if t.ndim != 4:
            raise ValueError(
                f"{name}: {arg} must have 4 dimensions (B, H, L, D), got shape {tuple(t.shape)}"
            )
        if not t.is_floating_point():
            raise TypeError(f"{name}: {arg} must be a floating-point tensor, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{name}: q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"{name}: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}"
        )
    B, H, N, D = q.shape
    if k.shape[0] != B or v.shape[0] != B:
        raise ValueError(
            f"{name}: batch sizes differ: q {B}, k {k.shape[0]}, v {v.shape[0]}"
        )
    if k.shape[1] != H or v.shape[1] != H:
        raise ValueError(f"{name}: head counts differ: q {H}, k {k.shape[1]}, v {v.shape[1]}")
    if k.shape[3] != D:
        raise ValueError(f"{name}: q and k must share the head dim, got {D} and {k.shape[3]}")
    M = k.shape[2]
    if v.shape[2] != M:
        raise ValueError(f"{name}: k and v must have the same length, got {M} and {v.shape[2]}")
    if N == 0 or M == 0:
        raise ValueError(f"{name}: sequence lengths must be at least 1, got N={N}, M={M}")
    if D == 0 or v.shape[3] == 0:
        raise ValueError(
            f"{name}: head dims must be at least 1, got D={D} (q, k) and Dv={v.shape[3]} (v)"
        )
    if not cross_attention and N != M:
        raise ValueError(
            f"{name}: supports self-attention only (query and key lengths equal), got N={N}, M={M}"
        )
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, Tensor):
            raise TypeError(
                f"{name}: key_padding_mask must be a bool tensor, got {type(key_padding_mask).__name__}"
            )
        if key_padding_mask.dtype != torch.bool:
            raise TypeError(
                f"{name}: key_padding_mask must have dtype torch.bool (True = padding), "
                f"got {key_padding_mask.dtype}"
            )
        if tuple(key_padding_mask.shape) != (B, M):
            raise ValueError(
                f"{name}: key_padding_mask must have shape (B, M) = {(B, M)}, "
                f"got {tuple(key_padding_mask.shape)}"
            )
        if key_padding_mask.device != q.device:
            raise ValueError(
                f"{name}: key_padding_mask is on {key_padding_mask.device}, q on {q.device}"
            )


def sdpa_dtype(q: Tensor) -> torch.dtype:
    """The dtype ``scaled_dot_product_attention`` computes in for queries ``q``: under autocast
    every floating input but float64 is cast to the autocast dtype, float64 is left alone. A
    float ``attn_mask`` must have this dtype (a float32 bias next to float64 queries fails, and
    a large negative float32 bias is -inf in float16)."""
    if torch.is_autocast_enabled(q.device.type) and q.dtype != torch.float64:
        return torch.get_autocast_dtype(q.device.type)
    return q.dtype


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; every other floating dtype computes in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def compute_precision(x: Tensor):
    """Context manager that turns autocast off, so sensitive math runs in the dtype the op
    chose (see :func:`compute_dtype`) even inside ``torch.autocast``."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.autocast(x.device.type, enabled=False)
    return contextlib.nullcontext()


def no_key_rows(
    key_padding_mask: Tensor | None, n_queries: int, causal: bool
) -> Tensor | None:
    """Bool ``(B, 1, N, 1)``: True where a query sees no real key (every visible key is
    padding). The library defines the output there as zeros. None without a mask."""
    if key_padding_mask is None:
        return None
    if causal:
        # query t sees keys 0..t; it has a real key iff the first real key index <= t
        real = ~key_padding_mask
        seen = real.cumsum(-1) > 0  # (B, M): some real key at or before position j
        rows = ~seen[:, :n_queries]
    else:
        rows = key_padding_mask.all(-1, keepdim=True).expand(-1, n_queries)
    return rows[:, None, :, None]
