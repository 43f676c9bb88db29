"""Hedgehog: linear attention with a learned, per-head feature map.

Zhang, Bhatia, Kumbong and Ré (2024), "The Hedgehog & the Porcupine: Expressive Linear
Attentions with Softmax Mimicry", ICLR 2024, Section 4.1: a per-head linear layer followed by
``[softmax(x W + b), softmax(-(x W + b))]`` over the feature axis, trained so that linear
attention with these features mimics softmax attention. LoLCATs (Zhang et al. 2024, "LoLCATs:
On Low-Rank Linearizing of Large Language Models", Section 3.1) trains the same maps against
the exact layer's *output*, which is what :func:`subquad.hf.transfer` does.

``window > 0`` adds the LoLCATs hybrid (Section 3.2, there a sliding window): each query attends
to the keys of its own block of ``window`` tokens and of the neighbouring blocks (the previous one
only, and no later position, when causal) with exact ``exp(q.k * scale)`` weights, and to all
other keys with the linear term, under one shared normaliser. The window term costs
``O(N * window)``, so the whole stays linear in N.

The learned tensors (``weight``, ``bias`` and, with a window, ``linear_log_weight``) are options
of the op; a layer keeps them as parameters (the entry's ``learned_init`` gives their initial
values: the identity map, so the untrained method is linear attention on ``softmax`` of the raw q
and k). Without them the op uses those initial values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ...checks import check_int
from ...registry import register_method
from .._masks import compute_dtype, compute_precision, drop_padded
from .._sharded import Shards
from ..linear import _causal_chunked, kernel_attention

__all__ = ["hedgehog_attention", "hedgehog_features", "windowed_kernel_attention", "HedgehogOptions", "flops"]


@dataclass
class HedgehogOptions:
    """``feature_dim``: F, the width of the per-head linear map (None: the head dim; the
    features have 2F entries). ``window``: block size of the exact window (0: none). ``sinks``
    (``<= window``): the first keys that every query also sees exactly. ``chunk_size``: tokens
    per chunk of the causal linear term. ``weight`` ``(H, D, F)``, ``bias`` ``(H, 1, F)``,
    ``linear_log_weight`` ``(H,)``: the learned tensors (None: their initial values)."""

    feature_dim: int | None = None
    window: int = 0
    sinks: int = 0
    chunk_size: int = 64
    weight: Tensor | None = None
    bias: Tensor | None = None
    linear_log_weight: Tensor | None = None

    def __post_init__(self):
        if self.feature_dim is not None:
            check_int("hedgehog", "feature_dim", self.feature_dim, minimum=1)
        check_int("hedgehog", "window", self.window, minimum=0)
        check_int("hedgehog", "sinks", self.sinks, minimum=0)
        check_int("hedgehog", "chunk_size", self.chunk_size, minimum=1)
        if self.sinks > self.window:
            raise ValueError(f"hedgehog: sinks must be between 0 and window, got sinks={self.sinks}, "
                             f"window={self.window}")


def learned_init(o: HedgehogOptions, num_heads: int, head_dim: int) -> dict[str, Tensor]:
    """The initial learned tensors (the entry's ``learned_init``): ``W`` the identity (extra
    columns zero), ``b`` zero, and with a window the linear term's log weight zero."""
    f = head_dim if o.feature_dim is None else o.feature_dim
    out = {"weight": torch.eye(head_dim, f).expand(num_heads, head_dim, f).clone(),
           "bias": torch.zeros(num_heads, 1, f)}
    if o.window > 0:
        out["linear_log_weight"] = torch.zeros(num_heads)
    return out


def hedgehog_features(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """``[softmax(x W_h + b_h), softmax(-(x W_h + b_h))]`` per head h: x ``(B, H, L, D)``, ``W``
    ``(H, D, F)``, ``b`` ``(H, 1, F)`` -> ``(B, H, L, 2F)``, non-negative, each half summing to 1."""
    z = torch.einsum("bhld,hdf->bhlf", x, weight.to(x.dtype)) + bias.to(x.dtype)
    return torch.cat([torch.softmax(z, dim=-1), torch.softmax(-z, dim=-1)], dim=-1)


def _learned(o: HedgehogOptions, q: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
    """weight, bias and the linear term's weight for q's heads and head dim (given or initial)."""
    heads, d = q.shape[1], q.shape[-1]
    init = learned_init(o, heads, d)
    weight = init["weight"].to(q.device) if o.weight is None else o.weight
    bias = init["bias"].to(q.device) if o.bias is None else o.bias
    f = weight.shape[-1]
    if weight.shape != (heads, d, f) or bias.shape != (heads, 1, f):
        raise ValueError(f"hedgehog: weight must be (H, D, F) = ({heads}, {d}, F) and bias (H, 1, F), got "
                         f"{tuple(weight.shape)} and {tuple(bias.shape)}")
    if o.window == 0:
        return weight, bias, None
    lw = torch.zeros(heads, device=q.device) if o.linear_log_weight is None else o.linear_log_weight
    if lw.shape != (heads,):
        raise ValueError(f"hedgehog: linear_log_weight must be (H,) = ({heads},), got {tuple(lw.shape)}")
    return weight, bias, lw


def _kernel_features(o: HedgehogOptions):
    """The entry's ``kernel_features``: without a window, hedgehog is kernel attention with its
    learned features (computed in float32, float64 stays)."""
    if o.window > 0:
        return None

    def features(q: Tensor, k: Tensor, scale: float | None) -> tuple[Tensor, Tensor]:
        dtype = compute_dtype(q.dtype)
        q, k = q.to(dtype), k.to(dtype)
        weight, bias, _ = _learned(o, q)
        return hedgehog_features(q, weight, bias), hedgehog_features(k, weight, bias)

    return features


def flops(B, H, N, M, D, Dv, o):
    """Matmul FLOPs of one non-causal forward (``o``: the full options as a dict): the feature maps
    of q and k, kernel attention with 2F features and, with a window, the block products of the
    padded queries with their 3 * window (+ sinks) window keys."""
    f = D if o["feature_dim"] is None else o["feature_dim"]
    out = 2 * B * H * (N + M) * D * f
    w = o["window"]
    if w == 0:
        return out + 2 * B * H * (2 * f * Dv * (M + N) + 2 * f * N)
    keys = 3 * w + o["sinks"]
    padded = -(-N // w) * w
    return out + 2 * B * H * (2 * f * (Dv + 1) * (M + N) + padded * keys * (2 * f + D + 2 * (Dv + 1)))


def _context_parallel(q, k, v, key_padding_mask, causal, scale, options: HedgehogOptions, shards: Shards) -> Tensor:
    """The entry's ``context_parallel``: without a window, kernel attention over the ranks' states
    (LASP-2, see :mod:`subquad.ops.linear`); with one, NotImplementedError (its exact window would
    need the neighbouring ranks' keys)."""
    if options.window > 0:
        raise NotImplementedError("hedgehog: context parallelism supports window=0 (kernel attention) only; "
                                  f"got window={options.window}")
    with compute_precision(q):
        phi_q, phi_k = _kernel_features(options)(q, k, scale)
        out = kernel_attention(phi_q, phi_k, v.to(phi_q.dtype), key_padding_mask, causal, options.chunk_size, shards)
    return out.to(q.dtype)


@register_method("hedgehog", options=HedgehogOptions,
                 summary="learned-feature linear attention, optionally with an exact window (Zhang et al. 2024)",
                 causal=True, cross_attention=True, complexity="linear", learned_parameters=True, flops=flops,
                 test_options={"chunk_size": 4}, query_local=True, learned_init=learned_init,
                 kernel_features=_kernel_features, context_parallel=_context_parallel)
def hedgehog_attention(q, k, v, key_padding_mask, causal, scale, *, options: HedgehogOptions):
    """Hedgehog attention.

    Shapes: q ``(B, H, N, D)``, k ``(B, H, M, D)``, v ``(B, H, M, Dv)`` -> ``(B, H, N, Dv)``.
    ``scale`` (default ``D ** -0.5``) applies to the exact window's logits; the linear term has
    none. ``window > 0`` needs N = M. Runs in float32 (float64 stays)."""
    o = options
    dtype = q.dtype
    cdt = compute_dtype(dtype)
    q, k, v = q.to(cdt), k.to(cdt), v.to(cdt)
    weight, bias, lw = _learned(o, q)
    phi_q, phi_k = hedgehog_features(q, weight, bias), hedgehog_features(k, weight, bias)
    out = windowed_kernel_attention(phi_q, phi_k, q, k, v, key_padding_mask, causal, window=o.window, scale=scale,
                                    chunk_size=o.chunk_size, linear_weight=None if lw is None else lw.to(cdt).exp(),
                                    sinks=o.sinks)
    return out.to(dtype)


def _blocks(x: Tensor, size: int, n_blocks: int) -> Tensor:
    """``(B, H, L, E)`` -> ``(B, H, n_blocks, size, E)``, zero-padded at the end."""
    pad = n_blocks * size - x.shape[2]
    return F.pad(x, (0, 0, 0, pad)).unflatten(2, (n_blocks, size))


def _neighbours(xb: Tensor, causal: bool) -> Tensor:
    """Each block with its neighbours along the key axis: ``(B, H, nb, S, E)`` ->
    ``(B, H, nb, k*S, E)`` with blocks ``[i-1, i]`` (causal) or ``[i-1, i, i+1]``; zeros outside."""
    prev = F.pad(xb, (0, 0, 0, 0, 1, 0))[:, :, :-1]
    parts = [prev, xb] if causal else [prev, xb, F.pad(xb, (0, 0, 0, 0, 0, 1))[:, :, 1:]]
    return torch.cat(parts, dim=3)


def window_keys(n: int, m: int, window: int, causal: bool, device=None) -> Tensor:
    """Bool ``(nb, window, k*window)``: which key slot of :func:`_neighbours` is a real key in the
    exact window of each query (same or adjacent block of ``window`` tokens; causal: earlier or
    same position)."""
    nb = -(-n // window)
    span = 2 if causal else 3
    qpos = torch.arange(nb * window, device=device).view(nb, window, 1)
    blk = torch.arange(nb, device=device).view(nb, 1, 1)
    kpos = (blk - 1) * window + torch.arange(span * window, device=device).view(1, 1, -1)
    ok = (kpos >= 0) & (kpos < m) & (qpos < n)
    if causal:
        ok = ok & (kpos <= qpos)
    return ok


def windowed_kernel_attention(
    phi_q: Tensor,
    phi_k: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_padding_mask: Tensor | None,
    causal: bool,
    *,
    window: int = 0,
    scale: float | None = None,
    chunk_size: int = 64,
    linear_weight: Tensor | None = None,
    sinks: int = 0,
) -> Tensor:
    """Linear attention on the features ``phi_q`` ``(B, H, N, F)``, ``phi_k`` ``(B, H, M, F)``,
    plus the optional exact window (on the raw q ``(B, H, N, D)``, k ``(B, H, M, D)``).

    The window is block-banded: the tokens are cut in blocks of ``window``; a query sees exactly
    the keys of its own block and the previous one (and the next one, non-causal), so between
    ``window`` and ``3 * window`` keys, computed as small dense block products; every other key
    goes through the linear term. Returns ``(B, H, N, Dv)``. ``key_padding_mask`` bool
    ``(B, M)``, True = padding. ``linear_weight`` ``(H,)`` (positive) weighs the linear term
    against the window's ``exp`` weights (LoLCATs learns this balance too); default 1.
    ``sinks`` (``<= window``): the first ``sinks`` keys are exact for every query too (the
    "attention sinks" of Xiao et al. 2024, "Efficient Streaming Language Models with Attention
    Sinks", Section 3; BERT's [CLS] takes 10-16% of the attention mass in MiniLM's middle layers).
    """
    if sinks > 0 and not 0 < sinks <= window:
        raise ValueError(f"hedgehog: sinks must be <= window, got sinks={sinks}, window={window}")
    if window <= 0:
        return kernel_attention(phi_q, phi_k, v, key_padding_mask, causal, chunk_size)
    n, m = q.shape[2], k.shape[2]
    if n != m:
        raise ValueError("hedgehog: window > 0 needs equal query and key lengths")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    # padded features and values dropped (a NaN there times a weight of 0 is NaN)
    phi_k, v = drop_padded(phi_k, key_padding_mask), drop_padded(v, key_padding_mask)
    v1 = F.pad(v, (0, 1), value=1.0)  # last column: the normaliser
    if causal:
        lin = _causal_chunked(phi_q, phi_k, v1, chunk_size)
    else:
        lin = phi_q @ (phi_k.transpose(-2, -1) @ v1)
    nb = -(-n // window)
    ok = window_keys(n, m, window, causal, q.device)  # (nb, S, K)
    if key_padding_mask is not None:
        real = _neighbours(_blocks((~key_padding_mask)[:, None, :, None].float(), window, nb), causal)
        ok = ok & (real.squeeze(-1) > 0)[:, 0, :, None, :]  # (B, nb, S, K)
        ok = ok[:, None]
    qb, kn = _blocks(q, window, nb), _neighbours(_blocks(k, window, nb), causal)
    fqb, fkn = _blocks(phi_q, window, nb), _neighbours(_blocks(phi_k, window, nb), causal)
    vn = _neighbours(_blocks(v1, window, nb), causal)
    if sinks > 0:  # extra key slots: the first keys, for query blocks whose window misses block 0
        s_ok = (torch.arange(nb, device=q.device) >= 2).view(nb, 1, 1).expand(nb, window, sinks)
        if key_padding_mask is not None:
            s_ok = s_ok & ~key_padding_mask[:, None, None, None, :sinks]  # (B, 1, nb, S, s)
            ok = torch.cat([ok.expand(*s_ok.shape[:-1], ok.shape[-1]), s_ok], -1)
        else:
            ok = torch.cat([ok, s_ok], -1)

        def add(xn, x):
            return torch.cat([xn, x[:, :, None, :sinks].expand(-1, -1, nb, -1, -1)], 3)

        kn, fkn, vn = add(kn, k), add(fkn, phi_k), add(vn, v1)
    # the window's keys leave the linear term (every key counts once) ...
    lin_w = (fqb @ fkn.transpose(-2, -1)).masked_fill(~ok, 0.0)
    lin = lin - (lin_w @ vn).flatten(2, 3)[:, :, :n]
    # ... and enter with exact weights, stabilised by the row max (clamped at 0 so exp(-mx) <= 1:
    # tiny window weights then underflow, which is right, the linear term of order 1 dominates)
    logits = (qb @ kn.transpose(-2, -1) * scale).masked_fill(~ok, -1e30)
    mx = logits.amax(-1, keepdim=True).clamp_min(0.0)
    ew = torch.exp(logits - mx).masked_fill(~ok, 0.0)
    lin = lin * torch.exp(-mx).flatten(2, 3)[:, :, :n]
    if linear_weight is not None:
        lin = lin * linear_weight.view(1, -1, 1, 1)
    out = (ew @ vn).flatten(2, 3)[:, :, :n] + lin
    den = out[..., -1:]
    return out[..., :-1] / torch.where(den > 0, den, torch.ones_like(den))
