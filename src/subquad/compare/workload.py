"""The calls that the benchmarks measure: inputs, and one method's forward or forward+backward.

Shared by the parent process (time, error, FLOPs) and the memory subprocess, so both measure
the same thing. Stochastic methods get a fresh generator seeded with ``seed`` at every call,
so repeated calls (and the two processes) see the same random draws.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from torch import Tensor

import subquad
from subquad.registry import MethodInfo

__all__ = ["DTYPES", "make_qkv", "full_options", "forward_call", "forward_backward_call", "mixer_module",
           "compile_once"]

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float64": torch.float64}


def make_qkv(batch: int, heads: int, n: int, dim: int, *, dtype=torch.float32, device="cpu",
             seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """i.i.d. N(0, 1) q, k, v ``(B, H, N, D)``, drawn in float64 on the CPU from ``seed`` (the same
    numbers for every dtype and device), then cast and moved."""
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, heads, n, dim, generator=gen, dtype=torch.float64).to(device, dtype)
                 for _ in range(3))


def full_options(info: MethodInfo, options: dict[str, Any]) -> dict[str, Any]:
    """The method's options with defaults filled in (validated by its options dataclass)."""
    built = info.make_options(**options)
    return {f.name: getattr(built, f.name) for f in dataclasses.fields(built)}


def _call_options(info: MethodInfo, options: dict[str, Any], seed: int, device) -> dict[str, Any]:
    opts = dict(options)
    if "generator" in info.option_defaults() and opts.get("generator") is None:
        opts["generator"] = torch.Generator(device=device).manual_seed(seed)
    return opts


def mixer_module(info: MethodInfo, heads: int, dim: int, options: dict[str, Any], *, dtype, device):
    """A token mixer's module for ``C = heads * dim`` channels, in eval mode."""
    module = info.module(heads * dim, heads, **options)
    return module.to(device=device, dtype=dtype).eval()


_COMPILED: dict[Any, Callable] = {}


def compile_once(fn: Callable) -> Callable:
    """``torch.compile(fn, fullgraph=True, dynamic=False)`` (inductor), made once per function or
    module. Each method's op is its own code object, so each gets its own compiled entries (one
    graph per shape: every new length compiles anew)."""
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, fullgraph=True, dynamic=False)
    return _COMPILED[fn]


def forward_call(info: MethodInfo, q: Tensor, k: Tensor, v: Tensor, options: dict[str, Any], *,
                 seed: int = 0, module=None, causal: bool = False, compiled: bool = False) -> Callable[[], Tensor]:
    """``fn()`` -> the method's output on q, k, v (an attention op; ``causal``: with ``causal=True``)
    or on ``x = q`` viewed as ``(B, N, H * D)`` (a token mixer, through ``module``). ``compiled``:
    through :func:`compile_once` (stochastic methods then draw from the global RNG, seeded with ``seed``
    at each call: a ``torch.Generator`` cannot be traced)."""
    if info.kind == "mixer":
        x = q.transpose(1, 2).flatten(2)
        mixer = compile_once(module) if compiled else module
        return lambda: mixer(x)
    op = subquad.get_method(info.name).op
    call = {"causal": True} if causal else {}
    if not compiled:
        return lambda: op(q, k, v, **_call_options(info, options, seed, q.device), **call)
    op = compile_once(op)

    def fn():
        torch.manual_seed(seed)
        return op(q, k, v, **options, **call)

    return fn


def forward_backward_call(info: MethodInfo, q: Tensor, k: Tensor, v: Tensor, options: dict[str, Any], *,
                          seed: int = 0, module=None, causal: bool = False,
                          compiled: bool = False) -> Callable[[], object]:
    """``fn()``: forward (as :func:`forward_call` makes it) and the gradients of ``<out, g>`` for a
    fixed random ``g`` with respect to q, k, v (attention) or x and the module's parameters (mixer).
    Gradients are returned, not accumulated, so repeated calls do the same work."""
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    if info.kind == "mixer":
        x = q.detach().transpose(1, 2).flatten(2).requires_grad_(True)
        leaves = [x, *(p for p in module.parameters() if p.requires_grad)]
        mixer = compile_once(module) if compiled else module
        forward = lambda: mixer(x)  # noqa: E731
        shape = x.shape
    else:
        leaves = [q, k, v]
        forward = forward_call(info, q, k, v, options, seed=seed, causal=causal, compiled=compiled)
        shape = (*q.shape[:3], v.shape[-1])
    gen = torch.Generator().manual_seed(seed + 1)
    grad = torch.randn(shape, generator=gen, dtype=torch.float64).to(q.device, q.dtype)

    def fn():
        return torch.autograd.grad(forward(), leaves, grad, allow_unused=True)

    return fn
