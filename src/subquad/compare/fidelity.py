"""Fidelity to exact attention: a float64 reference with bounded memory, and the error measure."""

from __future__ import annotations


import torch
from torch import Tensor

__all__ = ["exact_reference", "relative_error", "head_errors", "attention_sharpness"]

# bytes of one (B, H, rows, M) block of float64 logits
_BLOCK_BYTES = 1 << 28


def _query_blocks(q: Tensor, k: Tensor, block_bytes: int):
    B, H, N, _ = q.shape
    rows = max(1, block_bytes // (8 * B * H * k.shape[2]))
    return range(0, N, rows), rows


def _logit_blocks(q: Tensor, k: Tensor, scale: float, causal: bool, block_bytes: int):
    """``(start, logits)`` for blocks of queries: float64 ``(B, H, rows, M')`` logits of queries
    ``start ..``; ``causal``: only the keys up to the block's last query (M' = start + rows), the
    later ones of each query at -inf."""
    starts, rows = _query_blocks(q, k, block_bytes)
    kt = k.double().transpose(-2, -1)
    for s in starts:
        qs = q[:, :, s : s + rows].double()
        if not causal:
            yield s, (qs @ kt) * scale
            continue
        end = min(s + qs.shape[2], k.shape[2])
        logits = (qs @ kt[..., :end]) * scale
        queries = torch.arange(s, s + qs.shape[2], device=q.device)
        yield s, logits.masked_fill(torch.arange(end, device=q.device)[None, :] > queries[:, None], float("-inf"))


def exact_reference(q: Tensor, k: Tensor, v: Tensor, scale: float | None = None,
                    block_bytes: int = _BLOCK_BYTES, causal: bool = False) -> Tensor:
    """Exact softmax attention in float64: q ``(B, H, N, D)``, k ``(B, H, M, D)``, v ``(B, H, M, Dv)``
    -> ``(B, H, N, Dv)`` float64, on q's device (``causal``: query i sees keys 0..i, and the keys
    after a block's last query are never multiplied). Blocks of queries keep the ``(B, H, rows, M)``
    logits under ``block_bytes``, so N = 16384 needs 256 MiB, not 16 GiB."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    v = v.double()
    out = torch.empty(*q.shape[:3], v.shape[-1], dtype=torch.float64, device=q.device)
    for s, logits in _logit_blocks(q, k, scale, causal, block_bytes):
        out[:, :, s : s + logits.shape[2]] = torch.softmax(logits, dim=-1) @ v[:, :, : logits.shape[3]]
    return out


def relative_error(out: Tensor, reference: Tensor) -> float:
    """``|out - ref|_F / |ref|_F`` over the whole tensor, in float64."""
    ref = reference.double()
    return ((out.double() - ref).norm() / ref.norm()).item()


def head_errors(out: Tensor, reference: Tensor) -> tuple[float, list[list[float]]]:
    """The relative error over the whole ``(B, H, N, Dv)`` tensor (:func:`relative_error`), and that
    of each head: ``(total, [[error of head h of item b] for b])``, in float64."""
    ref = reference.double()
    diff = (out.double() - ref).pow(2).sum(dim=(2, 3))
    norm = ref.pow(2).sum(dim=(2, 3))
    return (diff.sum() / norm.sum()).sqrt().item(), (diff / norm).sqrt().tolist()


def attention_sharpness(q: Tensor, k: Tensor, scale: float | None = None,
                        block_bytes: int = _BLOCK_BYTES, causal: bool = False, top: int = 64) -> dict[str, float]:
    """How peaked the exact attention rows are, means over queries (all batches and heads):
    ``entropy`` (nats), ``normalised_entropy`` (the entropy over log of the number of keys the row
    sees: 1 = uniform, 0 = one key; a row with one key counts 0), ``mean_max_weight`` and
    ``top_mass`` (the weight on the ``top`` largest keys). ``causal``: query i sees keys 0..i."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    n, m = q.shape[2], k.shape[2]
    seen = torch.arange(1, n + 1, dtype=torch.float64) if causal else torch.full((n,), float(m), dtype=torch.float64)
    log_seen = seen.clamp(max=m).log().to(q.device)
    sums = {"entropy": 0.0, "normalised_entropy": 0.0, "mean_max_weight": 0.0, "top_mass": 0.0}
    for s, logits in _logit_blocks(q, k, scale, causal, block_bytes):
        logp = torch.log_softmax(logits, dim=-1)
        p = logp.exp()
        ent = -(p * logp.nan_to_num(0.0, neginf=0.0)).sum(-1)
        norm = log_seen[s : s + logits.shape[2]]
        sums["entropy"] += ent.sum().item()
        sums["normalised_entropy"] += torch.where(norm > 0, ent / norm.clamp(min=1e-300), 0.0).sum().item()
        sums["mean_max_weight"] += p.amax(-1).sum().item()
        sums["top_mass"] += p.topk(min(top, logits.shape[-1]), dim=-1).values.sum().item()
    count = q.shape[0] * q.shape[1] * n
    return {name: total / count for name, total in sums.items()}
