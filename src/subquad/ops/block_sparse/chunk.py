"""block_sparse by gathered key blocks: each chunk of query blocks gathers its selected key blocks
and computes softmax attention over them with batched matrix products, under autograd (any
device, any dtype; the form for training on CPU, where FlexAttention has no backward)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .._masks import masked_fill_value
from .select import Selection

__all__ = ["attend_gathered"]

# bytes of gathered keys, values and logits formed per chunk of query blocks
_CHUNK_BYTES = 1 << 25


def _blocked(x: Tensor, size: int) -> Tensor:
    """``(B, H, L, d)`` padded to a multiple of ``size`` rows, viewed ``(B, H, L / size, size, d)``."""
    B, H, L, d = x.shape
    n = -(-L // size)
    return F.pad(x, (0, 0, 0, n * size - L)).view(B, H, n, size, d)


def _gather(x: Tensor, index: Tensor) -> Tensor:
    """Blocks of ``x`` ``(B, H, nk, KB, d)`` picked per head by ``index`` ``(B, H, c, L)``:
    ``(B, H, c, L KB, d)``."""
    B, H, nk, KB, d = x.shape
    flat = (index + (torch.arange(B * H, device=x.device) * nk).view(B, H, 1, 1)).flatten()
    return x.reshape(B * H * nk, KB, d).index_select(0, flat).view(*index.shape[:3], index.shape[3] * KB, d)


def attend_gathered(q: Tensor, k: Tensor, v: Tensor, sel: Selection, causal: bool, scale: float) -> Tensor:
    """Softmax attention of each query over the keys of its block's selected key blocks
    (``sel``), causal: those at or before it (every query sees at least its own key, so no row is
    empty). One fused ``scaled_dot_product_attention`` per chunk of query blocks, the gathered keys
    of each query block as one sequence. -> ``(B, H, N, Dv)``."""
    B, H, N, D = q.shape
    M, Dv = k.shape[2], v.shape[-1]
    QB, KB = sel.query_block, sel.key_block
    qb, kb, vb = _blocked(q, QB), _blocked(k, KB), _blocked(v, KB)
    nq, nk = qb.shape[2], kb.shape[2]
    real = (torch.arange(nk * KB, device=q.device) < M).view(nk, KB)  # positions that hold a key
    L = sel.index.shape[-1]
    step = max(1, _CHUNK_BYTES // max(1, B * H * L * KB * (D + Dv + QB) * q.element_size()))
    neg = masked_fill_value(q.dtype)
    out = []
    for a in range(0, nq, step):
        index, valid = sel.index[:, :, a: a + step], sel.valid[:, :, a: a + step]
        c = index.shape[2]
        ok = (real[index] & valid.unsqueeze(-1)).flatten(-2).unsqueeze(-2)  # (B, H, c, 1, L KB)
        if causal:
            pos = (index.unsqueeze(-1) * KB + torch.arange(KB, device=q.device)).flatten(-2)
            qpos = torch.arange(a * QB, (a + c) * QB, device=q.device).view(1, 1, c, QB, 1)
            ok = ok & (pos.unsqueeze(-2) <= qpos)
        bias = torch.zeros(ok.shape, dtype=q.dtype, device=q.device).masked_fill_(~ok, neg)
        o = F.scaled_dot_product_attention(qb[:, :, a: a + c].flatten(0, 1), _gather(kb, index).flatten(0, 1),
                                           _gather(vb, index).flatten(0, 1), attn_mask=bias.flatten(0, 1), scale=scale)
        out.append(o.view(B, H, c, QB, Dv))
    return torch.cat(out, 2).view(B, H, nq * QB, Dv)[:, :, :N]
