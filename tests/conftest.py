"""Shared helpers for the test suite.

The generic tests (``tests/test_generic.py``, ``tests/test_errors.py``) sweep every attention
method in the registry, so a method is tested the day it is registered. They call it with
:func:`method_options`, which makes stochastic methods deterministic and applies the small
per-method overrides of :data:`GENERIC_OPTIONS` (add an entry there only when a method's
defaults do not suit the tiny test shapes).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch

import subquad

# The tests use tiny tensors, where intra-op threads only add overhead, and on a loaded machine
# idle OpenMP threads spinning for a core make them many times slower. One thread by default;
# SUBQUAD_TEST_THREADS overrides it.
torch.set_num_threads(int(os.environ.get("SUBQUAD_TEST_THREADS", "1")))

# Per-method option overrides for the generic tests. A value is a dict of options, or a callable
# ``(head_dim, dtype) -> dict`` for options that depend on them (a fixed projection, say).
GENERIC_OPTIONS: dict[str, dict[str, Any] | Callable[[int, torch.dtype], dict[str, Any]]] = {
    # few landmarks, so the Nystrom path (not the exact fallback for m >= N) runs at N >= 5
    "nystrom": {"num_landmarks": 4},
    # a modest feature count; small chunks so causal tests cross several chunk boundaries
    "performer": {"num_features": 64, "chunk_size": 4},
    "linear": {"chunk_size": 4},
    # small blocks, so the tiny test lengths hold several blocks and the sorting runs
    "sinkhorn": {"block_size": 4},
}

# Options under which a stochastic method actually samples, for the test that a different
# generator seed gives a different output. LARA samples only in training mode (in eval it
# uses omega = mu, deterministic by design).
SAMPLING_OPTIONS: dict[str, dict[str, Any]] = {
    "lara": {"training": True},
    "sinkhorn": {"training": True},  # Gumbel noise
}

# Overrides for the long-sequence test (N = 131072). Empty by default: that test runs each
# method with its defaults; add an entry only for an option needed to keep a method linear.
LONG_OPTIONS: dict[str, dict[str, Any]] = {}

ATTENTION_METHODS = [m.name for m in subquad.list_methods() if m.kind == "attention"]
CAUSAL_METHODS = [name for name in ATTENTION_METHODS if subquad.get_method(name).causal]
NON_CAUSAL_METHODS = [name for name in ATTENTION_METHODS if not subquad.get_method(name).causal]
CROSS_METHODS = [name for name in ATTENTION_METHODS if subquad.get_method(name).cross_attention]
SELF_ONLY_METHODS = [name for name in ATTENTION_METHODS if not subquad.get_method(name).cross_attention]
PADDING_METHODS = [name for name in ATTENTION_METHODS if subquad.get_method(name).key_padding]
STOCHASTIC_METHODS = [name for name in ATTENTION_METHODS if subquad.get_method(name).stochastic]
LINEAR_METHODS = [name for name in ATTENTION_METHODS if subquad.get_method(name).complexity == "linear"]


def method_options(name: str, head_dim: int, dtype: torch.dtype, *, seed: int = 0) -> dict[str, Any]:
    """Options that make ``name`` deterministic at the generic tests' shapes.

    Stochastic methods get ``generator=torch.Generator().manual_seed(seed)``, a fresh one per
    call, so two calls with the same seed give identical outputs. Overrides from
    :data:`GENERIC_OPTIONS` are applied on top.
    """
    info = subquad.get_method(name)
    opts: dict[str, Any] = {}
    if info.stochastic:
        opts["generator"] = torch.Generator().manual_seed(seed)
    extra = GENERIC_OPTIONS.get(name, {})
    if callable(extra):
        extra = extra(head_dim, dtype)
    opts.update(extra)
    return opts


def long_options(name: str) -> dict[str, Any]:
    """Options for the long-sequence test: defaults, a seeded generator for stochastic methods,
    and the entries of :data:`LONG_OPTIONS`."""
    opts: dict[str, Any] = {}
    if subquad.get_method(name).stochastic:
        opts["generator"] = torch.Generator().manual_seed(0)
    opts.update(LONG_OPTIONS.get(name, {}))
    return opts


def qkv(
    batch: int,
    heads: int,
    n: int,
    d: int,
    *,
    m: int | None = None,
    dv: int | None = None,
    dtype: torch.dtype = torch.float64,
    seed: int = 0,
    requires_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Seeded random q ``(B, H, N, D)``, k ``(B, H, M, D)``, v ``(B, H, M, Dv)``."""
    m = n if m is None else m
    dv = d if dv is None else dv
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, n, d, generator=g, dtype=dtype)
    k = torch.randn(batch, heads, m, d, generator=g, dtype=dtype)
    v = torch.randn(batch, heads, m, dv, generator=g, dtype=dtype)
    if requires_grad:
        for t in (q, k, v):
            t.requires_grad_(True)
    return q, k, v


def run_method(name: str, q, k, v, *, seed: int = 0, **kwargs) -> torch.Tensor:
    """Call ``name``'s op with :func:`method_options` (deterministic) plus ``kwargs``."""
    opts = method_options(name, q.shape[-1], q.dtype, seed=seed)
    opts.update(kwargs)
    return subquad.attention(q, k, v, method=name, **opts)


@pytest.fixture(params=ATTENTION_METHODS)
def method(request) -> str:
    """Every registered attention method, by name."""
    return request.param


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """200 / 40 / 40 short ListOps samples (lengths 6..59) for the training tests."""
    from subquad.tasks import listops

    out = tmp_path_factory.mktemp("listops")
    cfg = listops.GeneratorConfig(max_depth=4, max_args=5, min_length=5, max_length=60)
    listops.write_splits(out, listops.generate_splits(200, 40, 40, seed=0, config=cfg))
    return out
