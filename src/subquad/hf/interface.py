"""transformers' own switch: ``attn_implementation="subquad_<method>"``.

``import subquad.hf`` registers, for every q/k/v method, an attention function with
``transformers.AttentionInterface`` and a mask function with ``AttentionMaskInterface`` under
``"subquad_<method>"`` (:func:`implementation_names`), so a model is loaded with subquad attention
by transformers itself::

    import subquad.hf
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="subquad_hybrid")

The method's options come from the config: ``config.subquad_options`` (a dict; ``seed`` as in
:func:`subquad.hf.retrofit`) when ``config.subquad_method`` is absent or names the same method, else
the method's defaults. :func:`save_pretrained` writes a retrofitted model so that it reloads this
way (:func:`subquad.hf.retrofit` puts both fields into the config). Each attention module gets its
:class:`~subquad.hf.retrofit.RetrofitAttention` at its first call, the same one
:func:`~subquad.hf.retrofit.retrofit` would give it (a method's random draws are seeded by the
layer, so they come out equal), so the first forward computes what the retrofitted model computes.

Decoding a model loaded this way goes through the cache transformers makes, a ``DynamicCache``:
methods whose queries are independent of each other recompute each new query against every cached
key, ``hybrid`` keeps its decoding state beside the keys. :func:`subquad.hf.retrofit` on the model
instead gives ``generate`` the methods' own :class:`~subquad.hf.cache.StateCache`.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from pathlib import Path
from typing import Any

import subquad
from torch import Tensor, nn

from .retrofit import CONFIG_FIELDS, RetrofitAttention, _subquad_attention, _subquad_mask, attach, retrofit_layers
from .retrofit import retrofit_methods

__all__ = ["PREFIX", "implementation_names", "register_attention", "config_options", "save_pretrained"]

#: ``attn_implementation`` names are this prefix and a method name
PREFIX = "subquad_"


def implementation_names() -> list[str]:
    """The ``attn_implementation`` names :func:`register_attention` registers, one per q/k/v method."""
    return [PREFIX + name for name in retrofit_methods()]


def config_options(config: Any, method: str) -> dict[str, Any]:
    """The options ``method`` gets from a model config: ``subquad_options`` when ``subquad_method``
    is absent or is ``method``, else none (the method's defaults)."""
    named = getattr(config, "subquad_method", None)
    options = getattr(config, "subquad_options", None) or {}
    if not isinstance(options, dict):
        raise TypeError(f"config.subquad_options must be a dict of {method}'s options, got {type(options).__name__}")
    return copy.deepcopy(dict(options)) if named in (None, method) else {}


def _check(module: nn.Module, method: str) -> None:
    """What :func:`subquad.hf.retrofit` refuses for the whole model, refused for one module."""
    info = subquad.get_method(method)
    if getattr(module, "is_causal", False) and not info.causal:
        causal = [m for m in retrofit_methods() if subquad.get_method(m).causal]
        raise NotImplementedError(f"attn_implementation={PREFIX + method!r}: {type(module).__name__} is causal "
                                  f"attention (a decoder); {method!r} is not causal by construction. Causal methods: "
                                  f"{causal}")
    if getattr(module, "is_cross_attention", False) and not info.cross_attention:
        raise NotImplementedError(f"attn_implementation={PREFIX + method!r}: {type(module).__name__} is "
                                  f"cross-attention; {method!r} does not support it")


def _attention_function(method: str):
    """The ``AttentionInterface`` entry of ``subquad_<method>``: the module's RetrofitAttention,
    made at its first call, then :func:`subquad.hf.retrofit`'s attention function."""

    def attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                  **kwargs: Any) -> tuple[Tensor, None]:
        r = getattr(module, "subquad_retrofit", None)
        if r is None or r.method != method:
            _check(module, method)
            if r is not None:
                for handle in r.hooks:
                    handle.remove()
            r = attach(module, method, config_options(module.config, method))
            if getattr(module, "is_causal", False) and getattr(module.config, "use_cache", False) \
                    and not subquad.get_method(method).query_local and not r.has_state:
                warnings.warn(f"attn_implementation={PREFIX + method!r} cannot decode from a cache; generate with "
                              "use_cache=False (the whole prefix again for every new token)", stacklevel=2)
        return _subquad_attention(module, query, key, value, attention_mask, **kwargs)

    attention.__name__ = attention.__qualname__ = f"subquad_{method}_attention"
    return attention


def register_attention() -> list[str]:
    """Register ``subquad_<method>`` for every q/k/v method with transformers' attention and mask
    interfaces (done by ``import subquad.hf``; call again after registering a method). Returns the names."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    names = []
    for method in retrofit_methods():
        AttentionInterface.register(PREFIX + method, _attention_function(method))
        AttentionMaskInterface.register(PREFIX + method, _subquad_mask)
        names.append(PREFIX + method)
    return names


def _untrained(r: RetrofitAttention) -> bool:
    """Whether the layer's tensors are what a fresh retrofit makes (nothing learned since)."""
    fresh = RetrofitAttention(r.method, r.heads, r.head_dim, {**r.options, "adapter": r.adapter, "seed": r.seed},
                              layer=r.layer)
    mine, theirs = r.state_dict(), fresh.state_dict()
    return mine.keys() == theirs.keys() and all(mine[k].cpu().equal(theirs[k]) for k in mine)


def save_pretrained(model: nn.Module, directory: str | Path, **kwargs: Any) -> Path:
    """``model.save_pretrained(directory)`` for a model retrofitted with
    :func:`subquad.hf.retrofit`: the pretrained weights (never the retrofit's own tensors, which
    the reload makes again) and the config with ``subquad_method`` and ``subquad_options``, so that
    ``from_pretrained(directory, attn_implementation="subquad_<method>")`` rebuilds the model. A
    retrofit whose tensors were trained (:func:`subquad.hf.transfer`) is refused: those are saved
    with :func:`subquad.hf.save_retrofit`. ``kwargs`` go to ``save_pretrained``."""
    info = getattr(model, "_subquad_retrofit", None)
    layers = retrofit_layers(model)
    if info is None or not layers:
        raise ValueError("save_pretrained needs a model retrofitted with subquad.hf.retrofit")
    trained = [name for name, r in layers if not _untrained(r)]
    if trained:
        raise ValueError(f"the retrofit of {trained[0]} (and {len(trained) - 1} more) holds trained tensors, which "
                         "a reload by attn_implementation would not restore; save them with "
                         "subquad.hf.save_retrofit(model, path) and reload with subquad.hf.load_retrofit")
    for name in CONFIG_FIELDS:
        if getattr(model.config, name, None) is None:
            raise ValueError(f"the model's config has no {name} (the retrofit writes it); was it removed?")
    state = {k: v for k, v in model.state_dict().items() if ".subquad_retrofit." not in f".{k}"}
    directory = Path(directory)
    with _unpacked_gguf(model):
        model.save_pretrained(directory, state_dict=state, **kwargs)
    return directory


@contextlib.contextmanager
def _unpacked_gguf(model: nn.Module):
    """A model read from a GGUF file whose weights were all unpacked at load (no packed GGUF
    module left: ``subquad.data.pretrained.load_smollm``'s float32 SmolLM2) is an ordinary model that
    transformers still marks as quantized, and so refuses to save: its GGUF quantizer and
    quantization config are set aside while it is written, so that the directory holds the plain
    weights and reloads without the GGUF file. Other models pass through unchanged."""
    quantizer = getattr(model, "hf_quantizer", None)
    method = getattr(getattr(quantizer, "quantization_config", None), "quant_method", None)
    packed = getattr(quantizer, "packed_modules", None) or any(type(m).__name__.startswith("Gguf")
                                                                 for m in model.modules())
    if quantizer is None or getattr(method, "value", method) != "gguf" or packed:
        yield
        return
    kept = {"hf_quantizer": quantizer}
    del model.hf_quantizer
    if hasattr(model.config, "quantization_config"):
        kept["quantization_config"] = model.config.quantization_config
        del model.config.quantization_config
    try:
        yield
    finally:
        model.hf_quantizer = quantizer
        if "quantization_config" in kept:
            model.config.quantization_config = kept["quantization_config"]
