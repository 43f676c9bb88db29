"""Helpers shared by several ops: checks of generator and tensor options, random draws, the keys a
block selection attends, and the thread policies for CPU work (small work on one thread;
independent heads on threads of their own).

(Input checks of q, k, v and of plain options are in :mod:`subquad.checks`.)
"""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch
from torch import Tensor

__all__ = ["SMALL_WORK", "check_generator", "check_tensor_option", "keys_of_blocks", "modes_active", "one_thread",
           "over_threads", "randn"]

#: elements below which a chain of elementwise kernels runs on one thread (see :func:`one_thread`)
SMALL_WORK = 1 << 18


@contextlib.contextmanager
def one_thread(active: bool = True):
    """``with one_thread(cond):`` torch runs on one thread inside the block when ``cond`` holds
    (pass ``tensor.device.type == "cpu"`` and the work is small).

    torch splits an elementwise kernel over its threads from about 32k elements on, and a
    batched LAPACK call over its batch; each split ends at a barrier where every thread waits
    for the slowest. On a CPU whose other cores are busy, a thread the OS has descheduled turns
    that wait into a scheduler time slice, milliseconds for microseconds of work (a small
    batched QR or a few log-softmaxes of 64 x 64 tiles then take hundreds of times longer on two
    threads than on one). Small work gains nothing from a second thread when the machine is
    quiet, so it runs on one."""
    if not active or torch.compiler.is_compiling() or torch.get_num_threads() == 1:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


_pool: tuple[int, int, ThreadPoolExecutor] | None = None  # (pid, workers, pool)
_pool_lock = threading.Lock()


def _workers(count: int) -> ThreadPoolExecutor:
    """This process's pool of ``count`` worker threads (a new one after a fork, whose child has
    none of the parent's threads, or when torch's thread count changed)."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool[:2] != (os.getpid(), count):
            if _pool is not None and _pool[0] == os.getpid():
                _pool[2].shutdown(wait=False)  # its threads end once idle
            _pool = (os.getpid(), count, ThreadPoolExecutor(count, thread_name_prefix="subquad"))
        return _pool[2]


def _single_threaded(work: Callable[[int], None], threads: int) -> Callable[[int], None]:
    """``work`` on one torch thread in the calling thread (OpenMP's setting is per thread), then
    back to ``threads``, the caller's count (torch also keeps it for threads it starts later).
    Grad and inference mode are per thread too: ``work`` runs in the caller's (autocast need not
    follow: the ops call this inside :func:`subquad.ops._masks.compute_precision`, which turns it
    off)."""
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()

    def run(i: int) -> None:
        torch.set_num_threads(1)
        try:
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                work(i)
        finally:
            torch.set_num_threads(threads)

    return run


def modes_active() -> bool:
    """Whether a torch dispatch or function mode is active in this thread (``FlopCounterMode``,
    ``FakeTensorMode``, ``with torch.device(...)``): work that leaves torch's dispatcher (another
    thread, numpy) would run without it."""
    return bool(torch._C._len_torch_dispatch_stack() + torch._C._len_torch_function_stack())


def over_threads(work: Callable[[int], None], count: int) -> None:
    """Call ``work(i)`` for ``i`` in ``range(count)``, spread over ``torch.get_num_threads()``
    worker threads that each run torch on one thread; returns when every call has. ``work``
    must write its results itself (into disjoint outputs) and be safe to run concurrently.

    For many independent CPU chains (one per head) of kernels that are each too small to be
    worth splitting. Split over torch's threads, every kernel ends at a barrier where each thread
    waits for the slowest; on a CPU with another busy process the OS deschedules one of them
    for a time slice at a time, and the waits add up: performer's 8-head forward at N = 4096
    took 4.4x its quiet time there (``benchmarks/results/busy_cores.md``). Here each chain runs
    whole on one thread, threads take the next chain when they finish one (a descheduled thread
    holds back only its own chain), and there is one wait per call. Runs in the calling thread
    when torch has one thread, under ``torch.compile``, and while a dispatch or function mode is
    active (``FlopCounterMode``, ``FakeTensorMode``, ``with torch.device(...)``: modes are per
    thread, and a worker would run without it)."""
    threads = torch.get_num_threads()
    if threads == 1 or count == 1 or modes_active() or torch.compiler.is_compiling():
        for i in range(count):
            work(i)
        return
    for _ in _workers(threads).map(_single_threaded(work, threads), range(count)):
        pass


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


def keys_of_blocks(keep: Tensor, n: int, m: int, query_block: int, key_block: int, causal: bool) -> Tensor:
    """``(B, H, n)`` float64: the keys each of ``n`` queries attends when query block ``i`` attends
    key block ``j`` of ``m`` keys where ``keep`` ``(B, H, nq, nk)`` holds (causal: the keys at or
    before the query). For a registry entry's ``expected_keys``."""
    nq, nk = keep.shape[-2:]
    start = torch.arange(nk, device=keep.device) * key_block
    size = (m - start).clamp(max=key_block)  # keys in each block
    pos = torch.arange(nq * query_block, device=keep.device)[:, None]
    visible = (pos + 1 - start).clamp(min=0, max=key_block).minimum(size) if causal else size.expand(len(pos), nk)
    keys = torch.einsum("bhij,ipj->bhip", keep.double(), visible.double().view(nq, query_block, nk))
    return keys.flatten(2)[..., :n]
