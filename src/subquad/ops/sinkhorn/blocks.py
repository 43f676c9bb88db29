"""The block structure of Sparse Sinkhorn attention, shared by the op and its LRA
compatibility mode: the block layout of a (padded) sequence, block summaries and sorting
logits, the Sinkhorn normalisation into soft block permutations, and masked attention.

Convention (as the spec): row i of ``P`` is the destination (the query block that receives),
column j the source block.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .._common import SMALL_WORK, one_thread
from .._masks import masked_fill_value

__all__ = [
    "block_layout",
    "block_means",
    "block_prefix_means",
    "default_sort_logits",
    "gumbel_noise",
    "log_sinkhorn",
    "padded_keep",
    "soft_permutations",
    "sort_support",
]


def block_layout(n: int, block_size: int) -> tuple[int, int]:
    """``(b, NB)`` for a length n: the block size clipped to n and the number of blocks
    ``ceil(n / b)``; the sequence is padded to ``NB * b``."""
    b = min(block_size, n)
    return b, -(-n // b)


def padded_keep(key_padding_mask: Tensor | None, batch: int, n: int, length: int, device) -> Tensor | None:
    """Bool ``(B, length)``, True = real token, for a sequence of n tokens padded to ``length``;
    None when every position is real."""
    keep = None if key_padding_mask is None else ~key_padding_mask
    if length > n:
        if keep is None:
            keep = torch.ones(batch, n, dtype=torch.bool, device=device)
        keep = F.pad(keep, (0, length - n), value=False)
    return keep


def _pad_to(x: Tensor, length: int) -> Tensor:
    """Zero-pad ``(B, H, n, d)`` along the sequence to ``length``."""
    pad = length - x.shape[2]
    return x if pad == 0 else F.pad(x, (0, 0, 0, pad))


def log_sinkhorn(log_alpha: Tensor, iterations: int, support: Tensor | None = None) -> Tensor:
    """Log-space Sinkhorn normalisation of ``log_alpha`` ``(..., n, n)``.

    Each of ``iterations`` rounds subtracts the log-sum-exp of every row, then of every column,
    so after each round the columns of ``exp(result)`` sum to 1 exactly and the rows tend to 1
    as the rounds grow (the doubly stochastic limit). ``support`` (bool, broadcastable, True =
    allowed entry) keeps every other entry at the masked fill value, i.e. ``P = 0`` there; a
    row or column with no allowed entry stays all zero. Returns ``log P``.
    """
    fill = masked_fill_value(log_alpha.dtype)
    out = log_alpha if support is None else log_alpha.masked_fill(~support, fill)
    small = log_alpha.device.type == "cpu" and log_alpha.numel() <= SMALL_WORK
    with one_thread(small):  # many tiny kernels (see one_thread)
        return _sinkhorn_rounds(out, iterations, support, fill)


def _sinkhorn_rounds(out: Tensor, iterations: int, support: Tensor | None, fill: float) -> Tensor:
    for _ in range(iterations):
        # log_softmax is x - logsumexp(x) in one fused, stable kernel (forward and backward)
        out = out.log_softmax(dim=-1)
        if support is not None:
            out = out.masked_fill(~support, fill)
        out = out.log_softmax(dim=-2)
        if support is not None:
            out = out.masked_fill(~support, fill)
    return out


def _log_row_normalize(log_alpha: Tensor, support: Tensor | None) -> Tensor:
    """Row-only log normalisation (a masked log-softmax); rows with no allowed entry stay 0."""
    fill = masked_fill_value(log_alpha.dtype)
    out = log_alpha if support is None else log_alpha.masked_fill(~support, fill)
    out = out.log_softmax(dim=-1)
    return out if support is None else out.masked_fill(~support, fill)


def gumbel_noise(
    shape, *, generator: torch.Generator | None = None, dtype: torch.dtype = torch.float32, device=None
) -> Tensor:
    """Standard Gumbel noise ``-log(-log U)``, ``U ~ Uniform(0, 1)`` kept away from 0 and 1.

    Drawn on the generator's device (``device`` when there is no generator), then moved."""
    draw_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    gen_device = generator.device if generator is not None else torch.device(device or "cpu")
    u = torch.rand(shape, generator=generator, dtype=draw_dtype, device=gen_device)
    info = torch.finfo(draw_dtype)
    u = u.clamp(info.tiny, 1.0 - info.eps)
    g = -torch.log(-torch.log(u))
    return g.to(device=device if device is not None else gen_device, dtype=dtype)


def block_means(x: Tensor, block_size: int, keep: Tensor | None = None) -> Tensor:
    """Masked mean of each block: x ``(B, H, L, d)`` with ``L % block_size == 0`` ->
    ``(B, H, L / block_size, d)``. ``keep`` bool ``(B, L)``, True = real token; a block with no
    real token has mean 0."""
    xb = x.unflatten(2, (x.shape[2] // block_size, block_size))
    if keep is None:
        return xb.mean(3)
    w = keep.to(x.dtype)[:, None, :, None].unflatten(2, xb.shape[2:4])  # (B, 1, NB, b, 1)
    return (xb * w).sum(3) / w.sum(3).clamp_min(1.0)


def block_prefix_means(x: Tensor, block_size: int, keep: Tensor | None = None) -> Tensor:
    """Causal block summaries: for block i the masked mean of x over positions ``0 .. i * b``
    (everything before the block plus its first token, all of which every query of block i may
    see). x ``(B, H, L, d)`` -> ``(B, H, L / b, d)``; 0 where no real token is in the prefix."""
    xb = x.unflatten(2, (x.shape[2] // block_size, block_size))
    if keep is None:
        w = torch.ones(1, 1, xb.shape[2], block_size, 1, dtype=x.dtype, device=x.device)
    else:
        w = keep.to(x.dtype)[:, None, :, None].unflatten(2, xb.shape[2:4])
    sums = (xb * w).sum(3)
    counts = w.sum(3)
    # sums over strictly earlier blocks (shifted, not cumsum - sums: that rounds with the
    # block's own, later tokens)
    before = F.pad(sums.cumsum(2), (0, 0, 1, 0))[:, :, :-1]
    before_n = F.pad(counts.cumsum(2), (0, 0, 1, 0))[:, :, :-1]
    first = xb[:, :, :, 0] * w[:, :, :, 0]
    return (before + first) / (before_n + w[:, :, :, 0]).clamp_min(1.0)


def default_sort_logits(
    q: Tensor, k: Tensor, block_size: int, keep: Tensor | None = None, causal: bool = False,
    scale: float | None = None,
) -> Tensor:
    """Length-agnostic sorting logits ``R_ij = <mean q_i, mean k_j> * scale`` ``(B, H, NB, NB)``
    from masked block means (``L % block_size == 0``). Causal: row i uses the prefix mean of
    :func:`block_prefix_means` so it sees nothing after the first token of block i."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    rows = block_prefix_means(q, block_size, keep) if causal else block_means(q, block_size, keep)
    cols = block_means(k, block_size, keep)
    return (rows * scale) @ cols.transpose(-2, -1)


def sort_support(valid: Tensor | None, num_blocks: int, causal: bool, device) -> Tensor | None:
    """Allowed entries of ``P`` as bool ``(B or 1, 1, NB, NB)``, None when all are allowed.

    ``valid`` bool ``(B, NB)``: the block holds a real token. Encoder: rows and columns of empty
    blocks are dropped (so all-padding blocks change nothing). Causal: block i may only receive
    blocks j < i (block 0 none: its sorted part is a null block); empty sources are dropped."""
    support = None
    if causal:
        support = torch.ones(num_blocks, num_blocks, dtype=torch.bool, device=device).tril_(-1)[None, None]
    if valid is not None:
        cols = valid[:, None, None, :]
        pair = cols if causal else cols & valid[:, None, :, None]
        support = pair if support is None else support & pair
    return support


def soft_permutations(
    log_alpha: Tensor, *, iterations: int, top_blocks: int, support: Tensor | None, causal: bool
) -> Tensor:
    """``top_blocks`` soft permutations ``(B, H, top_blocks, NB, NB)`` from ``log_alpha``
    (logits already divided by the temperature, noise included).

    The first is the Sinkhorn normalisation (causal: row normalisation only, over the support).
    Each further one excludes what earlier ones chose: it normalises
    ``log_alpha + sum log(1 - P_earlier)``, so slot m of block i prefers the m-th best source.
    """
    tiny = torch.finfo(log_alpha.dtype).tiny
    perms = []
    current = log_alpha
    for m in range(top_blocks):
        if m:
            current = current + torch.log((1.0 - perms[-1]).clamp_min(tiny))
        if causal:
            log_p = _log_row_normalize(current, support)
        else:
            log_p = log_sinkhorn(current, iterations, support)
        perms.append(log_p.exp())
    return torch.stack(perms, dim=2)


def _slot_counts(support: Tensor | None, num_blocks: int, device) -> Tensor:
    """Number of allowed sources per destination row, ``(B or 1, 1, NB)``."""
    if support is None:
        return torch.full((1, 1, num_blocks), num_blocks, device=device)
    return support.sum(-1)


def _attend(q: Tensor, k: Tensor, v: Tensor, ok: Tensor | None, scale: float) -> Tensor:
    """Softmax attention. ``ok``: bool, broadcastable to the logits, True = key visible; hidden
    keys get a finite large negative logit and a query with no visible key outputs 0. Blocked
    5-d inputs ``(B, H, NB, b, d)`` are folded to 4-d ``(B, H * NB, b, d)`` for the fused kernels."""
    if q.ndim == 5:
        B, H, nb = q.shape[:3]
        if ok is not None:
            ok = ok.expand(ok.shape[0], H, nb, *ok.shape[3:]).flatten(1, 2)
        out = _attend(q.flatten(1, 2), k.flatten(1, 2), v.flatten(1, 2), ok, scale)
        return out.unflatten(1, (H, nb))
    if ok is None:
        return F.scaled_dot_product_attention(q, k, v, scale=scale)
    mask = torch.zeros(ok.shape, dtype=q.dtype, device=q.device).masked_fill_(~ok, masked_fill_value(q.dtype))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.masked_fill(~ok.any(-1, keepdim=True), 0.0)
