"""What the Long Range Arena reference code computes for "Sinkhorn attention": kept only as a
compatibility mode for ``MultiheadAttention(method="sinkhorn", lra_compat=True)``; it is not the
paper's method (that is :func:`subquad.ops.sinkhorn.sinkhorn_attention`)."""

from __future__ import annotations

from torch import Tensor

from .._masks import compute_dtype, compute_precision
from .blocks import _attend, _pad_to, block_layout, padded_keep

__all__ = ["lra_sinkhorn_attention", "strided_block_sums"]


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

