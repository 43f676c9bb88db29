"""Context parallelism: attention over a sequence split across the processes of a
``torch.distributed`` group, for sequences longer than one process (or machine) can hold.

Each process holds one contiguous shard of the sequence, in rank order (rank 0 the first tokens),
and calls :func:`attention` on its shard of q, k and v; it gets its shard of the output, and
autograd runs backward through the collectives. Any backend with all-gather, all-reduce,
broadcast and point-to-point sends works: gloo on CPU, NCCL on GPU. Every rank must make the same
calls (the same layers, forward and backward) in the same order.

Which methods, and what they send per call (``R`` ranks, ``B`` batch, ``H`` heads):

- ``linear``, ``performer``, ``hedgehog`` (``window=0``) and ``efficient`` (non-causal): LASP-2
  (Sun et al. 2025, "LASP-2: Rethinking Sequence Parallelism for Linear Attention and Its Hybrid",
  arXiv 2502.07563): one all-gather of each rank's ``(F, Dv + 1)`` state ``phi(k)^T [v, 1]`` per
  (batch, head), the same size in backward; nothing that grows with N;
- ``softmax``: ring attention (:mod:`subquad.ops.softmax.ring`): the key and value shards go
  around the ring, ``(R - 1)`` shard sends forward and ``R`` with their gradients in backward.
  Causal, the contiguous layout gives the last rank ``R`` times the first's work;
  ``layout="zigzag"`` (:func:`shard` cuts the sequence into ``2 R`` parts, rank ``r`` holding
  parts ``r`` and ``2 R - 1 - r``) gives every rank the same.
- ``hybrid`` (causal, ``score="mean"``, no key padding; every shard but the last whole query
  blocks, the first past the dense prefix): one all-gather of the block means, then each rank
  fetches, point to point, only the key blocks its query blocks selected on earlier ranks (each
  (item, head, block) once); backward returns their gradients the same way
  (:mod:`subquad.ops.hybrid.sharded`).

:func:`traffic` counts the bytes a block of code hands the collectives.

:func:`supported_methods` lists them (a method supports it when its registry entry has a
``context_parallel`` form). Example, two processes on one machine::

    # torchrun --nproc_per_node=2 example.py
    import torch, torch.distributed as dist
    import subquad.distributed as sqd

    dist.init_process_group("gloo")
    q, k, v = (torch.randn(1, 8, 65536, 64, generator=torch.Generator().manual_seed(i)) for i in range(3))
    q, k, v = (sqd.shard(t, dim=2) for t in (q, k, v))  # this rank's tokens
    out = sqd.attention(q, k, v, method="linear", causal=True)  # this rank's shard of the output

A whole model runs on its shard of the sequence inside :func:`context_parallel`: its
:class:`subquad.MultiheadAttention` layers call :func:`attention`, and the modules that know their
place in the sequence (a module with a ``sequence_shards`` attribute: the encoder's positions and
its short convolution, :class:`subquad.models.Encoder`) take theirs from the group. That is what
``subquad train TASK --context-parallel N`` runs under ``torchrun``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import Tensor, nn

from .ops._sharded import TRAFFIC, Shards
from .registry import get_method, list_methods, prepare_call

__all__ = ["attention", "context_parallel", "shard", "supported_methods", "traffic"]


@contextlib.contextmanager
def traffic() -> Iterator[dict[str, int]]:
    """``with traffic() as t:`` counts, in ``t["bytes"]`` and ``t["calls"]``, what this process
    hands the collectives inside the block: the output of each all-gather, the tensor of each
    all-reduce and broadcast, every tensor it sends. The figures are set when the block ends."""
    start = dict(TRAFFIC)
    out = {"bytes": 0, "calls": 0}
    try:
        yield out
    finally:
        out.update({key: TRAFFIC[key] - start[key] for key in out})


def supported_methods() -> list[str]:
    """The registered methods with a context-parallel form."""
    return [m.name for m in list_methods() if m.context_parallel is not None]


def shard(x: Tensor, dim: int = 2, group: Any = None, layout: str = "contiguous") -> Tensor:
    """This rank's shard of the whole ``x`` along ``dim`` (the sequence axis: 2 for q, k, v
    ``(B, H, N, D)``, 1 for a mask ``(B, N)``). ``layout="contiguous"``: ``torch.tensor_split``
    into as many parts as the group has ranks (the first ``N % R`` ranks hold one token more);
    ``"zigzag"``: into ``2 R`` parts, rank ``r`` holding parts ``r`` and ``2 R - 1 - r`` in that
    order (what balances causal ring attention; pass the same ``layout`` to :func:`attention`,
    whose output rows come in the same order)."""
    return Shards.of(group, layout).split(x, dim)


def attention(q: Tensor, k: Tensor, v: Tensor, *, method: str, causal: bool = False,
              key_padding_mask: Tensor | None = None, scale: float | None = None, group: Any = None,
              layout: str = "contiguous", **options: Any) -> Tensor:
    """Attention by ``method`` over the sequence whose shards the ranks of ``group`` hold.

    Args:
        q: ``(B, H, n, D)`` this rank's queries. k: ``(B, H, m, D)`` and v ``(B, H, m, Dv)``:
            its keys and values (causal: ``n = m``, the same positions). Shards may differ in
            length between ranks (at least one token each).
        method: a name from :func:`supported_methods`.
        causal: a query sees the keys at or before its position in the whole sequence.
        key_padding_mask: bool ``(B, m)``, True marks this rank's padded keys.
        scale: the logit scale, default ``D ** -0.5``.
        group: the process group (None: the default group).
        layout: which positions each rank holds, as :func:`shard` cuts them: ``"contiguous"``, or
            ``"zigzag"`` (causal: ``softmax`` only, where it balances the ring's work; without a
            causal mask every method takes it, a rank's rows being its queries in any order).
        **options: the method's options, as for :func:`subquad.attention`.

    Returns:
        ``(B, H, n, Dv)``: this rank's shard of the output, in the dtype of q; equal, up to
        rounding, to the same rows of the single-process op on the whole sequence.
    """
    info = get_method(method)
    if info.context_parallel is None:
        raise NotImplementedError(f"method {method!r} has no context-parallel form; supported: {supported_methods()}")
    scale, o = prepare_call(info, q, k, v, key_padding_mask, causal, scale, options)
    return info.context_parallel(q, k, v, key_padding_mask, causal, scale, o, Shards.of(group, layout))


@contextlib.contextmanager
def context_parallel(module: nn.Module, group: Any = None) -> Iterator[nn.Module]:
    """``with context_parallel(model, group):`` runs ``model`` on this rank's contiguous shard of
    the sequence (rank order = sequence order, as :func:`shard` splits it), forward and backward.

    Inside the block every submodule with a ``sequence_shards`` attribute gets the group's
    :class:`~subquad.ops._sharded.Shards`: :class:`subquad.MultiheadAttention` then attends over
    the whole sequence through :func:`attention` (its method must be one of
    :func:`supported_methods`; no ``attn_mask``, weights, extra keys or attention dropout), and
    :class:`subquad.models.Encoder` offsets its positions and hands its short convolution the last
    tokens of the rank before. Every other module must work position by position (linear layers,
    norms, pointwise activations), as a transformer's do. Before anything is set, each such
    submodule's ``check_context_parallel()`` raises ValueError for what it cannot shard (an
    encoder that pools the sequence, a method without a sharded form). Afterwards the modules
    are as before: the same model runs on whole sequences again. Yields ``module``."""
    shards = Shards.of(group)
    parts = [m for m in module.modules() if hasattr(m, "sequence_shards")]
    for m in parts:
        if hasattr(m, "check_context_parallel"):
            m.check_context_parallel()
    before = [m.__dict__.get("sequence_shards", _UNSET) for m in parts]
    for m in parts:
        m.sequence_shards = shards
    try:
        yield module
    finally:
        for m, value in zip(parts, before):
            if value is _UNSET:
                del m.sequence_shards  # the class's None shows again
            else:
                m.sequence_shards = value


_UNSET = object()
