"""Decoding a retrofitted decoder with no extra argument.

:func:`subquad.hf.retrofit` calls :func:`install` on a decoder (a model with causal attention), so
that wherever transformers would make its own ``DynamicCache`` the model gets the cache its method
decodes with (:func:`subquad.hf.decoding_cache`):

- ``model.generate(ids)``: the model's cache preparation for ``generate`` is wrapped (on this
  model only) to hand the first step a :class:`~subquad.hf.cache.StateCache` when every layer's
  method has a decoding state, unless the call names a cache, a ``cache_implementation`` or
  ``use_cache=False``.
- a forward with ``use_cache`` on (``model(ids, use_cache=True)``, or the config's default) and no
  cache: a forward pre-hook on the base model passes it a StateCache, which the output returns
  (``out.past_key_values``) for the next steps. Not in training mode, and not while the layers run
  exact attention (:func:`subquad.hf.retrofit.set_mode`).

How each causal method decodes (:func:`decoding_kind`): ``"state"`` (``linear``, ``performer``,
``hedgehog`` without a window, ``hybrid``: a StateCache, O(1) or about the selected keys per
token),
``"keys"`` (``softmax``, ``hedgehog`` with a window: transformers' DynamicCache, each new query
against every cached key) or ``"none"`` (``sinkhorn``: its output at a query depends on the other
queries of its block and it keeps no state). A ``"none"`` method says so when it is retrofitted (a
warning), and the model's ``use_cache`` (config and generation config) is switched off, so that
``generate`` recomputes the whole prefix for each new token; :func:`uninstall` restores both.
"""

from __future__ import annotations

import types
import warnings
from typing import Any

import subquad
from torch import nn

from .cache import CACHE_ARGUMENT, StateCache, has_state

__all__ = ["decoding_kind", "install", "uninstall", "uses_state"]

_OTHER_ARGUMENT = "past_key_values" if CACHE_ARGUMENT == "cache" else "cache"


def decoding_kind(model: nn.Module) -> str:
    """``"state"``, ``"keys"`` or ``"none"``: how ``model``, retrofitted, decodes (see the module
    docstring)."""
    layers = _layers(model)
    if has_state(model):
        return "state"
    return "keys" if all(subquad.get_method(r.method).query_local for r in layers) else "none"


def _layers(model: nn.Module) -> list:
    return [m.subquad_retrofit for m in model.modules() if hasattr(m, "subquad_retrofit")]


def uses_state(model: nn.Module) -> bool:
    """Whether a cache made for ``model`` now would be a StateCache: every retrofitted layer has a
    decoding state and runs its approximation."""
    return has_state(model) and all(r.mode == "approx" for r in _layers(model))


def _prepare_cache(self, generation_config, model_kwargs: dict, *args: Any, **kwargs: Any):
    """``generate``'s cache preparation on a retrofitted model: a StateCache where transformers
    would make a DynamicCache, else what the model's class does."""
    if (model_kwargs.get(CACHE_ARGUMENT) is None and generation_config.use_cache is not False
            and generation_config.cache_implementation is None
            and not getattr(generation_config, "is_assistant", False) and uses_state(self)):
        model_kwargs[CACHE_ARGUMENT] = StateCache()
        return None
    return type(self)._prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs)


def _inject_state(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Forward pre-hook of the base model: a StateCache for a forward that would make a cache."""
    if module.training or len(args) > 1 or kwargs.get(CACHE_ARGUMENT) is not None \
            or kwargs.get(_OTHER_ARGUMENT) is not None:
        return None
    use_cache = kwargs.get("use_cache")
    if use_cache is None:
        use_cache = getattr(module.config, "use_cache", False)
    if not use_cache or not uses_state(module):
        return None
    kwargs = {k: v for k, v in kwargs.items() if k != _OTHER_ARGUMENT}
    kwargs[CACHE_ARGUMENT] = StateCache()
    return args, kwargs


def install(model: nn.Module, method: str) -> dict[str, Any]:
    """Make ``model`` (a decoder, retrofitted with ``method``) decode with its method's own cache;
    returns what :func:`uninstall` needs."""
    kind = decoding_kind(model)
    saved: dict[str, Any] = {"kind": kind}
    if kind == "none":
        warnings.warn(f"subquad retrofit: {method!r} cannot decode from a cache (a query's output depends on the "
                      "other queries of its block, and it keeps no decoding state); use_cache is switched off, so "
                      "generate recomputes the whole prefix for every new token", stacklevel=3)
        generation = getattr(model, "generation_config", None)
        saved["use_cache"] = (getattr(model.config, "use_cache", None), getattr(generation, "use_cache", None))
        model.config.use_cache = False
        if generation is not None:
            generation.use_cache = False
        return saved
    if kind == "keys":  # transformers' own DynamicCache is the one it decodes with
        return saved
    base = getattr(model, "base_model", model)
    saved["hook"] = base.register_forward_pre_hook(_inject_state, with_kwargs=True)
    if hasattr(model, "_prepare_cache_for_generation"):
        model._prepare_cache_for_generation = types.MethodType(_prepare_cache, model)
        saved["generate"] = True
    return saved


def uninstall(model: nn.Module, saved: dict[str, Any] | None) -> None:
    """Undo :func:`install`."""
    if not saved:
        return
    if "hook" in saved:
        saved["hook"].remove()
    if saved.get("generate"):
        model.__dict__.pop("_prepare_cache_for_generation", None)
    if "use_cache" in saved:
        config_value, generation_value = saved["use_cache"]
        model.config.use_cache = config_value
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.use_cache = generation_value
