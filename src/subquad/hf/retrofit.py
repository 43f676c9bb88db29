"""Retrofit a pretrained Hugging Face model with subquad attention.

:func:`retrofit` registers one attention function and one mask function under the name
``"subquad"`` with ``transformers.AttentionInterface`` / ``AttentionMaskInterface``, attaches a
small :class:`RetrofitAttention` module (``.subquad_retrofit``) to every attention module of the
model, and switches the model to ``attn_implementation="subquad"``. No pretrained weight is
touched: the q/k/v/out projections stay as they are, only the attention between them changes.

Masks. Our mask function hands the attention function the 2-D padding mask (or None), not a
4-D matrix, so nothing of size N x N is built. It accepts only the two patterns subquad
implements, plain bidirectional (+ padding) and plain causal (+ padding), and refuses sliding
windows, packed sequences, block overlays and custom 4-D masks with ``NotImplementedError``.
Causal attention (a decoder) needs a causal method; a non-causal one is refused at
:func:`retrofit` time.
"""

from __future__ import annotations

import copy
import types
from typing import Any

import torch
from torch import Tensor, nn

import subquad

__all__ = ["RetrofitAttention", "retrofit", "unretrofit", "is_retrofitted", "attention_modules",
           "retrofit_methods", "IMPLEMENTATION"]

IMPLEMENTATION = "subquad"
#: what a retrofit writes into the model's config (saved with it by ``save_pretrained``): the
#: method and its options, which ``attn_implementation="subquad_<method>"`` reads back
CONFIG_FIELDS = ("subquad_method", "subquad_options")
# options consumed by the retrofit itself, never passed to an op
_RETROFIT_OPTIONS = ("adapter", "seed")


def retrofit_methods() -> list[str]:
    """Names :func:`retrofit` accepts: every registered q/k/v method."""
    return [m.name for m in subquad.list_methods() if m.kind == "attention"]


class RetrofitAttention(nn.Module):
    """What a retrofit adds to one attention module: the method, its options and its parameters.

    - a method with a ``learned_init`` in its entry (``hedgehog``: its feature maps and, with a
      window, the linear term's log weight): those tensors, as parameters.
    - a method with a ``fixed_draw`` in its entry (``performer``: its ``(num_features, D)`` random
      projection): what it draws, as buffers, drawn once from ``seed`` + layer index, so the
      retrofitted model is deterministic and saved with it.
    - any method with ``adapter=True``: per-head ``D x D`` maps of q and k (identity at start), the
      learnable piece :func:`subquad.hf.transfer` trains for methods that own no parameters.

    ``mode``: ``"approx"`` (the method), ``"exact"`` (softmax, for teachers) or ``"record"``
    (softmax, and the layer's q/k/v/mask/output are appended to ``records``).
    """

    def __init__(self, method: str, heads: int, head_dim: int, options: dict[str, Any], *, layer: int = 0):
        super().__init__()
        options = dict(options)
        self.method, self.heads, self.head_dim, self.layer = method, heads, head_dim, layer
        self.adapter = bool(options.pop("adapter", False))
        self.seed = int(options.pop("seed", 0))
        self.mode = "approx"
        self.records: list[dict[str, Any]] = []
        self.drawn: tuple[str, ...] = ()  # buffers the method takes as options (its entry's fixed_draw)
        self.active_cache: Any = None  # the cache of the call in progress (set by a hook on the attention module)
        self.hooks: tuple = ()  # the hooks that set it (removed by unretrofit)
        info = subquad.get_method(method)
        if "generator" in options or "features" in options:
            raise ValueError(f"{method}: pass seed=INT to retrofit, not a generator or features; the "
                             "retrofit draws and stores what it needs")
        o = info.make_options(**options)  # validates names and ranges
        drawn = {} if info.fixed_draw is None else info.fixed_draw(
            o, head_dim, torch.Generator().manual_seed(self.seed + 1000 * layer))
        for name, t in drawn.items():
            self.register_buffer(name, t)
        learned = {} if info.learned_init is None else info.learned_init(o, heads, head_dim)
        for name, t in learned.items():
            self.register_parameter(name, nn.Parameter(t))
        self.drawn = tuple(drawn) + tuple(learned)  # tensors of this module the op takes as options
        self.options = options
        if self.adapter:
            eye = torch.eye(head_dim).expand(heads, head_dim, head_dim).clone()
            self.q_adapter = nn.Parameter(eye.clone())
            self.k_adapter = nn.Parameter(eye)

    def extra_repr(self) -> str:
        return f"method={self.method!r}, options={self.options}, adapter={self.adapter}, layer={self.layer}"

    def forward(self, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None, causal: bool,
                scale: float | None) -> Tensor:
        """q ``(B, H, N, D)``, k ``(B, H, M, D)``, v ``(B, H, M, Dv)``, ``key_padding_mask`` bool
        ``(B, M)`` with True = padding (subquad's convention) -> ``(B, H, N, Dv)``."""
        if self.mode in ("exact", "record"):
            out = subquad.attention(q, k, v, method="softmax", key_padding_mask=key_padding_mask, causal=causal,
                                    scale=scale)
            if self.mode == "record":
                self.records.append({"q": q.detach(), "k": k.detach(), "v": v.detach(), "out": out.detach(),
                                     "mask": None if key_padding_mask is None else key_padding_mask.detach(),
                                     "causal": causal, "scale": scale})
            return out
        return self.approx(q, k, v, key_padding_mask, causal, scale)

    @property
    def has_state(self) -> bool:
        """Whether this layer can decode through a state (:meth:`decode`): its method's entry has
        ``kernel_features`` for its options (hedgehog: without a window) or a ``decode_state``."""
        return self._features() is not None or subquad.get_method(self.method).decode_state is not None

    def _features(self, q: Tensor | None = None):
        """The entry's kernel feature function for this layer's options, or None."""
        info = subquad.get_method(self.method)
        if info.kernel_features is None:
            return None
        return info.kernel_features(info.make_options(**self._op_options(q)))

    def _inputs(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v in float32 (float64 stays), through the adapters."""
        q, k, v = (t.float() if t.dtype in (torch.float16, torch.bfloat16) else t for t in (q, k, v))
        if self.adapter:
            q = torch.einsum("bhnd,hde->bhne", q, self.q_adapter.to(q.dtype))
            k = torch.einsum("bhnd,hde->bhne", k, self.k_adapter.to(k.dtype))
        return q, k, v

    def _op_options(self, q: Tensor | None) -> dict[str, Any]:
        """The options the op gets: the retrofit's, the drawn buffers and learned parameters, a
        seeded generator (on q's device; none without q)."""
        opts = dict(self.options)
        opts.update({name: getattr(self, name) for name in self.drawn})
        if q is not None and subquad.get_method(self.method).stochastic and not self.drawn:
            opts["generator"] = torch.Generator(device=q.device).manual_seed(self.seed + 1000 * self.layer)
        return opts

    def _op_scale(self, q: Tensor, scale: float | None) -> float | None:
        """The model's logit scale, or None for a method without one (which must then be D^-0.5)."""
        if subquad.get_method(self.method).logit_scale:
            return scale
        if scale is not None and abs(scale - q.shape[-1] ** -0.5) > 1e-9 * scale:
            raise NotImplementedError(f"{self.method} has no logit scale; this model scales logits by {scale}, "
                                      f"not head_dim ** -0.5")
        return None

    def decode(self, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None, scale: float | None,
               layer: Any) -> Tensor:
        """Causal attention of ``n`` new tokens through the state kept in ``layer`` (a
        :class:`subquad.hf.cache.StateLayer`), which they then join. A kernel method's recurrent
        state computes the same as the parallel causal form in O(1) time and memory per token;
        a method's own ``decode_state`` (hybrid) what its docstring says."""
        from ..ops.linear.state import KernelState

        if not self.has_state:
            raise NotImplementedError(f"subquad retrofit: {self.method!r} (options {self.options}) has no decoding "
                                      "state; decode it with transformers' DynamicCache (subquad.hf.decoding_cache)")
        dtype = q.dtype
        q, k, v = self._inputs(q, k, v)
        info = subquad.get_method(self.method)
        o = info.make_options(**self._op_options(q))
        features = self._features(q)
        if features is None:
            if layer.state is None:
                layer.state = info.decode_state(o)
            return layer.state.attend(q, k, v, key_padding_mask, self._op_scale(q, scale)).to(dtype)
        phi_q, phi_k = features(q, k, self._op_scale(q, scale))
        if layer.state is None:
            layer.state = KernelState(getattr(o, "chunk_size", 64))
        return layer.state.attend(phi_q, phi_k, v.to(phi_q.dtype), key_padding_mask).to(dtype)

    def approx(self, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None, causal: bool,
               scale: float | None) -> Tensor:
        """The retrofitted attention (float32 math, output in q's dtype)."""
        dtype = q.dtype
        q, k, v = self._inputs(q, k, v)
        out = subquad.attention(q, k, v, method=self.method, key_padding_mask=key_padding_mask, causal=causal,
                                scale=self._op_scale(q, scale), **self._op_options(q))
        return out.to(dtype)


# ----------------------------------------------------------------------------- transformers glue


def _subquad_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                  mask_function=None, attention_mask: Tensor | None = None, **kwargs) -> Tensor | None:
    """``AttentionMaskInterface`` entry: the 2-D keep-mask ``(B, kv_length)`` (True = real token,
    transformers' convention) or None, for plain causal or bidirectional patterns only."""
    from transformers.masking_utils import bidirectional_mask_function, causal_mask_function, prepare_padding_mask

    if mask_function not in (causal_mask_function, bidirectional_mask_function):
        name = getattr(mask_function, "__qualname__", repr(mask_function))
        raise NotImplementedError(
            f"subquad retrofit supports plain bidirectional and plain causal masks (with padding); this model asked "
            f"for the mask pattern {name} (a sliding window, chunked or packed-sequence mask, or a custom overlay)")
    padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)
    if padding is None:
        return None
    padding = padding[:, kv_offset: kv_offset + kv_length].to(torch.bool)
    return None if bool(padding.all()) else padding


def _subquad_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                       attention_mask: Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                       is_causal: bool | None = None, **kwargs) -> tuple[Tensor, None]:
    """``AttentionInterface`` entry: ``(B, H, N, D)`` inputs -> ``((B, N, H, Dv), None)``."""
    r = getattr(module, "subquad_retrofit", None)
    if r is None:
        raise RuntimeError(f"{type(module).__name__} runs attn_implementation='subquad' but was not retrofitted; "
                           "call subquad.hf.retrofit(model, method) on the whole model, or load it with "
                           "attn_implementation='subquad_<method>' (subquad.hf.implementation_names())")
    for name in ("sliding_window", "softcap", "position_bias", "s_aux"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"subquad retrofit: this model passes {name}={kwargs[name]!r} to attention, "
                                      "which subquad does not implement")
    if attention_mask is not None and (not isinstance(attention_mask, Tensor) or attention_mask.ndim != 2):
        shape = tuple(attention_mask.shape) if isinstance(attention_mask, Tensor) else type(attention_mask).__name__
        raise NotImplementedError(
            f"subquad retrofit: got an attention mask of shape {shape}; only 2-D padding masks (B, seq) are "
            "supported (pass attention_mask as the tokenizer's (B, seq) 0/1 tensor, not a custom 4-D mask)")
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    causal = bool(is_causal) if is_causal is not None else bool(getattr(module, "is_causal", False))
    n, m = query.shape[2], key.shape[2]
    pad = None if attention_mask is None else ~attention_mask[:, -m:]
    layer = _state_layer(module, r)
    if layer is not None:  # a StateCache: the new tokens through the method's recurrent state
        if not causal or r.mode != "approx":
            raise NotImplementedError(f"subquad retrofit: a StateCache decodes causal layers with the approximation "
                                      f"(this call: causal={causal}, mode={r.mode!r}); use a DynamicCache")
        return r.decode(query, key, value, pad, scaling, layer).transpose(1, 2).contiguous(), None
    causal = causal and m > 1
    beside_keys = (causal and r.mode == "approx" and r.has_state and not subquad.get_method(r.method).query_local
                   and getattr(r.active_cache, "layers", None) is not None)
    if beside_keys and n == m:  # a prefill into transformers' cache: the state starts beside the keys
        return _decode_beside_keys(module, r, query, key, value, pad, scaling).transpose(1, 2).contiguous(), None
    if causal and n != m:
        # decoding with a KV cache: the queries are the last n positions
        if r.mode == "approx" and not subquad.get_method(r.method).query_local:
            if not r.has_state:
                local = [name for name in retrofit_methods() if subquad.get_method(name).query_local]
                raise NotImplementedError(f"subquad retrofit: cached decoding (query length {n} < key length {m}) "
                                          f"is supported for {local} and the methods with a decoding state, not "
                                          f"{r.method!r}; generate with use_cache=False (the whole prefix again "
                                          "for every token)")
            out = _decode_beside_keys(module, r, query, key, value, pad, scaling)
            return out.transpose(1, 2).contiguous(), None
        full = query.new_zeros(query.shape[0], query.shape[1], m, query.shape[3])  # left-pad the queries to m
        full[:, :, m - n:] = query
        out = r(full, key, value, pad, True, scaling)[:, :, m - n:]
    else:
        out = r(query, key, value, pad, causal, scaling)
    return out.transpose(1, 2).contiguous(), None


#: attribute of a cache layer (transformers' DynamicLayer) that holds the decoding state kept beside its keys
KEPT_STATE = "subquad_decoding"


def _decode_beside_keys(module: nn.Module, r: RetrofitAttention, query: Tensor, key: Tensor, value: Tensor,
                        pad: Tensor | None, scale: float | None) -> Tensor:
    """The ``n`` new queries of a method whose outputs at different queries depend on each other
    (hybrid) from a cache of keys and values (transformers' DynamicCache): through the method's
    decoding state, started by the prefill and kept on the cache layer. Each
    step checks the state against the cached keys (their count and sum per batch row): rows that
    beam search reordered take the state of the row whose keys they hold; a cache that was cropped
    or filled elsewhere gets a state rebuilt from its keys. The keys are all such a state has of
    the past, so hybrid's query block in progress then scores its key blocks with zero queries
    (the next block selects from real queries again)."""
    n, m = query.shape[2], key.shape[2]
    past = m - n
    layers = getattr(r.active_cache, "layers", None)
    cache_layer = layers[module.layer_idx] if layers is not None and module.layer_idx < len(layers) else None
    kept = getattr(cache_layer, KEPT_STATE, None)
    mark = key[:, :, :past].float().sum(2)
    if kept is not None and kept.seen == past and kept.mark.shape[1:] == mark.shape[1:]:
        _follow_reordered_rows(kept, mark)
    if (kept is None or kept.seen != past or kept.mark.shape != mark.shape
            or not torch.allclose(kept.mark, mark, rtol=1e-4, atol=1e-4)):
        kept = types.SimpleNamespace(state=None, seen=0, mark=None)
        if past:  # the cached tokens join the state; their outputs (from blank queries) are not used
            blank = query.new_zeros(query.shape[0], query.shape[1], past, query.shape[3])
            r.decode(blank, key[:, :, :past], value[:, :, :past], None if pad is None else pad[:, :past], scale, kept)
    out = r.decode(query, key[:, :, past:], value[:, :, past:], None if pad is None else pad[:, past:], scale, kept)
    kept.seen, kept.mark = m, key.float().sum(2)
    if cache_layer is not None:
        setattr(cache_layer, KEPT_STATE, kept)
    return out


def _follow_reordered_rows(kept: types.SimpleNamespace, mark: Tensor) -> None:
    """Where every batch row's cached keys (``mark``: their sum per head) are those of some row of
    ``kept`` (beam search picked and reordered rows), reorder ``kept``'s state to match."""
    if kept.mark.shape == mark.shape and torch.allclose(kept.mark, mark, rtol=1e-4, atol=1e-4):
        return
    gap = (mark[:, None] - kept.mark[None]).abs() - 1e-4 * kept.mark[None].abs()  # (new, old, H, D)
    best = gap.flatten(2).amax(-1).min(1)
    if bool((best.values <= 1e-4).all()) and kept.state is not None and hasattr(kept.state, "select"):
        kept.state.select(best.indices)
        kept.mark = kept.mark.index_select(0, best.indices)


def _state_layer(module: nn.Module, r: RetrofitAttention) -> Any:
    """The :class:`~subquad.hf.cache.StateLayer` of this call when its cache is a StateCache, else None."""
    from .cache import StateCache

    cache = r.active_cache
    return cache.layers[module.layer_idx] if isinstance(cache, StateCache) else None


def _remember_cache(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook of a retrofitted attention module: keep the call's cache for the attention
    function, which transformers does not hand it. The cache is the argument named as the installed
    transformers names it (:data:`~subquad.hf.cache.CACHE_ARGUMENT`); a :class:`StateCache` under
    the other name would reach no layer (the model would decode with a cache of its own), so it is
    refused."""
    from .cache import CACHE_ARGUMENT, StateCache

    other = "past_key_values" if CACHE_ARGUMENT == "cache" else "cache"
    if isinstance(kwargs.get(other), StateCache) and kwargs.get(CACHE_ARGUMENT) is not kwargs[other]:
        import transformers

        raise TypeError(f"subquad retrofit: transformers {transformers.__version__} takes the cache as "
                        f"{CACHE_ARGUMENT}=, not {other}=")
    module.subquad_retrofit.active_cache = kwargs.get(CACHE_ARGUMENT, kwargs.get(other))


def _forget_cache(module: nn.Module, args: tuple, output: Any) -> None:
    module.subquad_retrofit.active_cache = None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(IMPLEMENTATION, _subquad_attention)
    AttentionMaskInterface.register(IMPLEMENTATION, _subquad_mask)


def attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(qualified name, module)`` of every attention module that dispatches through
    ``AttentionInterface`` (it has ``config``, ``layer_idx`` and ``is_causal``), in model order."""
    from transformers import PreTrainedModel

    out = []
    for name, mod in model.named_modules():
        if isinstance(mod, (PreTrainedModel, RetrofitAttention)):
            continue
        if hasattr(mod, "config") and hasattr(mod, "is_causal") and hasattr(mod, "layer_idx"):
            out.append((name, mod))
    return out


def _heads_and_dim(mod: nn.Module) -> tuple[int, int]:
    cfg = mod.config
    heads = getattr(mod, "num_attention_heads", None) or getattr(mod, "num_heads", None) or cfg.num_attention_heads
    dim = getattr(mod, "head_dim", None) or getattr(mod, "attention_head_size", None)
    if dim is None:
        dim = cfg.hidden_size // heads
    return int(heads), int(dim)


def is_retrofitted(model: nn.Module) -> bool:
    return getattr(model, "_subquad_retrofit", None) is not None


def retrofit(model: nn.Module, method: str, **options: Any) -> nn.Module:
    """Switch every attention layer of a ``transformers`` model to subquad ``method``, in place.

    Args:
        model: a ``transformers.PreTrainedModel`` whose attention goes through
            ``AttentionInterface`` (BERT family, Llama, GPT-2, ...).
        method: a registered q/k/v method (``subquad.list_methods()``; ``"hedgehog"``, linear
            attention with learned feature maps, is the one made for this).
        **options: the method's options, plus ``adapter=True`` (per-head learnable q/k maps,
            identity at start) and ``seed`` (for the random pieces: Performer's projection,
            the samples of ``ra``/``lara``).

    Returns the same model. Pretrained weights are not modified; each attention module gains a
    child ``subquad_retrofit``, and the config the fields ``subquad_method`` and
    ``subquad_options`` (:data:`CONFIG_FIELDS`, for :func:`subquad.hf.save_pretrained`). A decoder
    then decodes through its method's own cache with nothing passed to ``generate`` or to a
    forward with ``use_cache`` (:mod:`subquad.hf.decoding`); a method that cannot decode from a
    cache warns here and switches ``use_cache`` off. Raises ``NotImplementedError`` for a decoder
    (causal attention) with a method that is not causal, and ``ValueError`` for an unknown method
    or option.
    """
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"retrofit needs a transformers PreTrainedModel, got {type(model).__name__}")
    if not isinstance(method, str) or method not in retrofit_methods():
        raise ValueError(f"unknown retrofit method {method!r}; known methods are {retrofit_methods()} "
                         "(token mixers such as hamburger have no q, k, v and cannot replace attention)")
    if is_retrofitted(model):
        raise ValueError("this model is already retrofitted; call subquad.hf.unretrofit(model) first")
    mods = attention_modules(model)
    if not mods:
        raise ValueError(f"found no attention module dispatching through AttentionInterface in "
                         f"{type(model).__name__}")
    if any(getattr(m, "is_cross_attention", False) or "crossattention" in n.lower() for n, m in mods):
        if not subquad.get_method(method).cross_attention:
            raise NotImplementedError(f"{type(model).__name__} has cross-attention; {method!r} does not support it")
    causal_layers = [n for n, m in mods if m.is_causal]
    if causal_layers and not subquad.get_method(method).causal:
        causal = [m for m in retrofit_methods() if subquad.get_method(m).causal]
        raise NotImplementedError(
            f"{type(model).__name__} is a decoder (causal attention in {causal_layers[0]} and others); method "
            f"{method!r} is not causal by construction. Causal methods: {causal}")
    _register()
    added = []
    try:
        for i, (_name, mod) in enumerate(mods):
            attach(mod, method, options, i)
            added.append(mod)
    except Exception:
        for mod in added:
            _detach(mod)
        raise
    previous = model.config._attn_implementation
    model.set_attn_implementation(IMPLEMENTATION)
    info = {"method": method, "options": dict(options), "previous": previous,
            "config": {name: getattr(model.config, name, None) for name in CONFIG_FIELDS}}
    model.config.subquad_method, model.config.subquad_options = method, copy.deepcopy(dict(options))
    if causal_layers:
        from .decoding import install

        info["decoding"] = install(model, method)
    model._subquad_retrofit = info
    return model


def attach(mod: nn.Module, method: str, options: dict[str, Any], index: int = 0) -> RetrofitAttention:
    """Give one attention module its :class:`RetrofitAttention` (``.subquad_retrofit``, on the
    module's device) and the hooks that show it the cache of each call. ``index``: the layer's
    position, used when the module has no integer ``layer_idx``."""
    heads, dim = _heads_and_dim(mod)
    layer = mod.layer_idx if isinstance(mod.layer_idx, int) else index
    r = RetrofitAttention(method, heads, dim, copy.deepcopy(options), layer=layer)
    p = next(mod.parameters(), None)
    if p is not None:
        r.to(device=p.device)
    mod.subquad_retrofit = r
    r.hooks = (mod.register_forward_pre_hook(_remember_cache, with_kwargs=True),
               mod.register_forward_hook(_forget_cache))
    return r


def unretrofit(model: nn.Module) -> nn.Module:
    """Undo :func:`retrofit`: remove the added modules and restore the previous attention."""
    info = getattr(model, "_subquad_retrofit", None)
    if info is None:
        raise ValueError("this model is not retrofitted")
    from .decoding import uninstall

    uninstall(model, info.get("decoding"))
    for _, mod in attention_modules(model):
        if hasattr(mod, "subquad_retrofit"):
            _detach(mod)
    model.set_attn_implementation(info["previous"] or "sdpa")
    for name, value in info.get("config", {}).items():
        if value is not None:
            setattr(model.config, name, value)
        elif hasattr(model.config, name):
            delattr(model.config, name)
    model._subquad_retrofit = None
    return model


def _detach(mod: nn.Module) -> None:
    """Remove a module's RetrofitAttention and its cache hooks."""
    for handle in getattr(mod.subquad_retrofit, "hooks", ()):
        handle.remove()
    del mod.subquad_retrofit


def retrofit_layers(model: nn.Module) -> list[tuple[str, RetrofitAttention]]:
    """``(attention module name, its RetrofitAttention)`` in model order."""
    return [(n, m.subquad_retrofit) for n, m in attention_modules(model) if hasattr(m, "subquad_retrofit")]


def set_mode(model: nn.Module, mode: str) -> None:
    """``"approx"``, ``"exact"`` or ``"record"`` for every retrofitted layer (see RetrofitAttention)."""
    if mode not in ("approx", "exact", "record"):
        raise ValueError(f"mode must be 'approx', 'exact' or 'record', got {mode!r}")
    for _, r in retrofit_layers(model):
        r.mode = mode
