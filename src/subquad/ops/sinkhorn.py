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

Also here: :func:`lra_sinkhorn_attention`, the computation of the Long Range Arena reference code
(strided blocks, summed-block contraction, separate softmaxes), kept only as a compatibility mode
for ``MultiheadAttention(method="sinkhorn", lra_compat=True)``; it is not the paper's method.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..registry import register_method
from ._masks import compute_dtype, compute_precision, masked_fill_value
from ..checks import check_bool, check_float, check_int

__all__ = [
    "block_layout",
    "block_means",
    "block_prefix_means",
    "default_sort_logits",
    "gumbel_noise",
    "log_sinkhorn",
    "lra_sinkhorn_attention",
    "lra_sinkhorn_attention_reference",
    "padded_keep",
    "sinkhorn_attention",
    "sinkhorn_attention_reference",
    "soft_permutations",
    "sort_support",
    "strided_block_sums",
]


# ----------------------------------------------------------------------------------------------
# Sinkhorn normalisation and its inputs
# ----------------------------------------------------------------------------------------------


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


# ----------------------------------------------------------------------------------------------
# The op
# ----------------------------------------------------------------------------------------------


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
        r = self.sort_logits
        if r is not None and (not isinstance(r, Tensor) or r.ndim != 4 or not r.is_floating_point()):
            raise ValueError(
                "sinkhorn: sort_logits must be a floating (B, H, NB, NB) tensor or None, got "
                f"{getattr(r, 'shape', type(r).__name__)}"
            )
        if self.generator is not None and not isinstance(self.generator, torch.Generator):
            raise TypeError(
                f"sinkhorn: generator must be a torch.Generator, got {type(self.generator).__name__}"
            )


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


@register_method(
    "sinkhorn",
    options=SinkhornOptions,
    summary="Sparse Sinkhorn attention: blocks + soft block permutation by Gumbel-Sinkhorn (Tay et al. "
    "2020); the op takes sort logits, the module's sort network (sort_net='mlp') is learned",
    causal=True,
    cross_attention=False,
    complexity="linear",
    stochastic=True,
    learned_parameters=False,
)
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
        t = perms.shape[2]

        # sorted slot s of block i is usable when the slot exists (the block has enough allowed
        # sources) and holds real mass; with padding its logit gets + log(real fraction of its
        # mass), so a slot made only of padding is masked and a partly padded one counts less
        exists = counts[..., None] > torch.arange(t, device=q.device)  # (B|1, 1, rows, t)
        slot_ok = exists[..., None].expand(*exists.shape, b)
        slot_bias = None
        if keep is not None:
            real = keep.view(B, 1, 1, nb, b).to(dtype)
            mass = (perms @ real).transpose(2, 3)  # (B, H, rows, t, b)
            total = perms.sum(-1, keepdim=True).transpose(2, 3)  # (B, H, rows, t, 1)
            slot_ok = slot_ok & (mass > 0)
            tiny = torch.finfo(dtype).tiny
            slot_bias = (torch.log(mass.clamp_min(tiny)) - torch.log(total.clamp_min(tiny))).flatten(-2)
        slot_ok = slot_ok.flatten(-2)  # (B|1, H|1, rows, t * b)
        if support is None and t <= nb:
            # no padding, not causal and every slot exists: known from the shapes alone, so no
            # data-dependent branch (torch.compile traces this op with fullgraph=True)
            slot_ok = None

        if sortcut_blocks:  # the first n sorted blocks, (B, H, n, b, d)
            keys, values = _sorted_blocks(perms, kc, b), _sorted_blocks(perms, vc, b)
            out = _sortcut(qc, keys, values, slot_ok, slot_bias, scale)
        elif torch.compiler.is_compiling():  # no out= writes, which dynamo cannot trace
            keys, values = _joint_blocks_batched(perms, kc, b), _joint_blocks_batched(perms, vc, b)
            out = _blocked(qc, keys, values, slot_ok, slot_bias, keep, causal, b, scale)
        elif q.device.type == "cpu" and B * H > 0:
            out = _blocked_per_head(qc, kc, vc, perms, slot_ok, slot_bias, keep, causal, b, scale)
        else:  # [sorted slots ; own block] per block, (B, H, NB, (t + 1) * b, d)
            keys, values = _JointBlocks.apply(perms, kc, b), _JointBlocks.apply(perms, vc, b)
            out = _blocked(qc, keys, values, slot_ok, slot_bias, keep, causal, b, scale)
    return out[:, :, :N].to(q.dtype)


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
    without autograd the two buffers are reused by every head and each head's output goes
    straight into a ``(B, L, H, Dv)`` tensor (the layout of the module's projections, so the
    module's transpose back is free). A whole-batch buffer would be ``2 (t + 1)`` times the
    size of k and v, and fresh memory of that size costs as much here as the sorting itself.
    Returns ``(B, H, L, Dv)`` (a transposed view of that tensor).
    """
    B, H, L, D = qc.shape
    Dv, t, nb = vc.shape[-1], perms.shape[2], L // b
    ok, key_bias = _visibility(slot_ok, slot_bias, keep, causal, b, qc.device)
    tracked = torch.is_grad_enabled() and any(x.requires_grad for x in (qc, kc, vc, perms, slot_bias)
                                              if x is not None)
    if tracked:
        out, bufs = None, (None, None)
    else:
        out = qc.new_empty(B, L, H, Dv)
        bufs = (kc.new_empty(nb, (t + 1) * b, D), vc.new_empty(nb, (t + 1) * b, Dv))
    # unbind, not indexing: the backward of x[i, h] writes a zero tensor of all of x per head
    per_head = [[y.unbind(0) for y in x.unbind(0)] for x in (qc, kc, vc, perms)]
    batches = []
    for i in range(B):
        heads = []
        for h in range(H):
            q_h, k_h, v_h, p = (x[i][h] for x in per_head)
            keys, values = _joint_blocks(p, k_h, b, bufs[0]), _joint_blocks(p, v_h, b, bufs[1])
            ok_h = None if ok is None else ok[min(i, ok.shape[0] - 1), min(h, ok.shape[1] - 1)][None]
            qb, keys = _with_bias_column(q_h.view(nb, b, D), keys, None if key_bias is None else key_bias[i, h], scale)
            o = _attend(qb[None], keys[None], values[None], ok_h, scale)[0]  # (nb, b, Dv)
            if out is None:
                heads.append(o.reshape(L, Dv))
            else:
                out[i, :, h].view(nb, b, Dv).copy_(o)
        if out is None:
            batches.append(torch.stack(heads, dim=1))
    if out is None:
        out = torch.stack(batches)
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


# ----------------------------------------------------------------------------------------------
# Slow reference
# ----------------------------------------------------------------------------------------------


def _reference_padding(q, k, v, key_padding_mask, block_size):
    """For the references: ``(b, NB, L, keep, qp, kp, vp)`` with q, k, v zero-padded to
    ``L = NB * b`` tokens, ``keep`` bool ``(B, L)`` (True = real token) and the padded keys and
    values zeroed."""
    B, H, N, D = q.shape
    b = min(block_size, N)
    nb = -(-N // b)
    L = nb * b
    keep = torch.ones(B, L, dtype=torch.bool)
    keep[:, N:] = False
    if key_padding_mask is not None:
        keep[:, :N] = ~key_padding_mask
    zeros = torch.zeros(B, H, L - N, D, dtype=q.dtype)
    qp, kp = torch.cat([q, zeros], 2), torch.cat([k, zeros], 2)
    vp = torch.cat([v, torch.zeros(B, H, L - N, v.shape[-1], dtype=v.dtype)], 2)
    return b, nb, L, keep, qp, kp * keep[:, None, :, None], vp * keep[:, None, :, None]


def sinkhorn_attention_reference(
    q, k, v, key_padding_mask=None, causal=False, scale=None, *, block_size=64, sinkhorn_iters=7,
    tau=0.75, top_blocks=1, sortcut_blocks=0, sort_logits=None, noise=None,
):
    """Slow, obvious reference of :func:`sinkhorn_attention`: explicit zero padding, summaries
    and logits by loops over blocks, Sinkhorn by division in probability space, and for every
    query an explicit list of keys and one softmax. ``noise``: Gumbel noise ``(B, H, NB, NB)``
    to add to the logits (None: none)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    B, H, N, D = q.shape
    b, nb, L, keep, qp, kp, vp = _reference_padding(q, k, v, key_padding_mask, block_size)
    out = torch.zeros(B, H, L, v.shape[-1], dtype=v.dtype)
    tiny = torch.finfo(q.dtype).tiny

    def mean(x, positions, bi):
        sel = [p for p in positions if keep[bi, p]]
        return x[sel].mean(0) if sel else torch.zeros(x.shape[-1], dtype=x.dtype)

    for bi in range(B):
        valid = [bool(keep[bi, i * b:(i + 1) * b].any()) for i in range(nb)]
        for h in range(H):
            if sort_logits is None:
                r = torch.zeros(nb, nb, dtype=q.dtype)
                for i in range(nb):
                    rows = range(i * b + 1) if causal else range(i * b, (i + 1) * b)
                    qi = mean(qp[bi, h], rows, bi)
                    for j in range(nb):
                        r[i, j] = (qi @ mean(kp[bi, h], range(j * b, (j + 1) * b), bi)) * scale
            else:
                r = sort_logits[min(bi, sort_logits.shape[0] - 1), min(h, sort_logits.shape[1] - 1)].clone()
            if noise is not None:
                r = r + noise[bi, h]
            allowed = torch.zeros(nb, nb, dtype=torch.bool)
            for i in range(nb):
                for j in range(nb):
                    allowed[i, j] = valid[j] and (j < i if causal else valid[i])
            alpha = torch.exp(r / tau - (r / tau).max()) * allowed
            perms = []
            for _ in range(top_blocks):
                a = alpha.clone()
                for p in perms:
                    a = a * (1 - p).clamp_min(tiny)
                rounds = 1 if causal else sinkhorn_iters
                for _ in range(rounds):
                    rs = a.sum(1, keepdim=True)
                    a = torch.where(rs > 0, a / rs.clamp_min(tiny), a)
                    if causal:
                        break
                    cs = a.sum(0, keepdim=True)
                    a = torch.where(cs > 0, a / cs.clamp_min(tiny), a)
                perms.append(a)
            n_sources = allowed.sum(1)

            def slots(i, perms=perms, kx=kp[bi, h], vx=vp[bi, h], real=keep[bi], n_sources=n_sources):
                """Sorted keys, values and logit biases (None = hidden) of destination block i."""
                ks, vs, ok = [], [], []
                for m, p in enumerate(perms):
                    for s in range(b):
                        src = [j * b + s for j in range(nb)]
                        ks.append(sum(p[i, j] * kx[src[j]] for j in range(nb)))
                        vs.append(sum(p[i, j] * vx[src[j]] for j in range(nb)))
                        mass = sum(p[i, j] * float(real[src[j]]) for j in range(nb))
                        usable = bool(n_sources[i] > m) and bool(mass > 0)
                        ok.append(torch.log(mass / p[i].sum()) if usable else None)
                return ks, vs, ok

            if sortcut_blocks:
                ks, vs, ok = [], [], []
                for i in range(min(sortcut_blocks, nb)):
                    a, c, d = slots(i)
                    ks, vs, ok = ks + a, vs + c, ok + d
            for i in range(nb):
                if not sortcut_blocks:
                    ks, vs, ok = slots(i)
                for t in range(i * b, (i + 1) * b):
                    keys = [x for x, u in zip(ks, ok) if u is not None]
                    vals = [x for x, u in zip(vs, ok) if u is not None]
                    bias = [u for u in ok if u is not None]
                    if not sortcut_blocks:
                        for s in range(i * b, (i + 1) * b):
                            if keep[bi, s] and (not causal or s <= t):
                                keys.append(kp[bi, h, s])
                                vals.append(vp[bi, h, s])
                                bias.append(torch.zeros((), dtype=q.dtype))
                    if not keys:
                        continue
                    logits = torch.stack(keys) @ qp[bi, h, t] * scale + torch.stack(bias)
                    w = torch.softmax(logits, 0)
                    out[bi, h, t] = w @ torch.stack(vals)
    return out[:, :, :N]


# ----------------------------------------------------------------------------------------------
# LRA-reference computation (compatibility mode)
# ----------------------------------------------------------------------------------------------


def strided_block_sums(x: Tensor, block_size: int, keep: Tensor | None = None) -> Tensor:
    """Sums over the *strided* blocks of the LRA reference code: x ``(B, H, L, d)`` with
    ``L = NB * b`` -> ``(B, H, NB, d)``, block n = positions ``{n, n + NB, n + 2 NB, ...}``.
    Padded tokens (``keep`` False) count as zero."""
    nb = x.shape[2] // block_size
    if keep is not None:
        x = x.masked_fill(~keep[:, None, :, None], 0.0)
    return x.unflatten(2, (block_size, nb)).sum(2)


def lra_sinkhorn_attention(
    q: Tensor, k: Tensor, v: Tensor, permutation: Tensor, *, key_padding_mask: Tensor | None = None,
    block_size: int = 50, scale: float | None = None,
) -> Tensor:
    """What the Long Range Arena reference code computes for "Sinkhorn attention" (a
    compatibility mode, not the paper's method; see the spec's section 3.1).

    q, k ``(B, H, N, D)``, v ``(B, H, N, Dv)``; ``permutation`` ``(B, H, NB, P)`` from the LRA sort
    network (a row softmax; NB = ceil(N / b)). The sequence is padded to ``L = NB * b`` and
    reshaped so that block n holds the *strided* positions ``{n + s * NB}``:

    - local branch: each strided block attends to itself;
    - "sorted" branch: the LRA contraction sums the block index and the permutation's last index
      independently, so every sorted block is ``rowsum(P) * chunk sums``, where slot s is the sum
      of the contiguous chunk ``[s * NB, (s + 1) * NB)`` of keys (values): attention over b
      sum-pooled chunks, independent of the sort network's choice;
    - the two branches use separate softmaxes and their outputs are added.

    Padding is applied consistently (the LRA code builds its padding mask with a contiguous
    reshape that does not match its strided blocks; that mismatch is not reproduced): padded
    keys are masked locally and zeroed in the chunk sums, an all-padding chunk is masked.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    B, H, N, _ = q.shape
    Dv = v.shape[-1]
    b, nb = block_layout(N, block_size)
    L = nb * b
    dtype = compute_dtype(q.dtype)
    with compute_precision(q):
        qc, kc, vc = (_pad_to(t.to(dtype), L) for t in (q, k, v))
        keep = padded_keep(key_padding_mask, B, N, L, q.device)
        if keep is not None:
            kc = kc.masked_fill(~keep[:, None, :, None], 0.0)
            vc = vc.masked_fill(~keep[:, None, :, None], 0.0)

        def strided(x):  # (B, H, L, d) -> (B, H, NB, b, d): block n, offset s = position s * NB + n
            return x.unflatten(2, (b, nb)).transpose(2, 3)

        qs, ks, vs = strided(qc), strided(kc), strided(vc)
        local_ok = None if keep is None else strided(keep[:, None, :, None])[..., 0][:, :, :, None, :]
        local = _attend(qs, ks, vs, local_ok, scale)

        row_sum = permutation.to(dtype).sum(-1)[..., None, None]  # (B, H, NB, 1, 1), 1 for a softmax
        pooled_k = kc.unflatten(2, (b, nb)).sum(3)[:, :, None] * row_sum  # (B, H, NB, b, D)
        pooled_v = vc.unflatten(2, (b, nb)).sum(3)[:, :, None] * row_sum
        chunk_ok = None
        if keep is not None:
            chunk_ok = keep.view(B, b, nb).any(-1)[:, None, None, None, :]
        pooled = _attend(qs, pooled_k, pooled_v, chunk_ok, scale)
        out = (local + pooled).transpose(2, 3).reshape(B, H, L, Dv)
    return out[:, :, :N].to(q.dtype)


def lra_sinkhorn_attention_reference(q, k, v, permutation, key_padding_mask=None, block_size=50, scale=None):
    """Slow reference of :func:`lra_sinkhorn_attention`: the LRA einsum written out literally
    (``sorted[s, n] = sum_k sum_l key[s, k] P[n, l]``) and explicit softmaxes per query."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    B, H, N, D = q.shape
    b, nb, L, keep, qp, kp, vp = _reference_padding(q, k, v, key_padding_mask, block_size)
    # LRA layout: (B, b, NB, H, d) with [s, n] = position s * NB + n
    kb = kp.permute(0, 2, 1, 3).reshape(B, b, nb, H, D)
    vb = vp.permute(0, 2, 1, 3).reshape(B, b, nb, H, -1)
    perm = permutation.permute(0, 2, 1, 3)  # (B, NB, H, P)
    sorted_k = torch.einsum("bskhd,bnhl->bsnhd", kb, perm)
    sorted_v = torch.einsum("bskhd,bnhl->bsnhd", vb, perm)
    out = torch.zeros(B, H, L, v.shape[-1], dtype=v.dtype)
    for bi in range(B):
        for h in range(H):
            for n in range(nb):
                positions = [s * nb + n for s in range(b)]
                chunk_real = [bool(keep[bi, s * nb:(s + 1) * nb].any()) for s in range(b)]
                for pos in positions:
                    y = torch.zeros(v.shape[-1], dtype=v.dtype)
                    real = [p for p in positions if keep[bi, p]]
                    if real:
                        w = torch.softmax(kp[bi, h, real] @ qp[bi, h, pos] * scale, 0)
                        y = y + w @ vp[bi, h, real]
                    slots = [s for s in range(b) if chunk_real[s]]
                    if slots:
                        w = torch.softmax(sorted_k[bi, slots, n, h] @ qp[bi, h, pos] * scale, 0)
                        y = y + w @ sorted_v[bi, slots, n, h]
                    out[bi, h, pos] = y
    return out[:, :, :N]
