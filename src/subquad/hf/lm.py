"""How close a retrofitted decoder stays to exact attention: next-token perplexity, and samples.

:func:`next_token_losses` reads one sequence with a causal language model in one forward (no
cache) and returns the loss of each next token; :func:`lm_scores` turns them into the perplexity
over the window and over its last quarter (does the method still use far context?), with their
ratios to exact attention's and the share of greedy next tokens equal to exact attention's.
:func:`eval_ids` gives the first N tokens of a text, by default held-out English prose shipped
with installed packages (torch's docstrings, :func:`subquad.data.smollm.long_text`).
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["next_token_losses", "lm_scores", "eval_ids", "greedy_sample"]


def next_token_losses(model: nn.Module, ids: Tensor) -> tuple[Tensor, Tensor, float]:
    """For ``ids`` ``(1, N)``: the next-token losses ``(N - 1,)``, the greedy predictions
    ``(N - 1,)`` and the forward's seconds."""
    start = time.perf_counter()
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
    seconds = time.perf_counter() - start
    loss = F.cross_entropy(logits, ids[0, 1:].to(logits.device), reduction="none")
    return loss, logits.argmax(-1), seconds


def lm_scores(loss: Tensor, pred: Tensor, exact: dict[str, Any] | None = None) -> dict[str, float]:
    """``ppl`` and ``ppl_last_quarter`` of the losses; against ``exact`` (the same of exact
    attention, with its predictions under ``"pred"``) also ``ppl_ratio``, ``last_quarter_ratio``
    and ``same_prediction`` (the share of positions whose greedy next token is exact's)."""
    quarter = loss.shape[0] * 3 // 4
    row = {"ppl": math.exp(loss.mean().item()), "ppl_last_quarter": math.exp(loss[quarter:].mean().item())}
    if exact is not None:
        row["ppl_ratio"] = row["ppl"] / exact["ppl"]
        row["last_quarter_ratio"] = row["ppl_last_quarter"] / exact["ppl_last_quarter"]
        row["same_prediction"] = (pred == exact["pred"].to(pred.device)).float().mean().item()
    return row


def eval_ids(tokenizer, n: int, text: str | None = None) -> Tensor:
    """The first ``n`` tokens ``(1, <= n)`` of ``text``, or of held-out prose (torch's
    docstrings) when ``text`` is None."""
    if text is None:
        from ..data.smollm import long_text

        text = long_text(n, tokenizer, part="eval")
    return tokenizer(text, return_tensors="pt")["input_ids"][:, :n]


def greedy_sample(model: nn.Module, tokenizer, prompt: str, max_new_tokens: int = 32) -> str:
    """The greedy continuation of ``prompt`` (``model.generate``, as a transformers user calls it),
    decoded to text without the prompt."""
    enc = tokenizer(prompt, return_tensors="pt")
    device = next(model.parameters()).device
    enc = {k: enc[k].to(device) for k in ("input_ids", "attention_mask") if k in enc}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
    return tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
