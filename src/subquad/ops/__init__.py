"""Stateless attention ops, one file per mechanism. Importing this package registers them.

Every op has the signature ``op(q, k, v, *, key_padding_mask=None, causal=False, scale=None,
**options)`` on ``(B, H, N, D)`` tensors; see :func:`subquad.attention`.
"""

from .exact import softmax_attention
from .linear import linear_attention
from .efficient import efficient_attention
from .performer import performer_attention, random_projection
from .nystrom import nystrom_attention
from .randomized import lara_attention, ra_attention
from .sinkhorn import sinkhorn_attention
from .decomposition import cd, factorize, nmf, vq

__all__ = [
    "softmax_attention",
    "linear_attention",
    "efficient_attention",
    "performer_attention",
    "random_projection",
    "nystrom_attention",
    "ra_attention",
    "lara_attention",
    "sinkhorn_attention",
    "nmf",
    "vq",
    "cd",
    "factorize",
]
