"""hybrid as one FlexAttention call (``torch.nn.attention.flex_attention``; Dong et al.
2024, "Flex Attention: A Programming Model for Generating Optimized Attention Kernels",
arXiv 2412.05496): the selection's key blocks become a ``BlockMask`` built directly from block
indices, and torch compiles the kernel for the device (C++ on CPU, forward only in torch 2.13;
Triton on CUDA, forward and backward).

The mask's tiles are at least the kernel's own (128 x 128 on CUDA, where the backward kernel
needs it): where a tile is coarser than the selection's blocks, a tile is visited when any of
its blocks is selected and the mask function looks the blocks up, so the output is the same.
Lengths are padded to a multiple of :data:`BUCKET` (one compiled graph per padded length).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from .select import Selection

__all__ = ["attend_flex", "flex_available", "BUCKET"]

#: lengths are padded to a multiple of this (static shapes: one graph per padded length)
BUCKET = 1024


def flex_available(q: Tensor) -> bool:
    """Whether the FlexAttention path can run on ``q``: CUDA, or a CPU float32 tensor without
    autograd (torch's CPU FlexAttention has no backward), outside ``torch.compile``."""
    if torch.compiler.is_compiling():
        return False
    tracked = torch.is_grad_enabled() and q.requires_grad
    if q.device.type == "cuda":
        return True
    return q.device.type == "cpu" and q.dtype == torch.float32 and not tracked


#: compiled graphs of FlexAttention allowed (dynamo's default, 8, is reached by a few lengths times
#: the mask forms and grad modes; past it dynamo runs FlexAttention unfused, forming every score)
GRAPHS = 64


@functools.cache
def _compiled(device_type: str):
    from torch.nn.attention.flex_attention import flex_attention

    compiled = torch.compile(flex_attention, dynamic=False)

    def call(*args, **kwargs):
        with torch._dynamo.config.patch(recompile_limit=max(GRAPHS, torch._dynamo.config.recompile_limit)):
            return compiled(*args, **kwargs)

    return call


def _tile(device_type: str) -> int:
    return 128 if device_type == "cuda" else 1


def _round(n: int, m: int) -> int:
    return -(-n // m) * m


def _coarse(sel: Selection, nq: int, nk: int, rq: int, rk: int) -> tuple[Tensor, Tensor]:
    """Which tiles of ``rq`` x ``rk`` selection blocks are visited ``(B, H, nq / rq, nk / rk)`` and
    which of them are full, from the selection at ``nq`` x ``nk`` blocks."""
    B, H, sq, L = sel.index.shape
    hit = torch.zeros(B, H, nq, nk + 1, dtype=torch.bool, device=sel.index.device)
    whole = torch.zeros_like(hit)
    spare = torch.where(sel.valid, sel.index, nk)  # unused entries land in the spare column
    hit[:, :, :sq].scatter_(-1, spare, True)
    whole[:, :, :sq].scatter_(-1, torch.where(sel.full, sel.index, nk), True)
    hit, whole = hit[..., :nk], whole[..., :nk]
    tiles = hit.view(B, H, nq // rq, rq, nk // rk, rk)
    full = whole.view(B, H, nq // rq, rq, nk // rk, rk).all(-1).all(-2)
    return tiles.any(-1).any(-2), full, hit


def _tables(visit: Tensor, full: Tensor) -> tuple[Tensor, ...]:
    """FlexAttention's tables: counts and (ascending) indices of the partial and the full tiles of
    each query tile, then the same of each key tile (what the backward walks), from the dense tile
    maps ``(B, H, query tiles, key tiles)`` (``BlockMask.from_kv_blocks`` would rebuild the dense
    maps to transpose them)."""
    partial = visit & ~full

    def table(m):
        n = m.shape[-1]
        col = torch.arange(n, device=m.device, dtype=torch.int32)
        index = torch.where(m, col, n + col).argsort(-1).to(torch.int32, memory_format=torch.contiguous_format)
        return m.sum(-1, dtype=torch.int32), index  # the kernels read the tables as contiguous

    return (*table(partial), *table(full), *table(partial.mT), *table(full.mT))


@functools.lru_cache(maxsize=16)
def _real_keys(padded: int, m: int, device: torch.device) -> Tensor:
    """Which of ``padded`` key positions hold one of the ``m`` keys (kept per size and device)."""
    with torch.inference_mode(False), torch.no_grad():  # usable later under autograd as under inference
        return torch.arange(padded, device=device) < m


def _pad(x: Tensor, length: int) -> Tensor:
    return x if x.shape[2] == length else F.pad(x, (0, 0, 0, length - x.shape[2]))


def attend_flex(q: Tensor, k: Tensor, v: Tensor, sel: Selection, causal: bool, scale: float) -> Tensor:
    """What :func:`.chunk.attend_gathered` computes, as one compiled FlexAttention call."""
    from torch.nn.attention.flex_attention import BlockMask

    B, H, N, D = q.shape
    M = k.shape[2]
    QB, KB = sel.query_block, sel.key_block
    t = _tile(q.device.type)
    tq, tk = max(QB, t), max(KB, t)
    Np, Mp = _round(N, max(BUCKET, tq)), _round(M, max(BUCKET, tk))
    visit, full, hit = _coarse(sel, Np // QB, Mp // KB, tq // QB, tk // KB)
    real = _real_keys(Mp, M, q.device)  # a tensor, not the int M: no new graph per length
    if tq == QB and tk == KB:
        def mask_mod(b, h, qi, ki):
            keep = real[ki]
            return keep & (ki <= qi) if causal else keep
    else:  # tiles coarser than blocks: look the block up
        def mask_mod(b, h, qi, ki):
            keep = real[ki] & hit[b, h, qi // QB, ki // KB]
            return keep & (ki <= qi) if causal else keep
    # the constructor's order: lengths, the query tiles' tables (partial, full), the key tiles'
    mask = BlockMask((Np, Mp), *_tables(visit, full), BLOCK_SIZE=(tq, tk), mask_mod=mask_mod)
    out = _compiled(q.device.type)(_pad(q, Np), _pad(k, Mp), _pad(v, Mp), block_mask=mask, scale=scale)
    return out[:, :, :N]
