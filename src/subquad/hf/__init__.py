"""Retrofit pretrained Hugging Face ``transformers`` models with subquad attention.

    model = AutoModel.from_pretrained(path)
    subquad.hf.retrofit(model, "hedgehog")              # zero-shot: swap attention, weights untouched
    subquad.hf.transfer(model, texts, tokenizer)       # train only the approximation's own parameters
    subquad.hf.save_retrofit(model, "minilm-hedgehog.pt")
    subquad.hf.load_retrofit(fresh_model, "minilm-hedgehog.pt")
    model.generate(ids, cache=subquad.hf.decoding_cache(model))  # a decoder: O(1) per token

Needs the ``real`` extra (``transformers``). See ``docs/retrofit.md``.
"""

from .cache import CACHE_ARGUMENT, StateCache, decoding_cache, has_state
from .evaluate import compare_to_exact, embed, embedding_agreement
from .io import load_retrofit, read_retrofit, save_retrofit
from .retrofit import (RetrofitAttention, attention_modules, is_retrofitted, retrofit, retrofit_layers,
                       retrofit_methods, set_mode, unretrofit)
from .transfer import cache_teacher, layer_losses, trainable_parameters, transfer

__all__ = ["retrofit", "unretrofit", "is_retrofitted", "retrofit_methods", "attention_modules", "retrofit_layers",
           "set_mode", "RetrofitAttention", "transfer", "cache_teacher", "layer_losses", "trainable_parameters",
           "save_retrofit", "load_retrofit", "read_retrofit", "embed", "embedding_agreement", "compare_to_exact",
           "CACHE_ARGUMENT", "StateCache", "decoding_cache", "has_state"]
