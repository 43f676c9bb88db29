"""The attention core of exact attention: torch's masks, weights and dropout."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ..ops._masks import masked_fill_value, sdpa_dtype
from .attention import AttentionCore, _blocked_and_bias

__all__ = ["SoftmaxCore"]


class SoftmaxCore(AttentionCore):
    """Exact attention; the module's ``dropout`` is dropout on the attention weights."""

    def op_options(self):
        return {**self.options, "dropout_p": self.dropout if self.training else 0.0}

    def forward_masked(self, q: Tensor, k: Tensor, v: Tensor, extra_k: Tensor | None, extra_v: Tensor | None,
                       key_padding_mask: Tensor | None, attn_mask: Tensor | None, causal: bool,
                       need_weights: bool) -> tuple[Tensor, Tensor | None]:
        """Exact attention with torch's masks: q ``(B, H, L, hd)``, k, v ``(B, H, S, hd)``, extra
        keys/values ``(B, H, e, hd)`` appended and seen by every query, ``key_padding_mask``
        ``(B, S)`` and ``attn_mask`` ``(1 or B, 1 or H, L, S)``, bool (True = masked) or float
        (added). ``causal`` applies when there is no ``attn_mask`` (torch's ``is_causal`` is a hint
        about it). Returns ``(out (B, H, L, hd), weights (B, H, L, S + e) or None)``; weights are
        after dropout, as torch returns them. A query with every key masked outputs zeros."""
        L, S = q.shape[2], k.shape[2]
        if extra_k is not None:
            k, v = torch.cat([k, extra_k], 2), torch.cat([v, extra_v], 2)
        e = k.shape[2] - S
        blocked = bias = None
        masks = []
        # plain causal attention goes to SDPA as is_causal, as torch sends it
        sdpa_causal = causal and attn_mask is None and key_padding_mask is None and not e and not need_weights
        if attn_mask is not None:
            masks.append(attn_mask)
        elif causal and not sdpa_causal:
            masks.append(torch.ones(L, S, dtype=torch.bool, device=q.device).triu_(1)[None, None])
        if key_padding_mask is not None:
            masks.append(key_padding_mask[:, None, None, :])
        for mask in masks:
            bl, bi = _blocked_and_bias(mask)
            if e:
                bl = F.pad(bl, (0, e))
                bi = None if bi is None else F.pad(bi, (0, e))
            blocked = bl if blocked is None else blocked | bl
            if bi is not None:
                bias = bi if bias is None else bias + bi
        dtype = sdpa_dtype(q)  # a float attn_mask must be in the dtype SDPA computes in
        p = self.dropout if self.training else 0.0
        empty = None if blocked is None else blocked.all(-1, keepdim=True)
        if need_weights:
            logits = (q * math.sqrt(1.0 / self.head_dim)) @ k.transpose(-2, -1)
            if bias is not None:
                logits = logits + bias.to(logits.dtype)
            if blocked is not None:
                logits = logits.masked_fill(blocked, masked_fill_value(logits.dtype))
            w = torch.softmax(logits, dim=-1)
            if empty is not None:
                w = w.masked_fill(empty, 0.0)
            if p > 0:
                w = F.dropout(w, p)
            return w @ v, w
        attn = None
        if bias is not None or blocked is not None:
            attn = torch.zeros((), dtype=dtype, device=q.device) if bias is None else bias.to(dtype)
            if blocked is not None:
                attn = attn.masked_fill(blocked, masked_fill_value(dtype))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn, dropout_p=p,
                                             is_causal=sdpa_causal, scale=self.head_dim ** -0.5)
        if empty is not None:
            out = out.masked_fill(empty, 0.0)
        return out, None
