"""Helpers shared by several ops: checks of generator and tensor options, random draws, and the
thread policy for small CPU work.

(Input checks of q, k, v and of plain options are in :mod:`subquad.checks`.)
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import Tensor

__all__ = ["SMALL_WORK", "check_generator", "check_tensor_option", "one_thread", "randn"]

#: elements below which a chain of elementwise kernels runs on one thread (see :func:`one_thread`)
SMALL_WORK = 1 << 18


@contextlib.contextmanager
def one_thread(active: bool = True):
    """``with one_thread(cond):`` torch runs on one thread inside the block when ``cond`` holds
    (pass ``tensor.device.type == "cpu"`` and the work is small).

    torch splits an elementwise kernel over its threads from about 32k elements on, and a
    batched LAPACK call over its batch; each split ends at a barrier where every thread waits
    for the slowest. On a CPU whose other cores are busy, a thread the OS has descheduled turns
    that wait into a scheduler time slice, milliseconds for microseconds of work: measured on
    2 cores with both busy, a QR of 4 matrices of 64 x 64 took 470 ms on two threads and 1.3 ms
    on one, 14 rounds of log-softmax over (8, 64, 64) 108 ms and 0.3 ms. Small work gains
    nothing from a second thread when the machine is quiet, so it runs on one."""
    if not active or torch.compiler.is_compiling() or torch.get_num_threads() == 1:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def check_generator(method: str, generator: Any) -> None:
    """TypeError unless ``generator`` is None or a ``torch.Generator``."""
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"{method}: generator must be a torch.Generator, got {type(generator).__name__}")


def check_tensor_option(method: str, name: str, value: Any, shape: str, *, or_none: bool = False) -> None:
    """ValueError unless ``value`` is None or a floating tensor with as many dimensions as
    ``shape`` names (``"(m, D)"``: two); the message names ``shape`` (and None when ``or_none``)."""
    ndim = shape.count(",") + 1
    if value is not None and (not isinstance(value, Tensor) or value.ndim != ndim or not value.is_floating_point()):
        raise ValueError(
            f"{method}: {name} must be a floating {shape} tensor{' or None' if or_none else ''}, got "
            f"{getattr(value, 'shape', type(value).__name__)}"
        )


def randn(shape, generator: torch.Generator | None, like: Tensor) -> Tensor:
    """Standard normal draws with the dtype and device of ``like``; drawn on the generator's
    device (CPU for a CPU generator) and moved, so a CPU generator works for any device."""
    if generator is None:
        return torch.randn(shape, dtype=like.dtype, device=like.device)
    out = torch.randn(shape, generator=generator, dtype=like.dtype, device=generator.device)
    return out.to(like.device)
