"""Fidelity to exact attention: a float64 reference with bounded memory, and the error measure."""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["exact_reference", "relative_error", "attention_sharpness"]

# bytes of one (B, H, rows, M) block of float64 logits
_BLOCK_BYTES = 1 << 28


def _query_blocks(q: Tensor, k: Tensor, block_bytes: int):
    B, H, N, _ = q.shape
    rows = max(1, block_bytes // (8 * B * H * k.shape[2]))
    return range(0, N, rows), rows


def exact_reference(q: Tensor, k: Tensor, v: Tensor, scale: float | None = None,
                    block_bytes: int = _BLOCK_BYTES) -> Tensor:
    """Exact softmax attention in float64: q ``(B, H, N, D)``, k ``(B, H, M, D)``, v ``(B, H, M, Dv)``
    -> ``(B, H, N, Dv)`` float64, on q's device. Blocks of queries keep the ``(B, H, rows, M)``
    logits under ``block_bytes``, so N = 16384 needs 256 MiB, not 16 GiB."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q, k, v = q.double(), k.double(), v.double()
    out = torch.empty(*q.shape[:3], v.shape[-1], dtype=torch.float64, device=q.device)
    starts, rows = _query_blocks(q, k, block_bytes)
    kt = k.transpose(-2, -1)
    for s in starts:
        weights = torch.softmax((q[:, :, s : s + rows] @ kt) * scale, dim=-1)
        out[:, :, s : s + rows] = weights @ v
    return out


def relative_error(out: Tensor, reference: Tensor) -> float:
    """``|out - ref|_F / |ref|_F`` over the whole tensor, in float64."""
    ref = reference.double()
    return ((out.double() - ref).norm() / ref.norm()).item()


def attention_sharpness(q: Tensor, k: Tensor, scale: float | None = None,
                        block_bytes: int = _BLOCK_BYTES) -> dict[str, float]:
    """How peaked the exact attention rows are: the mean over queries (all batches and heads) of
    the row entropy divided by ``log M`` (1 = uniform, 0 = one key), and the mean largest weight."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q, k = q.double(), k.double()
    starts, rows = _query_blocks(q, k, block_bytes)
    kt = k.transpose(-2, -1)
    entropy = top = 0.0
    count = 0
    for s in starts:
        logp = torch.log_softmax((q[:, :, s : s + rows] @ kt) * scale, dim=-1)
        p = logp.exp()
        entropy += -(p * logp).sum(-1).sum().item()
        top += p.amax(-1).sum().item()
        count += p[..., 0].numel()
    m = k.shape[2]
    return {"normalised_entropy": entropy / count / math.log(m) if m > 1 else 0.0,
            "mean_max_weight": top / count}
