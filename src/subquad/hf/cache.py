"""Decoding caches for retrofitted models: what a retrofitted layer keeps between generated tokens.

:class:`StateCache` is a ``transformers`` ``Cache`` whose layers hold their method's decoding
state instead of transformers' keys and values: the recurrent state of kernel attention
(:class:`subquad.ops.linear.state.KernelState` for ``linear``, ``performer`` and ``hedgehog``
without a window), so a generated token costs the same time and memory at any context length; or
a method's own state (``hybrid``: :class:`subquad.ops.hybrid.HybridDecodeState`, the keys and
values, their block sums and the current query block's selected key blocks, so a token costs
about its selected keys plus, once per query block, one score per key block).
:func:`decoding_cache` picks the cache a retrofitted model decodes with, and a retrofitted decoder
gets it with nothing passed (:mod:`subquad.hf.decoding`)::

    model = subquad.hf.retrofit(model, "linear")
    out = model.generate(ids, max_new_tokens=64)             # through a StateCache
    out = model.generate(ids, cache=subquad.hf.decoding_cache(model), max_new_tokens=64)  # the same, by hand

transformers 5.24 renamed the models' cache argument from ``past_key_values`` to ``cache``:
before 5.24 pass ``past_key_values=`` instead (:data:`CACHE_ARGUMENT` is the installed version's
name, for code that runs on both).

Methods without one decode with transformers' ``DynamicCache`` (every key and value kept;
the retrofit then recomputes each new query against all of them).
"""

from __future__ import annotations

from typing import Any

import transformers
from torch import Tensor, nn
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache

__all__ = ["CACHE_ARGUMENT", "StateCache", "StateLayer", "decoding_cache", "has_state"]

#: The name under which the installed transformers' models and ``generate`` take a cache:
#: ``"cache"`` from transformers 5.24, ``"past_key_values"`` before.
CACHE_ARGUMENT = ("cache" if tuple(int(x) for x in transformers.__version__.split(".")[:2]) >= (5, 24)
                  else "past_key_values")


class StateLayer(CacheLayerMixin):
    """One layer of a :class:`StateCache`: ``seen`` tokens and the method's ``state`` (set by the
    layer's first attention call). Keys and values pass through :meth:`update` unkept."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, **kwargs: Any):
        super().__init__()
        self.state: Any = None
        self.seen = 0

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        """Count the new tokens; return their keys and values (the attention folds them into the state)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.seen += key_states.shape[-2]
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """The mask covers the new tokens only (offset: the tokens already seen)."""
        return query_length, self.seen

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.state, self.seen = None, 0

    def reorder_cache(self, beam_idx: Tensor) -> None:
        if self.state is not None:
            self.state.select(beam_idx)

    def offload(self) -> None:  # a state is small: it stays where it is
        pass

    def prefetch(self) -> None:
        pass


class StateCache(Cache):
    """A ``Cache`` of :class:`StateLayer` (one per layer, made as the layers first run). Pass it to
    ``model.generate(cache=...)`` (``past_key_values=`` before transformers 5.24) or a forward
    call of a model retrofitted with a method that has a state (:func:`has_state`); others refuse
    it."""

    def __init__(self) -> None:
        super().__init__(layer_class_to_replicate=StateLayer)

    def nbytes(self) -> int:
        """Memory held by every layer's state (for kernel states constant once the first token has run)."""
        return sum(layer.state.nbytes() for layer in self.layers if layer.state is not None)


def has_state(model: nn.Module) -> bool:
    """Whether every retrofitted layer of ``model`` can decode through a state (:class:`StateCache`)."""
    layers = [m.subquad_retrofit for m in model.modules() if hasattr(m, "subquad_retrofit")]
    return bool(layers) and all(r.has_state for r in layers)


def decoding_cache(model: nn.Module) -> Cache:
    """The cache ``model`` (retrofitted) decodes with: a :class:`StateCache` when its method has a
    decoding state, else transformers' ``DynamicCache``."""
    return StateCache() if has_state(model) else DynamicCache()
