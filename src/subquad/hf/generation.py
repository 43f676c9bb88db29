"""Greedy generation after a long prompt: a retrofitted decoder against the model's own attention.

After a prompt of N tokens, exact attention (the model before :func:`subquad.hf.retrofit`, through
transformers' ``DynamicCache``) generates greedily; then the retrofitted model decodes through
:func:`subquad.hf.decoding_cache` (a :class:`subquad.hf.StateCache` where its method keeps a
decoding state, such as ``hybrid``'s key index):

- **free-running**: its own greedy continuation; scored by the share of positions whose token is
  exact attention's, and the first position where they differ (after a difference the two texts
  are about different things, so this share mostly measures how long they agree);
- **teacher-forced**: fed exact attention's continuation token by token; scored by the share of
  positions whose greedy next token is exact attention's (each position judged on the same
  history).

Each also gives the median seconds per generated token (the prefill excluded).
:func:`decoded_perplexity` reads the prompt's last K tokens one at a time through the cache after
a prefill of the others (decoding as generation does, on text the model did not write).
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .cache import CACHE_ARGUMENT, decoding_cache

__all__ = ["greedy_steps", "exact_generation", "generation_agreement", "decode_losses", "decoded_perplexity"]


def greedy_steps(model: nn.Module, ids: Tensor, cache, new: int,
                 feed: Tensor | None = None) -> tuple[list[int], list[float]]:
    """Prefill ``ids`` ``(1, N)`` into ``cache``, then ``new - 1`` single-token steps, each fed the
    last greedy token (``feed`` None) or ``feed``'s next token (teacher forcing). Returns the
    ``new`` greedy tokens (the first from the prefill) and each step's seconds."""
    tokens, seconds = [], []
    with torch.no_grad():
        logits = model(input_ids=ids, **{CACHE_ARGUMENT: cache}).logits[0, -1]
        tokens.append(int(logits.argmax()))
        for i in range(new - 1):
            nxt = tokens[-1] if feed is None else int(feed[i])
            start = time.perf_counter()
            step = torch.tensor([[nxt]], device=ids.device)
            logits = model(input_ids=step, **{CACHE_ARGUMENT: cache}).logits[0, -1]
            seconds.append(time.perf_counter() - start)
            tokens.append(int(logits.argmax()))
    return tokens, seconds


def _median(seconds: list[float]) -> float | None:
    return statistics.median(seconds) if seconds else None


def exact_generation(model: nn.Module, ids: Tensor, new: int, tokenizer=None) -> dict[str, Any]:
    """``model`` (not retrofitted) generating ``new`` tokens after ``ids`` through a
    ``DynamicCache``: ``{"tokens", "s_per_token", "text"}`` (the first 60 tokens decoded)."""
    from transformers import DynamicCache

    tokens, seconds = greedy_steps(model, ids, DynamicCache(), new)
    text = None if tokenizer is None else tokenizer.decode(tokens[:60])
    return {"tokens": tokens, "s_per_token": _median(seconds), "text": text}


def generation_agreement(model: nn.Module, ids: Tensor, exact: dict[str, Any], tokenizer=None) -> dict[str, Any]:
    """A retrofitted ``model`` after the same prompt as ``exact`` (:func:`exact_generation`):
    ``free_same`` and ``first_difference`` (free-running; None when every token agrees),
    ``forced_same`` (teacher-forced), ``s_per_token`` (free-running), ``tokens`` and ``text``."""
    new = len(exact["tokens"])
    free, seconds = greedy_steps(model, ids, decoding_cache(model), new)
    forced, _ = greedy_steps(model, ids, decoding_cache(model), new, feed=torch.tensor(exact["tokens"]))
    same = [a == b for a, b in zip(free, exact["tokens"])]
    return {"free_same": sum(same) / new, "first_difference": None if all(same) else same.index(False),
            "forced_same": sum(a == b for a, b in zip(forced, exact["tokens"])) / new,
            "s_per_token": _median(seconds), "tokens": free,
            "text": None if tokenizer is None else tokenizer.decode(free[:60])}


def decode_losses(model: nn.Module, ids: Tensor, cache, k: int) -> Tensor:
    """Next-token losses ``(k,)`` of the last ``k`` tokens of ``ids`` ``(1, N)``, ``k < N``: a
    prefill of the others into ``cache``, then one token per call."""
    n = ids.shape[1]
    if not 0 < k < n:
        raise ValueError(f"k must be in 1 .. {n - 1} for {n} tokens, got {k}")
    out = []
    with torch.no_grad():
        logits = model(input_ids=ids[:, : n - k], **{CACHE_ARGUMENT: cache}).logits[0, -1:]
        for t in range(n - k, n):
            out.append(F.cross_entropy(logits.float(), ids[0, t: t + 1]))
            if t + 1 < n:
                logits = model(input_ids=ids[:, t: t + 1], **{CACHE_ARGUMENT: cache}).logits[0, -1:]
    return torch.stack(out)


def decoded_perplexity(model: nn.Module, ids: Tensor, k: int, exact: float | None = None) -> dict[str, float]:
    """The perplexity of the last ``k`` tokens of ``ids``: for a retrofitted ``model`` decoded one
    at a time through :func:`~subquad.hf.decoding_cache` (``ppl``, and ``ppl_ratio`` to
    ``exact``); for a model that is not retrofitted, ``exact`` None, from one full forward."""
    if exact is None:
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False).logits[0, -k - 1: -1].float()
        return {"ppl": math.exp(F.cross_entropy(logits, ids[0, -k:]).item())}
    ppl = math.exp(decode_losses(model, ids, decoding_cache(model), k).mean().item())
    return {"ppl": ppl, "ppl_ratio": ppl / exact}
