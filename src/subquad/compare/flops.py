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

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from ..registry import list_methods
from .timing import MIN_RUNS, median_time

__all__ = ["forward_flops", "counted_flops", "matmul_size", "matmul_rate", "Roof", "bounded_matmul_rate"]


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


def matmul_size(device: torch.device | str) -> int:
    """The side of the square product :func:`matmul_rate` measures by default: 2048 on CPU, 8192 on GPU."""
    return 2048 if torch.device(device).type == "cpu" else 8192


def _product(device: torch.device, dtype: torch.dtype, size: int) -> Callable[[], torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, generator=gen, device=device, dtype=dtype)
    b = torch.randn(size, size, generator=gen, device=device, dtype=dtype)
    return lambda: a @ b


def matmul_rate(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                size: int | None = None, min_run_time: float = 1.0) -> float:
    """This machine's rate for one large square matmul, in FLOP/s: the roof against which
    achieved rates are quoted, so the fastest of the measured blocks (on a shared machine the
    median is pulled down by whatever else runs). ``size``: 2048 on CPU, 8192 on GPU."""
    device = torch.device(device)
    size = size or matmul_size(device)
    seconds = median_time(_product(device, dtype, size), min_run_time).fastest
    return 2 * size**3 / seconds


@dataclass
class Roof:
    """:func:`bounded_matmul_rate`'s answer. ``rate``: FLOP/s of the ``size`` x ``size`` product
    (None: not measured, even the smallest product would not fit the time allowed); ``probes``:
    seconds of one product at each size tried on the way (after a warm-up); ``seconds``: the
    wall time of the whole measurement."""

    rate: float | None
    size: int
    probes: dict[int, float] = field(default_factory=dict)
    seconds: float = 0.0


def bounded_matmul_rate(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, *,
                        max_seconds: float, size: int | None = None, min_run_time: float = 1.0) -> Roof:
    """:func:`matmul_rate` within ``max_seconds``, for dtypes whose products are slow here (float16
    on most CPUs, without native half-precision matrix products). Sizes double from 256 (1024 on GPU) up to
    ``size`` (default: :func:`matmul_rate`'s); each is timed once after a warm-up, and the next is
    tried only while its probe and its full measurement (a warm-up and ``MIN_RUNS`` timed calls, at
    least ``min_run_time``), predicted at 8 times the current product, still fit the time left. The
    rate is measured at the last size that fits; None when even the first one does not."""
    start = time.perf_counter()
    device = torch.device(device)
    top = size or matmul_size(device)
    n = min(top, 256 if device.type == "cpu" else 1024)
    probes: dict[int, float] = {}

    def cost(call: float) -> float:
        return max(min_run_time, (MIN_RUNS + 1) * call)

    while True:
        probes[n] = median_time(_product(device, dtype, n), 0.0, min_runs=1).seconds
        spent = sum(2 * t for t in probes.values())
        nxt = 8 * probes[n]
        if 2 * n > top or spent + 2 * nxt + cost(nxt) > max_seconds:
            break
        n *= 2
    fits = spent + cost(probes[n]) <= max_seconds
    rate = matmul_rate(device, dtype, size=n, min_run_time=min_run_time) if fits else None
    return Roof(rate, n, probes, time.perf_counter() - start)
