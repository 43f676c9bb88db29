"""A tiny stand-in for the MiniLM capture, so that ``subquad compare``'s default error inputs (real
activations) run in the tests without transformers or the model's weights."""

import pytest
import torch

from subquad.bench import minilm


def tiny_capture(text, tokenizer=None, model=None):
    """What :func:`subquad.bench.minilm.capture_qkv` returns, for 2 layers x 3 heads, 10 tokens,
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

    monkeypatch.setattr(minilm, "missing_packages", lambda: [])
    monkeypatch.setattr(minilm, "capture_qkv", capture)
    return texts
