"""Shared helpers for the test suite.

The generic tests (``tests/test_generic.py``, ``tests/test_errors.py``) sweep every attention
method in the registry, so a method is tested the day it is registered. They call it with
:func:`method_options`, which makes stochastic methods deterministic and applies the method's
``test_options`` (in its registry entry, next to its op: set them only when a method's defaults
do not suit the tiny test shapes).

``SUBQUAD_EXTRA_METHODS``: comma-separated module names, imported before the method lists below
are read, so the methods they register are swept like the built-in ones. For a method written
outside the package, and for ``tests/test_contributing.py``, which runs the generic tests on the
example method of CONTRIBUTING.md: ``SUBQUAD_EXTRA_METHODS=my_module pytest tests/test_generic.py
-k my_method``.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import pytest
import torch

import subquad

# The tests use tiny tensors, where intra-op threads only add overhead, and on a loaded machine
# idle OpenMP threads spinning for a core make them many times slower. One thread by default;
# SUBQUAD_TEST_THREADS overrides it.
torch.set_num_threads(int(os.environ.get("SUBQUAD_TEST_THREADS", "1")))

for _module in os.environ.get("SUBQUAD_EXTRA_METHODS", "").split(","):
    if _module.strip():
        importlib.import_module(_module.strip())

ATTENTION_METHODS = [m.name for m in subquad.list_methods() if m.kind == "attention"]
CAUSAL_METHODS = [name for name in ATTENTION_METHODS if subquad.get_method(name).causal]
NON_CAUSAL_METHODS = [name for name in ATTENTION_METHODS if not subquad.get_method(name).causal]
CROSS_METHODS = [name for name in ATTENTION_METHODS if subquad.get_method(name).cross_attention]
SELF_ONLY_METHODS = [name for name in ATTENTION_METHODS if not subquad.get_method(name).cross_attention]
PADDING_METHODS = [name for name in ATTENTION_METHODS if subquad.get_method(name).key_padding]
STOCHASTIC_METHODS = [name for name in ATTENTION_METHODS if subquad.get_method(name).stochastic]
LINEAR_METHODS = [name for name in ATTENTION_METHODS if subquad.get_method(name).complexity == "linear"]


def generic_options(name: str, head_dim: int = 8, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The ``test_options`` of ``name``'s registry entry (a dict, or a callable of the head dim and
    dtype), as a fresh dict; no generator."""
    extra = subquad.get_method(name).test_options or {}
    return dict(extra(head_dim, dtype) if callable(extra) else extra)


def sampling_options(name: str) -> dict[str, Any]:
    """The ``sampling_options`` of ``name``'s registry entry: the options under which a method
    that samples only in some mode (LARA's and Sinkhorn's training mode) draws randomness."""
    return dict(subquad.get_method(name).sampling_options or {})


def method_options(name: str, head_dim: int, dtype: torch.dtype, *, seed: int = 0) -> dict[str, Any]:
    """Options that make ``name`` deterministic at the generic tests' shapes.

    Stochastic methods get ``generator=torch.Generator().manual_seed(seed)``, a fresh one per
    call, so two calls with the same seed give identical outputs. The entry's ``test_options``
    (:func:`generic_options`) are applied on top.
    """
    opts: dict[str, Any] = {}
    if subquad.get_method(name).stochastic:
        opts["generator"] = torch.Generator().manual_seed(seed)
    opts.update(generic_options(name, head_dim, dtype))
    return opts


def long_options(name: str) -> dict[str, Any]:
    """Options for the long-sequence test (N = 131072): each method's defaults, plus a seeded
    generator for stochastic methods."""
    if subquad.get_method(name).stochastic:
        return {"generator": torch.Generator().manual_seed(0)}
    return {}


def right_padding(batch: int, length: int, pads) -> torch.Tensor:
    """Bool ``(batch, length)`` key padding mask, True on the last ``pads[i]`` positions of row i."""
    mask = torch.zeros(batch, length, dtype=torch.bool)
    for i, p in enumerate(pads):
        if p:
            mask[i, length - p :] = True
    return mask


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


# A tiny stand-in for the MiniLM capture, so that ``subquad compare``'s default error inputs (real
# activations) run in the tests without transformers or the model's weights.
def tiny_capture(text, tokenizer=None, model=None):
    """What :func:`subquad.data.minilm.capture_qkv` returns, for 2 layers x 3 heads, 10 tokens,
    head dim 4 (not the run's --heads/--dim: the capture has its own shape); logits scaled up so
    that attention is sharp, as on real activations."""
    gen = torch.Generator().manual_seed(7)
    q, k, v = ([torch.randn(1, 3, 10, 4, generator=gen) * scale for _ in range(2)] for scale in (3.0, 3.0, 1.0))
    return {"q": q, "k": k, "v": v, "tokens": 10, "truncated": False, "token_count_before_truncation": 10,
            "check": 0.0}


@pytest.fixture
def fake_minilm(monkeypatch):
    """The ``real`` extra "installed" and its capture replaced by :func:`tiny_capture`; returns the
    texts it was asked to capture."""
    texts = []

    def capture(text, tokenizer=None, model=None):
        texts.append(text)
        return tiny_capture(text)

    from subquad.data import minilm

    monkeypatch.setattr(minilm, "missing_packages", lambda: [])
    monkeypatch.setattr(minilm, "capture_qkv", capture)
    return texts


def run_cli(argv, capsys):
    """(exit code, stdout, stderr) of ``subquad ARGV`` through its Python entry."""
    from subquad import cli

    try:
        code = cli.main(argv)
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(autouse=True)
def _gate_passes(monkeypatch):
    """``subquad compare``'s correctness gate runs the tests of ``tests/ops`` in a pytest process of
    its own before it times anything; inside this suite, which runs those tests itself, every
    compare run gets the verdict "passed" at once. ``tests/compare/test_gate.py`` tests the gate."""
    from subquad.compare import gate

    monkeypatch.setattr(gate, "run_gate", lambda methods, timeout=900.0: {
        m: {"status": "passed", "detail": "the suite runs the tests itself", "tests": 0} for m in methods})
