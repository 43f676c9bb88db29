"""The slow, obvious reference of exact attention, for the tests (the library never imports it).

This is the one exact reference of the test suite: every approximate method's tests measure
against it (in float64 inputs). The benchmarks' blocked float64 reference,
:func:`subquad.compare.fidelity.exact_reference`, is tested against it.
"""

from __future__ import annotations

import torch

__all__ = ["softmax_attention_reference"]


def softmax_attention_reference(q, k, v, key_padding_mask=None, causal=False, scale=None):
    """Slow, obvious reference: the full weight matrix with explicit masks."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    logits = torch.einsum("bhnd,bhmd->bhnm", q, k) * scale
    n, m = logits.shape[-2:]
    allowed = torch.ones(n, m, dtype=torch.bool, device=q.device)
    if causal:
        allowed = allowed.tril()
    allowed = allowed.expand(q.shape[0], 1, n, m)
    if key_padding_mask is not None:
        allowed = allowed & ~key_padding_mask[:, None, None, :]
    logits = logits.masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # rows with no key -> 0
    return weights @ v
