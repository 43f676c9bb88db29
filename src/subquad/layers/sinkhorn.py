"""The module side of Sparse Sinkhorn attention: sort networks and the attention core behind
``MultiheadAttention(method="sinkhorn", ...)``.

The op (:func:`subquad.ops.sinkhorn.sinkhorn_attention`) is stateless and takes sorting logits;
this module owns what is learned. Core options (besides the op's ``block_size``,
``sinkhorn_iters``, ``tau``, ``top_blocks``, ``sortcut_blocks``, ``generator``):

- ``sort_net``: ``"attention"`` (default) uses the length-agnostic logits
  ``R_ij = <mean q_i, mean k_j> / sqrt(d)`` (no parameters of its own, works at any length);
  ``"mlp"`` is the paper's meta sorting network :class:`SortNet` (learned, per head, at most
  ``max_blocks`` blocks).
- ``max_blocks`` (64), ``sort_hidden`` (None: 2 * head_dim): size of the ``"mlp"`` sort network.
- ``mixture``: add exact softmax attention on the same q, k, v (the paper's Sinkhorn Mixture);
  this gives up the linear cost.
- ``lra_compat``: compute what the Long Range Arena reference code computes instead of the
  paper's method (strided blocks, a row-softmax sort network whose output does not reach the
  result, summed-block contraction, separate softmaxes); see
  :func:`subquad.ops.sinkhorn.lra.lra_sinkhorn_attention`. For comparisons with published LRA
  numbers only; encoder only.

In training mode the core adds Gumbel noise to the sorting logits (Gumbel-Sinkhorn); in eval
mode it is deterministic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..checks import check_bool, check_choice, check_int
from ..ops._masks import compute_dtype, compute_precision
from ..ops.sinkhorn.blocks import _pad_to, block_layout, block_means, block_prefix_means, padded_keep
from ..ops.sinkhorn.lra import lra_sinkhorn_attention, strided_block_sums
from ..ops.softmax import softmax_attention
from .attention import AttentionCore

__all__ = ["LRASortNet", "SinkhornCore", "SortNet"]


def _block_inputs(q: Tensor, k: Tensor, key_padding_mask: Tensor | None, block_size: int):
    """q, k zero-padded to a multiple of the block size (as the op pads them), the padded
    ``keep`` mask (True = real token, or None) and the block size b actually used."""
    B, _, N, _ = q.shape
    b, nb = block_layout(N, block_size)
    keep = padded_keep(key_padding_mask, B, N, nb * b, q.device)
    return _pad_to(q, nb * b), _pad_to(k, nb * b), keep, b


class SortNet(nn.Module):
    """The paper's meta sorting network, one per head.

    Block summary ``psi_i`` = [masked mean of block i's queries ; of its keys] (``2 d``
    features; causal: prefix means over positions ``0 .. i * b``, which every query of block i
    may see), then ``Linear(2d, hidden) -> ReLU -> Linear(hidden, max_blocks)``; row i of the
    sorting logits comes from block i's summary alone, and the first NB of the ``max_blocks``
    outputs are used. Raises ValueError when a sequence has more than ``max_blocks`` blocks.
    """

    def __init__(self, num_heads: int, head_dim: int, max_blocks: int, hidden: int | None = None,
                 device=None, dtype=None):
        super().__init__()
        hidden = 2 * head_dim if hidden is None else hidden
        factory = {"device": device, "dtype": dtype}
        self.max_blocks = max_blocks
        self.w1 = nn.Parameter(torch.empty(num_heads, 2 * head_dim, hidden, **factory))
        self.b1 = nn.Parameter(torch.empty(num_heads, 1, hidden, **factory))
        self.w2 = nn.Parameter(torch.empty(num_heads, hidden, max_blocks, **factory))
        self.b2 = nn.Parameter(torch.empty(num_heads, 1, max_blocks, **factory))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Uniform(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weights and biases, as ``nn.Linear``."""
        for w, b in ((self.w1, self.b1), (self.w2, self.b2)):
            bound = 1.0 / math.sqrt(w.shape[1])
            nn.init.uniform_(w, -bound, bound)
            nn.init.uniform_(b, -bound, bound)

    def forward(self, q: Tensor, k: Tensor, key_padding_mask: Tensor | None, causal: bool,
                block_size: int) -> Tensor:
        """q, k ``(B, H, N, d)`` -> sorting logits ``(B, H, NB, NB)`` (float32, or float64)."""
        qp, kp, keep, b = _block_inputs(q, k, key_padding_mask, block_size)
        nb = qp.shape[2] // b
        if nb > self.max_blocks:
            raise ValueError(
                f"sinkhorn: the sequence has {nb} blocks of {b} tokens but the sort network was built "
                f"for max_blocks={self.max_blocks}; raise max_blocks or use sort_net='attention'"
            )
        dtype = compute_dtype(q.dtype)
        with compute_precision(q):
            qp, kp = qp.to(dtype), kp.to(dtype)
            summary = block_prefix_means if causal else block_means
            psi = torch.cat([summary(qp, b, keep), summary(kp, b, keep)], dim=-1)  # (B, H, NB, 2d)
            hidden = torch.relu(psi @ self.w1.to(dtype) + self.b1.to(dtype))
            logits = hidden @ self.w2[..., :nb].to(dtype) + self.b2[..., :nb].to(dtype)
        return logits


class LRASortNet(nn.Module):
    """The LRA reference code's sort network: one ``Linear(head_dim, max_blocks, bias=False)``
    shared by all heads on the sums of the *strided* blocks' keys, row softmax over the first NB
    outputs. (Its output does not reach the LRA attention result; it is kept for fidelity.)"""

    def __init__(self, head_dim: int, max_blocks: int, device=None, dtype=None):
        super().__init__()
        self.proj = nn.Linear(head_dim, max_blocks, bias=False, device=device, dtype=dtype)

    def forward(self, k: Tensor, key_padding_mask: Tensor | None, block_size: int) -> Tensor:
        """k ``(B, H, N, d)`` -> permutation ``(B, H, NB, min(NB, max_blocks))``."""
        _, kp, keep, b = _block_inputs(k, k, key_padding_mask, block_size)
        dtype = compute_dtype(k.dtype)
        with compute_precision(k):
            sums = strided_block_sums(kp.to(dtype), b, keep)
            nb = sums.shape[2]
            logits = sums @ self.proj.weight[:nb].to(dtype).T
            return torch.softmax(logits, dim=-1)


_OP_ONLY = ("sinkhorn_iters", "tau", "top_blocks", "sortcut_blocks")


@dataclass
class SinkhornModuleOptions:
    """The sort network: ``sort_net`` (``"attention"``: the block-sum keys sort themselves, no
    parameters; ``"mlp"``: a learned per-head network of width ``sort_hidden``, None: the head
    dim), ``max_blocks`` (the most blocks it sorts), ``mixture`` (mix the sorted and unsorted
    outputs), ``lra_compat`` (the LRA reference computation)."""

    sort_net: str = "attention"
    max_blocks: int = 64
    sort_hidden: int | None = None
    mixture: bool = False
    lra_compat: bool = False

    def __post_init__(self):
        check_choice("sinkhorn", "sort_net", self.sort_net, ("attention", "mlp"))
        check_int("sinkhorn", "max_blocks", self.max_blocks, minimum=1)
        if self.sort_hidden is not None:
            check_int("sinkhorn", "sort_hidden", self.sort_hidden, minimum=1)
        check_bool("sinkhorn", "mixture", self.mixture)
        check_bool("sinkhorn", "lra_compat", self.lra_compat)


class SinkhornCore(AttentionCore):
    """Sparse Sinkhorn attention with its sort network (see the module docstring)."""

    module_options = SinkhornModuleOptions

    def __init__(self, method, num_heads, head_dim, options, *, dropout=0.0, device=None, dtype=None):
        for name in ("sort_logits", "training"):
            if name in options:
                raise ValueError(
                    f"sinkhorn: MultiheadAttention sets {name!r} itself (from its sort network and "
                    "train/eval mode); do not pass it"
                )
        super().__init__(method, num_heads, head_dim, options)
        m = self.module
        sort_net, max_blocks, sort_hidden = m.sort_net, m.max_blocks, m.sort_hidden
        self.mixture, self.lra_compat = m.mixture, m.lra_compat
        if self.lra_compat:
            given = sorted(set(self.options) & set(_OP_ONLY)) + (["sort_net"] if sort_net != "attention" else [])
            if given:
                raise ValueError(
                    f"sinkhorn: lra_compat=True reproduces the LRA reference computation, which has no "
                    f"{given}; pass only block_size (and max_blocks)"
                )
        self.sort_net_kind = sort_net
        self.sort_net = None
        if self.lra_compat:
            self.sort_net = LRASortNet(head_dim, max_blocks, device=device, dtype=dtype)
        elif sort_net == "mlp":
            self.sort_net = SortNet(num_heads, head_dim, max_blocks, sort_hidden, device=device, dtype=dtype)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None, causal: bool,
                extra_keys: int = 0) -> Tensor:
        # MultiheadAttention hands add_bias_kv / add_zero_attn extras to this self-attention-only
        # core as leading tokens (with placeholder queries), never as extra_keys
        if q.shape[2] != k.shape[2]:
            raise ValueError(
                f"sinkhorn: supports self-attention only (query and key lengths equal), "
                f"got N={q.shape[2]}, M={k.shape[2]}"
            )
        opts = self.method.make_options(**self.options)
        if self.lra_compat:
            if causal:
                raise NotImplementedError(
                    "sinkhorn: lra_compat=True reproduces the LRA encoder computation, which has no working "
                    "causal path; use lra_compat=False for causal attention"
                )
            perm = self.sort_net(k, key_padding_mask, opts.block_size)
            out = lra_sinkhorn_attention(q, k, v, perm, key_padding_mask=key_padding_mask,
                                         block_size=opts.block_size)
        else:
            extra = {"training": self.training}
            if self.sort_net is not None:
                extra["sort_logits"] = self.sort_net(q, k, key_padding_mask, causal, opts.block_size)
            out = self.method.op(q, k, v, key_padding_mask=key_padding_mask, causal=causal,
                                 **self.options, **extra)
        if self.mixture:
            out = out + softmax_attention(q, k, v, key_padding_mask=key_padding_mask, causal=causal)
        return out

    def extra_repr(self) -> str:
        parts = [super().extra_repr(), f"sort_net={self.sort_net_kind!r}"]
        if self.mixture:
            parts.append("mixture=True")
        if self.lra_compat:
            parts.append("lra_compat=True")
        return ", ".join(parts)
