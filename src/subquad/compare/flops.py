"""Floating-point work of each method's forward pass, and this machine's matmul rate.

A FLOP count here is the matrix-multiply work (2 FLOPs per multiply-add in every matmul, batched
matmul and fused attention kernel), the convention of ``torch.utils.flop_counter``: softmaxes,
exponentials and other elementwise work are left out. Each formula is written from its op's
code path (non-causal, no padding mask, self-attention shapes) and lives with the op, as the
``flops`` of its registry entry (``ops/<method>/__init__.py``); the tests check each against
:func:`counted_flops` for small shapes. A method without a formula is counted at run time.

Shapes: batch B, heads H, queries N, keys M, head dim D, value dim Dv.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from ..registry import list_methods
from .timing import median_time

__all__ = ["forward_flops", "counted_flops", "matmul_rate"]


def forward_flops(
    method: str, batch: int, heads: int, n: int, m: int, dim: int, dim_v: int, options: dict[str, Any]
) -> int | None:
    """Matmul FLOPs of one non-causal forward of ``method`` with its full ``options``
    (defaults included), from the formula of its registry entry (``flops``); None when the
    method is not registered or has no formula."""
    info = next((info for info in list_methods() if info.name == method), None)
    if info is None or info.flops is None:
        return None
    return int(info.flops(batch, heads, n, m, dim, dim_v, options))


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
