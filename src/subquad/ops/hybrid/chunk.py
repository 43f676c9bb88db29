"""hybrid by gathered key blocks, under autograd (the forms for the CPU, where FlexAttention
has no backward):

- :func:`attend_gathered`, any selection, device and dtype: each chunk of query blocks gathers its
  selected key blocks and computes softmax attention over them in one fused SDPA call with an
  additive mask;
- :func:`attend_causal`, causal self-attention on the CPU: the query blocks whose selection is
  every earlier key are one causal attention; every later block attends to its gathered past key
  blocks and to its own positions in two calls of torch's CPU flash kernel, merged by log-sum-exp;
  its backward runs the kernel's backward on each part (no mask is formed: at 8192 tokens about
  twice as fast as the FlexAttention form, forward, on this project's CPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .._masks import masked_fill_value
from .select import Selection

__all__ = ["attend_causal", "attend_gathered", "prefix_backward", "prefix_forward", "units_backward",
           "units_forward"]

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


# --------------------------------------------------------------------------- causal, by fused kernels

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward

# bytes of gathered keys and values per call of the fused kernel (kept in cache, reused by malloc)
_UNIT_BYTES = 1 << 23


def causal_blocks_available(q: Tensor, k: Tensor, sel: Selection) -> bool:
    """Whether :func:`attend_causal` runs: causal self-attention on the CPU (torch's CPU flash
    kernel) with key blocks no larger than query blocks (a block's diagonal keys are then its
    own positions), not empty (the kernel divides by its batch)."""
    return (q.device.type == "cpu" and q.numel() > 0 and q.shape[2] == k.shape[2] and sel.key_block <= sel.query_block
            and q.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16))


def sparse_start(sel: Selection, past: int) -> int:
    """The first query block whose selection is not every key block before it: block ``i`` has
    ``i QB / KB`` key blocks before it and attends to ``past`` of them
    (:func:`~subquad.ops.hybrid.select.past_blocks`)."""
    return past * sel.key_block // sel.query_block + 1


def attend_causal(q: Tensor, k: Tensor, v: Tensor, sel: Selection, past: int, scale: float) -> Tensor:
    """Causal hybrid for self-attention by torch's fused CPU attention kernel, forward and
    backward: the query blocks whose selection is every earlier key (the first
    :func:`sparse_start`) are one causal attention; each later block attends to its ``past``
    gathered key blocks (one kernel call over many blocks, their keys as one sequence each) and,
    causally, to its own positions; the two parts merge by their log-sum-exps (as FlashAttention's
    split-KV and ring attention do). The backward runs the kernel's backward on each part with the
    merged output and log-sum-exp, and adds the gathered keys' gradients back. ``sel`` must have
    ``past`` valid blocks first in every row from :func:`sparse_start` on (the causal selection
    with ``past = sinks + local + num_blocks``). -> ``(B, H, N, Dv)``."""
    B, H, N, D = q.shape
    Dv = v.shape[-1]
    QB = sel.query_block
    Np = -(-N // QB) * QB
    E = max(D, Dv)  # the kernel wants one head size: zero columns change no logit, add no output
    q, k, v = (t.contiguous() if t.shape[-2:] == (Np, E) else F.pad(t, (0, E - t.shape[-1], 0, Np - N)).contiguous()
               for t in (q, k, v))
    i0 = min(sparse_start(sel, past), Np // QB)
    out = _CausalBlocks.apply(q, k, v, sel.index[:, :, i0:, :past], i0 * QB, sel.key_block, scale)
    return out[:, :, :N, :Dv]


class _CausalBlocks(torch.autograd.Function):
    """q, k, v ``(B, H, Np, E)`` contiguous, ``Np`` a multiple of QB; ``ids`` ``(B, H, c, S)`` the
    past key blocks of the query blocks from position ``P`` on (``c = (Np - P) / QB``)."""

    @staticmethod
    def forward(ctx, q, k, v, ids, P, KB, scale):
        out, lse = prefix_forward(q, k, v, P, scale)
        if ids.shape[2]:
            units_forward(q, k, v, k, v, ids, P, (q.shape[2] - P) // ids.shape[2], KB, scale, out, lse)
        ctx.save_for_backward(q, k, v, ids, out, lse)
        ctx.P, ctx.KB, ctx.scale = P, KB, scale
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q, k, v, ids, out, lse = ctx.saved_tensors
        P, scale, KB = ctx.P, ctx.scale, ctx.KB
        dout = dout.contiguous()
        dq, dk, dv = prefix_backward(dout, q, k, v, out, lse, P, scale)
        if ids.shape[2]:
            units_backward(dout, q, k, v, k, v, ids, P, (q.shape[2] - P) // ids.shape[2], KB, scale, out, lse,
                           (dq, dk, dv, dk, dv))
        return dq, dk, dv, None, None, None, None


def prefix_forward(q: Tensor, k: Tensor, v: Tensor, P: int, scale: float) -> tuple[Tensor, Tensor]:
    """``out`` and ``lse`` for q ``(B, H, Np, E)``, rows ``..P`` filled: causal attention of the
    first ``P`` positions (the dense prefix); the rest left for :func:`units_forward`."""
    out = torch.empty_like(q)
    lse = q.new_empty(q.shape[:3], dtype=torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype)
    if P:
        out[:, :, :P], lse[:, :, :P] = _flash(q[:, :, :P], k[:, :, :P], v[:, :, :P], is_causal=True, scale=scale)
    return out, lse


def prefix_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, P: int,
                    scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """``dq``, ``dk``, ``dv`` with the dense prefix's gradients in rows ``..P``, zeros elsewhere."""
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if P:
        dq[:, :, :P], dk[:, :, :P], dv[:, :, :P] = _flash_backward(
            dout[:, :, :P], q[:, :, :P], k[:, :, :P], v[:, :, :P], out[:, :, :P], lse[:, :, :P], 0.0, True,
            scale=scale)
    return dq, dk, dv


def units_forward(q: Tensor, k: Tensor, v: Tensor, kp: Tensor, vp: Tensor, ids: Tensor, P: int, QB: int, KB: int,
                  scale: float, out: Tensor, lse: Tensor) -> None:
    """Rows ``P .. P + c QB`` of ``out`` and ``lse`` (all ``(B, H, Np, *)`` contiguous): query block
    ``i`` attends its past blocks ``ids[:, :, i]`` (of ``kp``, ``vp``) and, causally, its own
    positions (of ``k``, ``v``); the two parts merge by their log-sum-exps."""
    u = _Units(q, ids, P, QB, KB, kp.shape[2] // KB)
    o_d, l_d = _flash(u.rows(q), u.rows(k), u.rows(v), is_causal=True, scale=scale)  # own positions
    o, l_out = u.rows(out), u.rows(lse)
    for r, a, b, kg, vg in u.gathered(kp, vp):
        o_p, l_p = _flash(u.rows(q)[r: r + 1, a:b], kg, vg, scale=scale)
        both = torch.logaddexp(l_p[0], l_d[r, a:b])
        w_p, w_d = (l_p[0] - both).exp().unsqueeze(-1), (l_d[r, a:b] - both).exp().unsqueeze(-1)
        o[r, a:b] = o_p[0].to(w_p.dtype).mul_(w_p).add_(o_d[r, a:b].to(w_p.dtype) * w_d)
        l_out[r, a:b] = both


def units_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, kp: Tensor, vp: Tensor, ids: Tensor, P: int,
                   QB: int, KB: int, scale: float, out: Tensor, lse: Tensor, grads: tuple[Tensor, ...]) -> None:
    """The backward of :func:`units_forward` from the merged ``out`` and ``lse``, added to ``grads``
    ``(dq, dk, dv, dkp, dvp)`` (``dkp``, ``dvp`` may be ``dk``, ``dv`` themselves)."""
    dq, dk, dv, dkp, dvp = grads
    u = _Units(q, ids, P, QB, KB, kp.shape[2] // KB)
    du, ou, lu, qu = u.rows(dout), u.rows(out), u.rows(lse), u.rows(q)
    g_q, g_k, g_v = _flash_backward(du, qu, u.rows(k), u.rows(v), ou, lu, 0.0, True, scale=scale)
    dk_flat, dv_flat = dkp.view(-1, KB, dkp.shape[-1]), dvp.view(-1, KB, dvp.shape[-1])
    for r, a, b, kg, vg in u.gathered(kp, vp):
        gq, gk, gv = _flash_backward(du[r: r + 1, a:b], qu[r: r + 1, a:b], kg, vg, ou[r: r + 1, a:b],
                                     lu[r: r + 1, a:b], 0.0, False, scale=scale)
        g_q[r: r + 1, a:b] += gq
        flat = u.flat[r, a:b].flatten()
        dk_flat.index_add_(0, flat, gk.reshape(-1, KB, gk.shape[-1]))
        dv_flat.index_add_(0, flat, gv.reshape(-1, KB, gv.shape[-1]))
    u.rows(dq).add_(g_q)
    u.rows(dk).add_(g_k)
    u.rows(dv).add_(g_v)


class _Units:
    """``c`` query blocks of ``QB`` positions from ``P`` on as units: ``(B H, c)``, one row per
    (item, head), one column per query block. :meth:`rows` views any ``(B, H, Np, *)`` tensor that
    way (the kernel's batch and heads; no copy); :meth:`gathered` gathers the units' past key
    blocks in slices."""

    def __init__(self, q: Tensor, ids: Tensor, P: int, QB: int, KB: int, blocks: int):
        B, H, Np, E = q.shape
        c, S = ids.shape[2], ids.shape[3]
        self.P, self.KB, self.S, self.QB, self.c = P, KB, S, QB, c
        # the past blocks' rows in the past keys (``blocks`` blocks per item and head) viewed (B H blocks, KB, E)
        self.flat = (ids + (torch.arange(B * H, device=q.device) * blocks).view(B, H, 1, 1)).reshape(B * H, c, S)
        self.step = max(1, _UNIT_BYTES // (2 * S * KB * E * q.element_size()))

    def rows(self, x: Tensor) -> Tensor:
        """Positions ``P .. P + c QB`` of a contiguous ``x`` ``(B, H, Np, *)`` viewed ``(B H, c, QB, *)``."""
        B, H, Np = x.shape[:3]
        return x.view(B * H, Np, *x.shape[3:])[:, self.P: self.P + self.c * self.QB].unflatten(1, (self.c, self.QB))

    def gathered(self, k: Tensor, v: Tensor):
        """``(r, a, b, keys, values)`` for the units ``a .. b - 1`` of row ``r``: their past key
        blocks gathered, ``(1, b - a, S KB, E)`` each, into two buffers reused slice after slice."""
        E = k.shape[-1]
        kf, vf = k.view(-1, self.KB, E), v.view(-1, self.KB, E)
        n = min(self.c, self.step) * self.S
        bk, bv = k.new_empty(n, self.KB, E), v.new_empty(n, self.KB, E)
        for r in range(self.flat.shape[0]):
            for a in range(0, self.c, self.step):
                b = min(self.c, a + self.step)
                idx = self.flat[r, a:b].flatten()
                kg = torch.index_select(kf, 0, idx, out=bk[: len(idx)])
                vg = torch.index_select(vf, 0, idx, out=bv[: len(idx)])
                yield r, a, b, kg.view(1, b - a, self.S * self.KB, E), vg.view(1, b - a, self.S * self.KB, E)
