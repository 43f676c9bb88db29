"""``subquad compare --objective decode``: the seconds of one generated token's attention after N
cached tokens, per method, the way a decoder runs it.

How a causal method decodes (as :mod:`subquad.hf.decoding` runs it inside a retrofitted model):

- ``"state"``: its registry entry's ``kernel_features`` for these options (linear, performer,
  hedgehog without a window: :class:`subquad.ops.linear.state.KernelState`, the running sums,
  O(1) per token) or its ``decode_state`` (hybrid: the keys and values, their block sums and the
  query block's choice);
- ``"keys"``: a ``query_local`` method (exact attention; hedgehog with a window): the new query
  against every cached key, by the op itself (non-causal: the cache holds only the past and the
  token itself), with the keys and values in buffers allocated once for the whole run (as
  transformers' StaticCache holds them);
- a method with neither (sinkhorn: a query's output depends on the other queries of its block) has
  no decoding form: its row says so.

The first N tokens are the prefill (untimed); then ``steps`` single-token calls, each token
joining the cache, after two untimed warm-up tokens. The time is the median over the steps
(single calls: a per-token call is what a decoder makes), ``spread`` the interquartile range over
the median, and ``cache_bytes`` what the cache holds after the steps.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch
from torch import Tensor

from subquad.registry import MethodInfo

__all__ = ["decoding_form", "decode_time", "WARMUP_TOKENS"]

#: untimed single-token calls after the prefill
WARMUP_TOKENS = 2


def decoding_form(info: MethodInfo, options: dict[str, Any]) -> str | None:
    """``"state"``, ``"keys"`` or None (no decoding form), for ``info``'s method with ``options``."""
    if info.kind != "attention" or not info.causal:
        return None
    full = info.make_options(**options)
    if (info.kernel_features is not None and info.kernel_features(full) is not None) or info.decode_state:
        return "state"
    return "keys" if info.query_local else None


def _state_step(info: MethodInfo, options: dict[str, Any]) -> tuple[Callable[[Tensor, Tensor, Tensor], Tensor],
                                                                     Callable[[], int]]:
    """``(attend(q, k, v), nbytes())`` of a fresh decoding state of the method."""
    from subquad.ops.linear.state import KernelState

    full = info.make_options(**options)
    features = info.kernel_features(full) if info.kernel_features is not None else None
    if features is None:
        state = info.decode_state(full)
        return (lambda q, k, v: state.attend(q, k, v)), state.nbytes
    kernel = KernelState(getattr(full, "chunk_size", 64))

    def attend(q, k, v):
        phi_q, phi_k = features(q, k, None)
        return kernel.attend(phi_q, phi_k, v)

    return attend, lambda: 0 if kernel.sums is None else kernel.sums.numel() * kernel.sums.element_size()


def _keys_step(info: MethodInfo, options: dict[str, Any], k: Tensor, v: Tensor) -> tuple[Callable[[int], Tensor],
                                                                                          Callable[[int], int]]:
    """``(step(t), nbytes(t))``: query ``t`` against keys ``0..t`` of the preallocated buffers."""
    import subquad

    op = subquad.get_method(info.name).op
    return (lambda q_t, t: op(q_t, k[:, :, : t + 1], v[:, :, : t + 1], **options),
            lambda t: 2 * k[:, :, :t].numel() * k.element_size())


def decode_time(info: MethodInfo, options: dict[str, Any], q: Tensor, k: Tensor, v: Tensor, steps: int) -> dict:
    """The method's per-token decode time: q, k, v ``(B, H, N + WARMUP_TOKENS + steps, D)``, the first
    N of them the prefill. Returns ``{"decode_s", "decode_spread", "cache_bytes", "decoding"}``;
    raises ValueError when the method has no decoding form."""
    form = decoding_form(info, options)
    if form is None:
        raise ValueError(f"{info.name} has no decoding form (no state, and a query's output depends on the "
                         "other queries)")
    n = q.shape[2] - WARMUP_TOKENS - steps
    times = []
    with torch.no_grad():
        if form == "state":
            attend, nbytes = _state_step(info, options)
            attend(q[:, :, :n], k[:, :, :n], v[:, :, :n])
            step = lambda t: attend(q[:, :, t: t + 1], k[:, :, t: t + 1], v[:, :, t: t + 1])  # noqa: E731
        else:
            attend_t, bytes_at = _keys_step(info, options, k, v)
            step = lambda t: attend_t(q[:, :, t: t + 1], t)  # noqa: E731
        for t in range(n, q.shape[2]):
            start = time.perf_counter()
            step(t)
            if q.device.type == "cuda":
                torch.cuda.synchronize(q.device)
            if t >= n + WARMUP_TOKENS:
                times.append(time.perf_counter() - start)
    median = statistics.median(times)
    q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive") if len(times) > 1 else (median, 0, median)
    cache = nbytes() if form == "state" else bytes_at(q.shape[2])
    return {"decode_s": median, "decode_spread": (q3 - q1) / median, "cache_bytes": cache, "decoding": form}
