"""Sparse Sinkhorn attention (Tay et al. 2020): the sequence is cut into contiguous blocks of
``block_size`` tokens; a soft permutation ``P = S(R)`` of the blocks, the Sinkhorn normalisation of
sorting logits ``R`` ``(B, H, NB, NB)``, gives every query block a *sorted block*
``sum_j P_ij block_j`` (keys and values sorted with the same ``P``); each query attends to its
sorted block and its own block in one softmax.

Cost per head, with ``NB = N / b``: ``O(N b d)`` for the block attention, ``O(NB^2 b d) = O(N^2 d / b)``
for sorting the blocks and ``O(NB^2)`` memory for ``P`` (the method's own ``O(b^2 + NB^2)``).
Nothing of size N x N is formed, forward or backward: at a fixed block size the ``NB^2`` terms are
``1 / b^2`` of an N x N matrix, so memory is dominated by the ``O(N b)`` part up to ``N ~ b^3``.

Convention (as the spec): row i of ``P`` is the destination (the query block that receives),
column j the source block.

Beside it (:mod:`.lra`): :func:`lra_sinkhorn_attention`, the computation of the Long Range Arena
reference code (strided blocks, summed-block contraction, separate softmaxes), kept only as a
compatibility mode for ``MultiheadAttention(method="sinkhorn", lra_compat=True)``; it is not the
paper's method. The block structure both share is in :mod:`.blocks`; the slow reference of both in ``naive.py``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ...checks import check_bool, check_float, check_int
from ...registry import register_method
from .._common import check_generator, check_tensor_option, over_threads
from .._masks import compute_dtype, compute_precision
from .blocks import (
    _attend,
    _pad_to,
    _slot_counts,
    block_layout,
    block_means,
    block_prefix_means,
    default_sort_logits,
    gumbel_noise,
    log_sinkhorn,
    padded_keep,
    soft_permutations,
    sort_support,
)
from .lra import lra_sinkhorn_attention, strided_block_sums

__all__ = [
    "SinkhornOptions",
    "block_layout",
    "block_means",
    "block_prefix_means",
    "default_sort_logits",
    "flops",
    "gumbel_noise",
    "log_sinkhorn",
    "lra_sinkhorn_attention",
    "padded_keep",
    "sinkhorn_attention",
    "soft_permutations",
    "sort_support",
    "strided_block_sums",
]


@dataclass
class SinkhornOptions:
    """Options of :func:`sinkhorn_attention`.

    block_size: tokens per block b (clipped to N; the length is padded to a multiple of b).
    sinkhorn_iters: Sinkhorn rounds (row then column normalisation); causal uses row
        normalisation only, so extra rounds change nothing there.
    tau: temperature; ``P = S((R + g) / tau)``, smaller is closer to a hard permutation.
    top_blocks: sorted blocks per query block (>= 1); slot m excludes the earlier slots' choices.
    sortcut_blocks: 0 (off) or n: SortCut, every query attends to the first n sorted blocks
        only (n * b keys, no local block). Encoder only.
    sort_logits: ``(B, H, NB, NB)`` sorting logits (batch and head dims may be 1), e.g. from a
        sort network; None: ``R_ij = <mean q_i, mean k_j> * scale`` from masked block means.
    training: add Gumbel noise to the logits (Gumbel-Sinkhorn); False gives a deterministic op.
    generator: source of the Gumbel noise.
    """

    block_size: int = 64
    sinkhorn_iters: int = 7
    tau: float = 0.75
    top_blocks: int = 1
    sortcut_blocks: int = 0
    sort_logits: Tensor | None = None
    training: bool = False
    generator: torch.Generator | None = None

    def __post_init__(self):
        check_int("sinkhorn", "block_size", self.block_size, minimum=1)
        check_int("sinkhorn", "sinkhorn_iters", self.sinkhorn_iters, minimum=1)
        check_float("sinkhorn", "tau", self.tau, minimum=0.0, inclusive=False)
        check_int("sinkhorn", "top_blocks", self.top_blocks, minimum=1)
        check_int("sinkhorn", "sortcut_blocks", self.sortcut_blocks, minimum=0)
        check_bool("sinkhorn", "training", self.training)
        if self.sortcut_blocks and self.top_blocks != 1:
            raise ValueError(
                f"sinkhorn: sortcut_blocks={self.sortcut_blocks} takes the first sorted blocks of one "
                f"permutation; top_blocks must be 1 with SortCut, got {self.top_blocks}"
            )
        check_tensor_option("sinkhorn", "sort_logits", self.sort_logits, "(B, H, NB, NB)", or_none=True)
        check_generator("sinkhorn", self.generator)


def _check_sort_logits(r: Tensor, batch: int, heads: int, num_blocks: int, n: int, b: int, device) -> None:
    want = (batch, heads, num_blocks, num_blocks)
    ok = (
        r.shape[0] in (1, batch) and r.shape[1] in (1, heads)
        and r.shape[2] == num_blocks and r.shape[3] == num_blocks
    )
    if not ok:
        raise ValueError(
            f"sinkhorn: sort_logits must have shape (B, H, NB, NB) = {want} (NB = ceil(N / block_size) "
            f"with N={n}, block_size={b}; B and H may be 1), got {tuple(r.shape)}"
        )
    if r.device != device:
        raise ValueError(f"sinkhorn: sort_logits is on {r.device}, q on {device}")


def flops(B, H, N, M, D, Dv, o):
    """Matmul FLOPs of one non-causal forward (:mod:`subquad.compare.flops`)."""
    b = min(o["block_size"], N)
    nb = -(-N // b)
    t = o["top_blocks"]
    rows = min(o["sortcut_blocks"], nb) if o["sortcut_blocks"] else nb
    padded = N % b != 0  # padded to whole blocks: slots carry a logit bias for their real mass
    per_head = 0
    if o.get("sort_logits") is None:
        per_head += 2 * nb * nb * D  # block-mean sorting logits
    per_head += 2 * t * rows * nb * b * (D + Dv)  # sorted keys and values
    # queries against their keys; with padding the bias rides along as one more key coordinate
    d_logits = D + 1 if padded else D
    if padded:
        per_head += 2 * t * rows * nb * b  # the real mass of every sorted slot
    if o["sortcut_blocks"]:
        per_head += 2 * nb * b * rows * b * (d_logits + Dv)
    else:
        per_head += 2 * nb * b * (t + 1) * b * (d_logits + Dv)  # each block vs [sorted ; own]
    return B * H * per_head


def _whole_blocks(o: SinkhornOptions) -> int:
    """What a padded batch's length should divide by: the block size (no partial block padded inside)."""
    return o.block_size


@register_method("sinkhorn", options=SinkhornOptions,
                 summary="Sparse Sinkhorn attention: blocks + soft block permutation by Gumbel-Sinkhorn (Tay et al. "
                 "2020); the op takes sort logits, the module's sort network (sort_net='mlp') is learned",
                 causal=True, cross_attention=False, complexity="linear", stochastic=True, learned_parameters=False,
                 core="subquad.layers.sinkhorn:SinkhornCore", flops=flops,
                 peer="subquad.compare.peers:SINKHORN_TRANSFORMER",
                 # small blocks, so the tiny test lengths hold several blocks and the sorting runs
                 test_options={"block_size": 4},
                 sampling_options={"training": True},  # Gumbel noise
                 length_multiple=_whole_blocks)
def sinkhorn_attention(
    q, k, v, key_padding_mask, causal, scale, *, block_size, sinkhorn_iters, tau, top_blocks,
    sortcut_blocks, sort_logits, training, generator,
):
    """Sparse Sinkhorn attention (self-attention).

    Shapes: q, k ``(B, H, N, D)``, v ``(B, H, N, Dv)`` -> ``(B, H, N, Dv)``.

    Query block i attends, in one softmax, to its ``top_blocks`` sorted blocks
    ``sum_j P_ij K_j`` / ``sum_j P_ij V_j`` and to its own block. Padding (the key padding mask,
    which in self-attention also marks padded queries, and the internal padding up to a multiple
    of the block size): padded keys and values are zeroed before sorting, empty blocks are
    dropped from the Sinkhorn problem, local padded keys are masked, and a sorted key slot made
    only of padding is masked; a partly padded slot gets the logit bias ``log(real fraction of its
    mass)`` (a smooth form of the spec's "mask when less than half is real", which has ties and no
    gradient). A query that sees no unmasked key outputs 0.

    Causal: block i receives only blocks j < i (row normalisation over that support, no column
    normalisation, which would mix in later rows); block 0 gets a null block (no sorted keys);
    the default logits use prefix summaries; the local block has a token-level causal mask.
    SortCut (``sortcut_blocks=n``): every query attends to the first n sorted blocks only.
    Math in float32 under autocast (float64 stays float64); the result has the dtype of q.
    """
    if causal and sortcut_blocks:
        raise NotImplementedError(
            "sinkhorn: SortCut (sortcut_blocks > 0) lets every query see the same selected blocks, "
            "so it is not causal; use sortcut_blocks=0 with causal=True"
        )
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    B, H, N, D = q.shape
    b, nb = block_layout(N, block_size)
    L = nb * b
    if sort_logits is not None:
        _check_sort_logits(sort_logits, B, H, nb, N, block_size, q.device)
    dtype = compute_dtype(q.dtype)
    with compute_precision(q):
        qc, kc, vc = (_pad_to(t.to(dtype), L) for t in (q, k, v))
        keep = padded_keep(key_padding_mask, B, N, L, q.device)
        valid = None
        if keep is not None:
            pad4 = ~keep[:, None, :, None]
            kc = kc.masked_fill(pad4, 0.0)
            vc = vc.masked_fill(pad4, 0.0)
            valid = keep.view(B, nb, b).any(-1)

        # soft permutations of the blocks
        if sort_logits is None:
            logits = default_sort_logits(qc, kc, b, keep, causal, scale)
        else:
            logits = sort_logits.to(dtype).expand(B, H, nb, nb)
        if training:
            logits = logits + gumbel_noise(logits.shape, generator=generator, dtype=dtype, device=q.device)
        support = sort_support(valid, nb, causal, q.device)
        perms = soft_permutations(
            logits / tau, iterations=sinkhorn_iters, top_blocks=top_blocks, support=support, causal=causal
        )  # (B, H, t, NB, NB)
        counts = _slot_counts(support, nb, q.device)  # (B|1, 1, NB)
        if sortcut_blocks:
            n_cut = min(sortcut_blocks, nb)
            perms = perms[:, :, :, :n_cut]
            counts = counts[..., :n_cut]
        slot_ok, slot_bias = _slot_visibility(perms, counts, keep, support is None, b)
        out = _sorted_attention(qc, kc, vc, perms, slot_ok, slot_bias, keep, causal, b, scale, sortcut_blocks)
    return out[:, :, :N].to(q.dtype)


def _slot_visibility(perms: Tensor, counts: Tensor, keep: Tensor | None, unrestricted: bool, b: int):
    """Which sorted key slots a query block sees, and their logit bias.

    Sorted slot s of block i is usable when the slot exists (the block has enough allowed
    sources, ``counts`` ``(B|1, 1, rows)``) and holds real mass; with padding (``keep``) its logit
    gets + log(real fraction of its mass), so a slot made only of padding is masked and a partly
    padded one counts less. Returns ``slot_ok`` bool ``(B|1, H|1, rows, t * b)`` or None (every
    slot visible: ``unrestricted``, i.e. no padding and not causal, with t <= NB) and
    ``slot_bias`` ``(B, H, rows, t * b)`` or None (no padding)."""
    t, nb = perms.shape[2], perms.shape[-1]
    exists = counts[..., None] > torch.arange(t, device=perms.device)  # (B|1, 1, rows, t)
    slot_ok = exists[..., None].expand(*exists.shape, b)
    slot_bias = None
    if keep is not None:
        real = keep.view(keep.shape[0], 1, 1, nb, b).to(perms.dtype)
        mass = (perms @ real).transpose(2, 3)  # (B, H, rows, t, b)
        total = perms.sum(-1, keepdim=True).transpose(2, 3)  # (B, H, rows, t, 1)
        slot_ok = slot_ok & (mass > 0)
        tiny = torch.finfo(perms.dtype).tiny
        slot_bias = (torch.log(mass.clamp_min(tiny)) - torch.log(total.clamp_min(tiny))).flatten(-2)
    slot_ok = slot_ok.flatten(-2)  # (B|1, H|1, rows, t * b)
    if unrestricted and t <= nb:
        # no padding, not causal and every slot exists: known from the shapes alone, so no
        # data-dependent branch (torch.compile traces this op with fullgraph=True)
        slot_ok = None
    return slot_ok, slot_bias


def _sorted_attention(qc, kc, vc, perms, slot_ok, slot_bias, keep, causal, b, scale, sortcut_blocks):
    """Every query block against its sorted slots (and, without SortCut, its own block), on the
    path that suits the call: SortCut, traced by torch.compile, per head on CPU, or batched."""
    B, H = qc.shape[:2]
    if sortcut_blocks:  # the first n sorted blocks, (B, H, n, b, d)
        keys, values = _sorted_blocks(perms, kc, b), _sorted_blocks(perms, vc, b)
        return _sortcut(qc, keys, values, slot_ok, slot_bias, scale)
    if torch.compiler.is_compiling():  # no out= writes, which dynamo cannot trace
        keys, values = _joint_blocks_batched(perms, kc, b), _joint_blocks_batched(perms, vc, b)
        return _blocked(qc, keys, values, slot_ok, slot_bias, keep, causal, b, scale)
    if qc.device.type == "cpu" and B * H > 0:
        return _blocked_per_head(qc, kc, vc, perms, slot_ok, slot_bias, keep, causal, b, scale)
    # [sorted slots ; own block] per block, (B, H, NB, (t + 1) * b, d)
    keys, values = _JointBlocks.apply(perms, kc, b), _JointBlocks.apply(perms, vc, b)
    return _blocked(qc, keys, values, slot_ok, slot_bias, keep, causal, b, scale)


def _with_bias_column(q: Tensor, keys: Tensor, key_bias: Tensor | None, scale: float) -> tuple[Tensor, Tensor]:
    """Fold a per-key logit bias into the dot product: ``q' = [q, 1]``, ``k' = [k, bias / scale]``,
    so ``q' . k' * scale = q . k * scale + bias``. The attention mask stays a constant (the fused
    kernels take it, with or without autograd) and the bias keeps its gradient."""
    if key_bias is None:
        return q, keys
    q = torch.cat([q, q.new_ones(()).expand(*q.shape[:-1], 1)], dim=-1)
    return q, torch.cat([keys, (key_bias / scale)[..., None]], dim=-1)


def _sorted_blocks(perms: Tensor, x: Tensor, b: int) -> Tensor:
    """Sorted blocks of x ``(B, H, L, d)`` under ``perms`` ``(B, H, t, rows, NB)``:
    ``(B, H, rows, t * b, d)``, slot-major."""
    B, H, t, rows, nb = perms.shape
    d = x.shape[-1]
    y = (perms @ x.reshape(B, H, 1, nb, b * d)).unflatten(-1, (b, d))  # (B, H, t, rows, b, d)
    return y.transpose(2, 3).reshape(B, H, rows, t * b, d)


def _joint_blocks_batched(perms: Tensor, x: Tensor, b: int) -> Tensor:
    """What :class:`_JointBlocks` computes, with plain autograd ops (for ``torch.compile``):
    ``(B, H, NB, (t + 1) * b, d)`` from ``perms`` ``(B, H, t, NB, NB)`` and x ``(B, H, L, d)``."""
    B, H, t, nb, _ = perms.shape
    d = x.shape[-1]
    local = x.reshape(B, H, nb, b * d)
    joint = torch.cat([*(perms[:, :, m] @ local for m in range(t)), local], dim=-1)
    return joint.view(B, H, nb, (t + 1) * b, d)


class _JointBlocks(torch.autograd.Function):
    """``J[:, :, i] = [sum_j P1_ij x_j ; ... ; sum_j Pt_ij x_j ; x_i]``: the keys (or values) of
    every query block, ``(B, H, NB, (t + 1) * b, d)`` from ``perms`` ``(B, H, t, NB, NB)`` and x
    ``(B, H, L, d)``. Built in place (the sorting matmuls write straight into their slots), which
    saves two copies of x per call; the backward is the matching pair of matmuls."""

    @staticmethod
    def forward(ctx, perms, x, b):
        B, H, t, nb, _ = perms.shape
        d = x.shape[-1]
        joint = x.new_empty(B, H, nb, (t + 1) * b, d)
        local = joint[:, :, :, t * b:]
        local.copy_(x.view(B, H, nb, b, d))
        source = local.view(B, H, nb, b * d)
        for m in range(t):
            torch.matmul(perms[:, :, m], source, out=joint[:, :, :, m * b:(m + 1) * b].view(B, H, nb, b * d))
        ctx.save_for_backward(perms, joint)
        ctx.b = b
        return joint

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        perms, joint = ctx.saved_tensors
        b = ctx.b
        B, H, t, nb, _ = perms.shape
        d = joint.shape[-1]
        source = joint[:, :, :, t * b:].reshape(B, H, nb, b * d)
        grad_perms = torch.empty_like(perms) if ctx.needs_input_grad[0] else None
        grad_x = None
        if ctx.needs_input_grad[1]:
            grad_x = grad[:, :, :, t * b:].reshape(B, H, nb, b * d).clone()
        for m in range(t):
            g = grad[:, :, :, m * b:(m + 1) * b].reshape(B, H, nb, b * d)
            if grad_x is not None:
                grad_x.add_(perms[:, :, m].transpose(-2, -1) @ g)
            if grad_perms is not None:
                grad_perms[:, :, m] = g @ source.transpose(-2, -1)
        return grad_perms, None if grad_x is None else grad_x.view(B, H, nb * b, d), None


def _visibility(slot_ok, slot_bias, keep, causal, b, device):
    """Key visibility and logit bias over ``[sorted slots ; own block]``: ``ok`` bool
    ``(B|1, H|1, NB, b|1, (t + 1) * b)`` and ``key_bias`` ``(B, H, NB, (t + 1) * b)`` (0 for the
    local keys) or None; ``ok`` is None when every key is visible (``slot_ok`` None: every
    sorted slot is visible, which the op passes only without padding and causality)."""
    if slot_ok is None:
        return None, None
    nb = slot_ok.shape[2]
    local = torch.ones(1, 1, 1, 1, b, dtype=torch.bool, device=device)
    if keep is not None:
        local = keep.view(keep.shape[0], 1, nb, 1, b)
    if causal:
        local = local & torch.ones(b, b, dtype=torch.bool, device=device).tril_()
    sorted_ok = slot_ok[:, :, :, None, :]
    shape = torch.broadcast_shapes(sorted_ok.shape[:-1], local.shape[:-1])
    ok = torch.cat([sorted_ok.expand(*shape, -1), local.expand(*shape, -1)], dim=-1)
    key_bias = None
    if slot_bias is not None:
        key_bias = F.pad(torch.where(slot_ok, slot_bias, 0.0), (0, b))
    return ok, key_bias


def _blocked(qc, keys, values, slot_ok, slot_bias, keep, causal, b, scale):
    """Each query block against [its sorted slots ; its own block] (``keys``, ``values``
    ``(B, H, NB, (t + 1) * b, d)``) in one softmax; all heads in one batched call."""
    B, H, L, D = qc.shape
    qb = qc.view(B, H, L // b, b, D)
    ok, key_bias = _visibility(slot_ok, slot_bias, keep, causal, b, qc.device)
    qb, keys = _with_bias_column(qb, keys, key_bias, scale)
    return _attend(qb, keys, values, ok, scale).reshape(B, H, L, values.shape[-1])


def _blocked_per_head(qc, kc, vc, perms, slot_ok, slot_bias, keep, causal, b, scale):
    """:func:`_blocked` with the sorting, one (batch, head) at a time: what the CPU runs.

    Each head's ``[sorted slots ; own block]`` keys and values ``(NB, (t + 1) * b, d)`` are
    built in one buffer (the own block copied in, the sorted slots written by their matmuls);
    without autograd the heads run on torch's threads one whole head each
    (:func:`subquad.ops._common.over_threads`, robust to busy cores), the two buffers are reused
    by every head of a thread and each head's output goes straight into a ``(B, L, H, Dv)``
    tensor (the layout of the module's projections, so the module's transpose back is free).
    A whole-batch buffer would be ``2 (t + 1)`` times the size of k and v, and fresh memory of
    that size costs as much here as the sorting itself.
    Returns ``(B, H, L, Dv)`` (a transposed view of that tensor).
    """
    B, H, L, D = qc.shape
    Dv, t, nb = vc.shape[-1], perms.shape[2], L // b
    ok, key_bias = _visibility(slot_ok, slot_bias, keep, causal, b, qc.device)
    # unbind, not indexing: the backward of x[i, h] writes a zero tensor of all of x per head
    per_head = [[y.unbind(0) for y in x.unbind(0)] for x in (qc, kc, vc, perms)]

    def head(i: int, h: int, bufs) -> Tensor:  # (nb, b, Dv)
        q_h, k_h, v_h, p = (x[i][h] for x in per_head)
        keys, values = _joint_blocks(p, k_h, b, bufs[0]), _joint_blocks(p, v_h, b, bufs[1])
        ok_h = None if ok is None else ok[min(i, ok.shape[0] - 1), min(h, ok.shape[1] - 1)][None]
        qb, keys = _with_bias_column(q_h.view(nb, b, D), keys, None if key_bias is None else key_bias[i, h], scale)
        return _attend(qb[None], keys[None], values[None], ok_h, scale)[0]

    tracked = torch.is_grad_enabled() and any(x.requires_grad for x in (qc, kc, vc, perms, slot_bias)
                                              if x is not None)
    if tracked:
        heads = [torch.stack([head(i, h, (None, None)).reshape(L, Dv) for h in range(H)], dim=1) for i in range(B)]
        return torch.stack(heads).transpose(1, 2)
    out = qc.new_empty(B, L, H, Dv)
    scratch = threading.local()  # each worker thread's two buffers, reused by every head it runs

    def write(j: int) -> None:
        i, h = divmod(j, H)
        if not hasattr(scratch, "bufs"):
            scratch.bufs = (kc.new_empty(nb, (t + 1) * b, D), vc.new_empty(nb, (t + 1) * b, Dv))
        out[i, :, h].view(nb, b, Dv).copy_(head(i, h, scratch.bufs))

    over_threads(write, B * H)
    return out.transpose(1, 2)


def _joint_blocks(perms: Tensor, x: Tensor, b: int, buf: Tensor | None) -> Tensor:
    """``[sum_j P1_ij x_j ; ... ; sum_j Pt_ij x_j ; x_i]`` for every block i of one head:
    ``(NB, (t + 1) * b, d)`` from ``perms`` ``(t, NB, NB)`` and x ``(L, d)``. Written into
    ``buf`` when given (no autograd), else built with autograd-friendly ops."""
    t, nb = perms.shape[:2]
    d = x.shape[-1]
    if buf is None:
        local = x.reshape(nb, b * d)
        return torch.cat([*(perms[m] @ local for m in range(t)), local], dim=1).view(nb, (t + 1) * b, d)
    buf[:, t * b:].copy_(x.view(nb, b, d))
    local = buf[:, t * b:].flatten(1)
    for m in range(t):
        torch.mm(perms[m], local, out=buf[:, m * b:(m + 1) * b].flatten(1))
    return buf


def _sortcut(qc, sorted_k, sorted_v, slot_ok, slot_bias, scale):
    """Every query against the first n sorted blocks (``n * b`` keys), no local block."""
    keys = sorted_k.flatten(2, 3)  # (B, H, n * b, D)
    values = sorted_v.flatten(2, 3)
    ok = None if slot_ok is None else slot_ok.flatten(-2)[:, :, None, :]  # (B|1, H|1, 1, n * b)
    key_bias = None
    if slot_bias is not None:
        key_bias = torch.where(slot_ok, slot_bias, 0.0).flatten(-2)
    qc, keys = _with_bias_column(qc, keys, key_bias, scale)
    return _attend(qc, keys, values, ok, scale)

