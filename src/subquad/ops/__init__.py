"""Stateless attention ops, one folder per method. Importing this package registers them.

Every op has the signature ``op(q, k, v, *, key_padding_mask=None, causal=False, scale=None,
**options)`` on ``(B, H, N, D)`` tensors; see :func:`subquad.attention`.

A method is one folder ``ops/<method>/``: its ``__init__.py`` holds the options dataclass, the
op registered with :func:`subquad.register_method` (which names its layer core, FLOP formula,
peer and test options) and the fast path; ``naive.py``, where there is one, the slow and obvious
reference its tests compare against (never imported by the library). One line below registers
it, in the order :func:`subquad.list_methods` reports.
"""

from .softmax import softmax_attention
from .linear import linear_attention
from .efficient import efficient_attention
from .performer import performer_attention, random_projection
from .nystrom import nystrom_attention
from .ra import ra_attention
from .lara import lara_attention
from .sinkhorn import sinkhorn_attention
from .hybrid import hybrid_attention
from .topk import topk_attention
from .quest import quest_attention
from .moba import moba_attention
from .xattention import xattention_attention
from .magicpig import magicpig_attention
from .hedgehog import hedgehog_attention
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
    "hybrid_attention",
    "topk_attention",
    "quest_attention",
    "moba_attention",
    "xattention_attention",
    "magicpig_attention",
    "hedgehog_attention",
    "nmf",
    "vq",
    "cd",
    "factorize",
]
