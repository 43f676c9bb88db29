"""Retrofit pretrained Hugging Face ``transformers`` models with subquad attention.

    model = AutoModel.from_pretrained(path)
    subquad.hf.retrofit(model, "hedgehog")              # zero-shot: swap attention, weights untouched
    subquad.hf.transfer(model, texts, tokenizer)       # train only the approximation's own parameters
    subquad.hf.save_retrofit(model, "minilm-hedgehog.pt")
    subquad.hf.load_retrofit(fresh_model, "minilm-hedgehog.pt")
    model.generate(ids)                                 # a decoder: through the method's decoding state
    subquad.hf.save_pretrained(model, "out/smollm-hybrid")  # weights and config, for transformers' own switch:
    subquad.hf.register_attention()                      # attn_implementation="subquad_<method>"
    AutoModelForCausalLM.from_pretrained("out/smollm-hybrid", attn_implementation="subquad_hybrid")

Needs the ``real`` extra (``transformers``). See ``docs/retrofit.md``.

The names below load on first use (PEP 562): ``subquad retrofit --help`` reads this package's
command line without importing transformers or torch.
"""

from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING, Any

from .._lazy import lazy_module

#: public name -> the submodule that defines it
_NAMES = {
    "cache": ("CACHE_ARGUMENT", "StateCache", "decoding_cache", "has_state"),
    "decoding": ("decoding_kind",),
    "evaluate": ("compare_to_exact", "embed", "embedding_agreement"),
    "interface": ("implementation_names", "register_attention", "save_pretrained"),
    "io": ("load_retrofit", "read_retrofit", "save_retrofit"),
    "lm": ("eval_ids", "greedy_sample", "lm_scores", "next_token_losses"),
    "retrofit": ("RetrofitAttention", "attention_modules", "is_retrofitted", "retrofit", "retrofit_layers",
                 "retrofit_methods", "set_mode", "unretrofit"),
    "transfer": ("cache_teacher", "layer_losses", "trainable_parameters", "transfer"),
}
_LAZY = {name: module for module, names in _NAMES.items() for name in names}

__all__ = ["retrofit", "unretrofit", "is_retrofitted", "retrofit_methods", "attention_modules", "retrofit_layers",
           "set_mode", "RetrofitAttention", "transfer", "cache_teacher", "layer_losses", "trainable_parameters",
           "save_retrofit", "load_retrofit", "read_retrofit", "embed", "embedding_agreement", "compare_to_exact",
           "CACHE_ARGUMENT", "StateCache", "decoding_cache", "has_state", "decoding_kind", "implementation_names",
           "register_attention", "save_pretrained", "next_token_losses", "lm_scores", "eval_ids", "greedy_sample"]

__getattr__, __dir__ = lazy_module(__name__, _LAZY, __all__)

if TYPE_CHECKING:  # what static tools see; at run time __getattr__ imports these
    from .cache import CACHE_ARGUMENT, StateCache, decoding_cache, has_state  # noqa: F401
    from .decoding import decoding_kind  # noqa: F401
    from .evaluate import compare_to_exact, embed, embedding_agreement  # noqa: F401
    from .interface import implementation_names, register_attention, save_pretrained  # noqa: F401
    from .io import load_retrofit, read_retrofit, save_retrofit  # noqa: F401
    from .lm import eval_ids, greedy_sample, lm_scores, next_token_losses  # noqa: F401
    from .retrofit import (RetrofitAttention, attention_modules, is_retrofitted, retrofit,  # noqa: F401
                           retrofit_layers, retrofit_methods, set_mode, unretrofit)
    from .transfer import cache_teacher, layer_losses, trainable_parameters, transfer  # noqa: F401


class _Package(types.ModuleType):
    """This package's type. Loading a submodule binds it to the package's attribute of its name;
    ``retrofit`` and ``transfer`` are also public functions, and the function keeps the name (as
    when this file imported them eagerly), whichever is loaded first."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _LAZY and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
