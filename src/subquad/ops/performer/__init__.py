"""Performer / FAVOR+ (Choromanski et al. 2021): softmax attention approximated with positive
random features, ``exp(q.k) = E_w[phi_w(q) phi_w(k)]`` with
``phi_w(x) = m^{-1/2} exp(w.x - |x|^2 / 2)`` and ``w ~ N(0, I)``.
"""

from __future__ import annotations

import math
import threading
from itertools import repeat
from dataclasses import dataclass

import torch
from torch import Tensor

from ...checks import check_bool, check_float, check_int
from ...registry import register_method
from .._common import check_generator, check_tensor_option, one_thread, over_threads
from .._masks import compute_dtype, compute_precision, masked_fill_value, no_key_rows
from .._sharded import Shards
from ..linear import _safe_den, kernel_attention

__all__ = ["PerformerOptions", "flops", "performer_attention", "performer_features", "random_projection"]


def random_projection(
    num_features: int,
    dim: int,
    *,
    orthogonal: bool = True,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> Tensor:
    """A ``(num_features, dim)`` matrix of Gaussian directions.

    ``orthogonal=True``: rows are exactly orthogonal within each block of ``dim`` rows (Q of the
    QR decomposition of a Gaussian matrix, sign-corrected so it is Haar-distributed), and each
    row is rescaled to the norm of an independent N(0, I_dim) draw (chi_dim), so every row is
    still marginally N(0, I). ``orthogonal=False``: i.i.d. N(0, 1) entries.
    The draw happens on the generator's device (CPU by default), then moves to ``device``.
    """
    gen_device = generator.device if generator is not None else torch.device("cpu")
    draw_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    if not orthogonal:
        w = torch.randn(num_features, dim, generator=generator, dtype=draw_dtype, device=gen_device)
    else:
        n_blocks = -(-num_features // dim)
        g = torch.randn(n_blocks, dim, dim, generator=generator, dtype=draw_dtype, device=gen_device)
        with one_thread(gen_device.type == "cpu"):  # a batch of small QRs: no gain from threads
            qm, r = torch.linalg.qr(g)
        qm = qm * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)
        blocks = qm.transpose(-2, -1)  # rows of each block are orthonormal
        w = blocks.reshape(n_blocks * dim, dim)[:num_features]
        norms = torch.randn(num_features, dim, generator=generator, dtype=draw_dtype, device=gen_device)
        w = w * norms.norm(dim=-1, keepdim=True)
    return w.to(device=device if device is not None else gen_device, dtype=dtype)


# rows per block of the streamed path are chosen so a (rows, m) block has this many elements
# (4 MiB in float32): it stays in cache between the matmul, the exponential and the next matmul
_BLOCK_ELEMENTS = 1 << 20
# exp(x) = exp2(x log2 e); torch's exp2 kernel is about twice as fast as exp on this CPU
_LOG2E = 1.0 / math.log(2.0)


class _ShiftedExp(torch.autograd.Function):
    """``exp(logits - shift) + eps`` computed in place over the (B, H, L, m) logits: the
    feature maps are the largest tensors of the method, and each extra pass over them costs
    as much as a matmul. ``shift`` is a detached stabiliser (no gradient)."""

    @staticmethod
    def forward(ctx, logits, shift, eps):
        out = logits.sub_(shift).exp_()
        if eps:
            out.add_(eps)
        ctx.mark_dirty(logits)
        ctx.save_for_backward(out)
        ctx.eps = eps
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        return grad * (out - ctx.eps if ctx.eps else out), None, None


def performer_features(
    x: Tensor,
    projection: Tensor,
    *,
    kind: str,
    scale: float = 1.0,
    key_padding_mask: Tensor | None = None,
    causal: bool = False,
    eps: float = 0.0,
    shards: Shards | None = None,
) -> Tensor:
    """Positive random features of ``x`` ``(B, H, L, D)`` for ``projection`` ``(m, D)``,
    with ``x`` taken in paper units ``x' = sqrt(scale) x``; returns ``(B, H, L, m)``.

    ``kind="raw"``: the unbiased ``m^{-1/2} exp(w.x' - |x'|^2/2)``.
    ``kind="query"``: the raw features times a per-row constant, which cancels in the normalised
    output: ``softmax_i(w_i.x')`` (the ``|x'|^2/2`` term is per-row too). Its largest entry is
    at least ``1/m``, so a query's features are never all zero and need no ``eps``.
    ``kind="key"``: ``exp(w.x' - |x'|^2/2 - c) + eps`` with one constant ``c`` per (batch, head)
    that cancels too: the max over real keys and features (with ``shards``: over every rank's),
    or, when ``causal``, the
    data-independent bound ``max_i |w_i|^2/2`` (``w.x' - |x'|^2/2 <= |w|^2/2``), so that no
    future key can change a past output. Stabilisers are detached.
    """
    B, H, L, D = x.shape
    # w.x' as one matmul over all (B, H, L) rows
    logits = torch.mm(x.reshape(-1, D), projection.t() * math.sqrt(scale)).view(B, H, L, projection.shape[0])
    if kind == "query":
        return torch.softmax(logits, dim=-1)
    half_sq = torch.linalg.vector_norm(x, dim=-1, keepdim=True).square().mul(0.5 * scale)
    logits = logits.sub_(half_sq)  # in place: the matmul does not need its output for backward
    if kind == "raw":
        return torch.exp(logits) * projection.shape[0] ** -0.5
    if kind == "key":
        if causal:
            shift = (projection.detach() ** 2).sum(-1).amax() / 2
        elif key_padding_mask is None:
            shift = logits.detach().amax((-2, -1), keepdim=True)
        else:
            masked = logits.detach().masked_fill(
                key_padding_mask[:, None, :, None], masked_fill_value(logits.dtype)
            )
            shift = masked.amax((-2, -1), keepdim=True)
        if shards is not None and not causal:
            shift = shards.max(shift)
    else:
        raise ValueError(f"kind must be 'raw', 'query' or 'key', got {kind!r}")
    if torch.compiler.is_compiling():  # the compiler fuses these passes itself (and cannot trace mark_dirty)
        out = torch.exp(logits - shift)
        return out + eps if eps else out
    return _ShiftedExp.apply(logits, shift, eps)


@dataclass
class PerformerOptions:
    """Options of :func:`performer_attention`.

    num_features: number m of random features.
    orthogonal: orthogonal random features (True) or i.i.d. Gaussian rows.
    features: a user-supplied ``(m, D)`` projection; when given it is used as is and
        ``num_features``, ``orthogonal`` and ``generator`` are not used.
    generator: source of the random projection drawn when ``features`` is None.
    eps: numerical stabiliser added to every key feature of the non-causal path (1e-6 as in
        the JAX reference, relative to the largest key feature). The causal path adds none: its
        key stabiliser is a data-independent bound far above the real logits, so an absolute
        eps would swamp the features (see ``performer_attention``). Query features need none.
    chunk_size: tokens per chunk of the causal computation.
    """

    num_features: int = 256
    orthogonal: bool = True
    features: Tensor | None = None
    generator: torch.Generator | None = None
    eps: float = 1e-6
    chunk_size: int = 64

    def __post_init__(self):
        check_int("performer", "num_features", self.num_features, minimum=1)
        check_bool("performer", "orthogonal", self.orthogonal)
        check_float("performer", "eps", self.eps, minimum=0.0)
        check_int("performer", "chunk_size", self.chunk_size, minimum=1)
        check_tensor_option("performer", "features", self.features, "(m, D)")
        check_generator("performer", self.generator)


def flops(B, H, N, M, D, Dv, o):
    """Matmul FLOPs of one non-causal forward (:mod:`subquad.compare.flops`): the projections
    w.x of queries and keys, then phi(k)^T [v, 1] and phi(q) (phi(k)^T [v, 1])."""
    m = o["num_features"] if o.get("features") is None else o["features"].shape[0]
    return 2 * B * H * (N + M) * m * (D + Dv + 1)


def _fixed_draw(o: PerformerOptions, head_dim: int, generator: torch.Generator) -> dict[str, Tensor]:
    """The projection ``features`` drawn once (a layer keeps it as a buffer)."""
    return {"features": random_projection(o.num_features, head_dim, orthogonal=o.orthogonal, generator=generator)}


def _kernel_features(o: PerformerOptions):
    """The causal op's query and key features (the entry's ``kernel_features``). They need the
    drawn ``features`` (a decoder's steps must all use one projection): None without them."""
    if o.features is None:
        return None

    def features(q: Tensor, k: Tensor, scale: float | None) -> tuple[Tensor, Tensor]:
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        dtype = compute_dtype(q.dtype)
        w = o.features.to(device=q.device, dtype=dtype)
        return (performer_features(q.to(dtype), w, kind="query", scale=scale),
                performer_features(k.to(dtype), w, kind="key", scale=scale, causal=True))

    return features


def _context_parallel(q, k, v, key_padding_mask, causal, scale, options: PerformerOptions, shards: Shards) -> Tensor:
    """The entry's ``context_parallel``: kernel attention over the ranks' states (LASP-2, see
    :mod:`subquad.ops.linear`). A projection drawn here is rank 0's, broadcast (given ``features``
    must be the same on every rank); non-causal key features take the maximum over every rank's
    keys as their stabiliser, so the output is the single-process op's up to rounding."""
    o = options
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    dtype = compute_dtype(q.dtype)
    w = o.features
    if w is None:
        w = shards.broadcast(random_projection(o.num_features, q.shape[-1], orthogonal=o.orthogonal,
                                               generator=o.generator, dtype=dtype, device=q.device))
    with compute_precision(q):
        w = w.to(device=q.device, dtype=dtype)
        phi_q = performer_features(q.to(dtype), w, kind="query", scale=scale)
        phi_k = performer_features(k.to(dtype), w, kind="key", scale=scale, causal=causal,
                                   key_padding_mask=key_padding_mask, eps=0.0 if causal else o.eps, shards=shards)
        out = kernel_attention(phi_q, phi_k, v.to(dtype), key_padding_mask, causal, o.chunk_size, shards)
    return out.to(q.dtype)


@register_method("performer", options=PerformerOptions,
                 summary="FAVOR+ positive orthogonal random features (Choromanski et al. 2021)",
                 causal=True, cross_attention=True, complexity="linear", stochastic=True,
                 core="subquad.layers.performer:PerformerCore", flops=flops,
                 peer="subquad.compare.peers:PERFORMER_PYTORCH",
                 # a modest feature count; small chunks so causal tests cross several chunk boundaries
                 test_options={"num_features": 64, "chunk_size": 4}, query_local=True, fixed_draw=_fixed_draw,
                 kernel_features=_kernel_features, context_parallel=_context_parallel)
def performer_attention(
    q, k, v, key_padding_mask, causal, scale, *, num_features, orthogonal, features, generator, eps,
    chunk_size,
):
    """FAVOR+ attention.

    Shapes: q ``(B, H, N, D)``, k ``(B, H, M, D)``, v ``(B, H, M, Dv)`` -> ``(B, H, N, Dv)``.
    One projection is shared by all batches and heads. Padded keys are removed from the
    numerator and the normaliser (performer-pytorch only zeroes their values). Causal attention
    uses chunked prefix sums. Feature math in float32 (float64 stays float64) even under
    autocast; the result has the dtype of q.

    Causal key features are stabilised by ``max_i |w_i|^2 / 2``, which depends on no token, so
    no future key can change a past output, not even through rounding; ``eps`` is not used
    there. In float32 these features underflow only for keys whose scaled norm
    ``|k| * scale^(1/2)`` exceeds about 10, where the estimator's variance (which grows like
    ``exp(|q' + k'|^2)``) already makes FAVOR+ unusable.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    dtype = compute_dtype(q.dtype)
    D = q.shape[-1]
    if features is None:
        features = random_projection(
            num_features, D, orthogonal=orthogonal, generator=generator, dtype=dtype, device=q.device
        )
    elif features.shape[1] != D:
        raise ValueError(f"performer: features must have shape (m, {D}), got {tuple(features.shape)}")
    with compute_precision(q):
        w = features.to(device=q.device, dtype=dtype)
        qc, kc, vc = q.to(dtype), k.to(dtype), v.to(dtype)
        if not causal:
            out = _bidirectional_streamed(qc, kc, vc, w, scale, key_padding_mask, eps)
        else:
            phi_q = performer_features(qc, w, kind="query", scale=scale)
            phi_k = performer_features(kc, w, kind="key", scale=scale, causal=True)
            out = kernel_attention(phi_q, phi_k, vc, key_padding_mask, True, chunk_size)
    return out.to(q.dtype)


def _bidirectional_streamed(q, k, v, w, scale, key_padding_mask, eps):
    """Non-causal FAVOR+: ``S = sum_j phi(k_j) v_j^T`` and ``z = sum_j phi(k_j)`` over key
    blocks, then ``phi(q_i) S / phi(q_i) z`` over query blocks.

    On CPU the sequence is streamed in blocks so a feature block stays in cache between its
    matmul, exponential and the next matmul. Without autograd each (batch, head) is its own
    pair of 2-D matrix chains over ``_BLOCK_ELEMENTS // m``-row blocks, with one reused feature
    block and the output written in place (batched bmm over heads was ~30% slower here), and the
    heads run on torch's threads one whole chain each (:func:`subquad.ops._common.over_threads`:
    as fast as splitting every kernel when the machine is quiet, 2.6x faster with a busy
    neighbour at N = 4096, ``benchmarks/results/busy_cores.md``); with
    autograd all heads go through batched blocks of ``_BLOCK_ELEMENTS`` elements (the per-head
    chains were ~10% slower there, forward plus backward). Off CPU all heads are one block.
    """
    B, H, N, D = q.shape
    M, Dv, m = k.shape[2], v.shape[-1], w.shape[0]
    wt = (w.t() * (math.sqrt(scale) * _LOG2E)).contiguous()  # (D, m), shared by every block
    pad = None if key_padding_mask is None else key_padding_mask[:, None, :, None].expand(B, H, M, 1)
    tracked = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, w))
    # under torch.compile: the batched blocks without out= writes (dynamo traces no out= into a
    # non-contiguous view); the compiler plans the memory itself
    functional = tracked or torch.compiler.is_compiling()
    cpu = q.device.type == "cpu"
    if cpu and not functional:
        rows = max(64, _BLOCK_ELEMENTS // m)
        out = q.new_empty(B, H, N, Dv)
        # one feature block per worker thread for every step: a fresh (rows, m) tensor per block
        # costs page faults comparable to its matmul
        scratch = threading.local()

        def one_head(i: int) -> None:
            b, h = divmod(i, H)
            if not hasattr(scratch, "buf"):
                scratch.buf = q.new_empty(min(rows, max(N, M)), m)
            _favor_group(q[b, h], k[b, h], v[b, h], wt, scale, None if pad is None else pad[b, h], eps,
                         rows, out[b, h], scratch.buf)

        over_threads(one_head, B * H)
    else:
        rows = max(64, _BLOCK_ELEMENTS // max(1, B * H * m)) if cpu else max(N, M)
        flat = [t.reshape(B * H, *t.shape[2:]) for t in (q, k, v)]
        out = None if functional else q.new_empty(B * H, N, Dv)
        out = _favor_group(
            *flat, wt, scale, None if pad is None else pad.reshape(B * H, M, 1), eps, rows, out, None
        ).view(B, H, N, Dv)
    if key_padding_mask is not None:
        out = out.masked_fill(no_key_rows(key_padding_mask, N, False), 0.0)
    return out


def _favor_group(q, k, v, wt, scale, pad, eps, rows, out, buf):
    """FAVOR+ for ``q (..., N, D)``, ``k (..., M, D)``, ``v (..., M, Dv)`` (one head as 2-D
    matrices, or a batch of heads), in blocks of ``rows`` tokens; ``wt`` is the projection
    ``(D, m)`` with the logit scale and ``log2 e`` folded in; ``pad`` ``(..., M, 1)`` is True
    at padded keys. Writes into ``out`` when given (no autograd), else returns a new tensor;
    ``buf`` (``(rows, m)`` or None) holds the feature block when given (no autograd).

    A key feature ``exp2(l_ji - h_j - s)`` (``l = w.k'``, ``h = |k'|^2/2`` in log2 units,
    ``s`` the max of ``l - h`` over keys and features: the spec's global stabiliser) is
    computed as ``exp2(l_ji - a_j) * c_j`` with the row max ``a_j`` and
    ``c_j = exp2(a_j - h_j - s)``; ``c_j`` scales ``v_j`` and the normaliser, so the
    ``(rows, m)`` block needs only a max, a subtraction and the exponential. ``s`` is kept
    online: the sums are rescaled when a later block raises it. Padded keys get ``c_j = 0``.
    Query features are stabilised by their row max alone, which cancels in the ratio.
    The key ``eps`` is added in closed form (``eps * sum v`` and ``eps * count``).

    The normaliser ``z`` rides as the last column of ``S`` (``[v_j c_j, c_j]``), so each block
    has two matmuls and no matrix-vector product: on the 2-core machine of our benchmarks a
    matrix-vector product over a block the other thread had just written was seen to run ten
    times slower than usual for minutes at a time (``benchmarks/results/speed.md``).
    """
    half = 0.5 * scale * _LOG2E
    neg = masked_fill_value(k.dtype)
    if pad is not None:  # padded keys get c_j = 0 below; zeroed here so that nan or inf there stays out
        k, v = k.masked_fill(pad, 0.0), v.masked_fill(pad, 0.0)
    S = run = None
    pads = repeat(None) if pad is None else pad.split(rows, dim=-2)
    # torch.split, not slicing in the loop: the backward of a slice writes a zero tensor of the
    # whole input, once per block (quadratic in N); split's backward is one concatenation
    for kb, vb, pb in zip(k.split(rows, dim=-2), v.split(rows, dim=-2), pads):
        logits = kb @ wt if buf is None else torch.matmul(kb, wt, out=buf[: kb.shape[-2]])
        a = logits.detach().amax(-1, keepdim=True)
        phi = logits.sub_(a).exp2_()  # in place: the matmul does not need its output for backward
        g = a - torch.linalg.vector_norm(kb, dim=-1, keepdim=True).square() * half
        if pb is not None:
            g = g.masked_fill(pb, neg)
        top = g.detach().amax((-2, -1), keepdim=True)
        new = top if run is None else torch.maximum(run, top)
        c = torch.exp2(g - new)
        if pb is not None:
            c = c.masked_fill(pb, 0.0)
        S_b = phi.transpose(-2, -1) @ torch.cat([vb * c, c], dim=-1)
        # a (batch, head) with no real key yet has run = neg: its sums are scaled to 0 here
        S = S_b if S is None else S * torch.exp2(run - new) + S_b
        run = new
    if eps:
        if pad is None:
            total = torch.cat([v.sum(-2, keepdim=True), v.new_full((*v.shape[:-2], 1, 1), v.shape[-2])], dim=-1)
        else:
            real = (~pad).to(v.dtype)
            total = torch.cat([real.transpose(-2, -1) @ v, real.sum(-2, keepdim=True)], dim=-1)
        S = S + eps * total  # (..., 1, Dv + 1): eps times the sums of v and the count of real keys
    Dv = v.shape[-1]
    outs = []
    for i, qb in enumerate(q.split(rows, dim=-2)):
        logits = qb @ wt if buf is None else torch.matmul(qb, wt, out=buf[: qb.shape[-2]])
        phi = logits.sub_(logits.detach().amax(-1, keepdim=True)).exp2_()
        res = phi @ S
        num, den = res[..., :Dv], _safe_den(res[..., Dv:])
        if out is None:
            outs.append(num / den)
        else:
            torch.div(num, den, out=out[..., i * rows : i * rows + qb.shape[-2], :])
    if out is not None:
        return out
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-2)

