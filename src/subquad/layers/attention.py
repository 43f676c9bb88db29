"""``subquad.MultiheadAttention``: ``torch.nn.MultiheadAttention`` with a choice of method.

The module owns the q/k/v/out projections (same parameter names as torch, so a trained
``nn.MultiheadAttention`` state dict loads into it) and an *attention core*: a small module
per method that calls the op and owns what the method itself needs (Performer's fixed
features for eval, Nyström's depthwise conv skip; later sort and landmark networks).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from ..ops.performer import random_projection
from ..registry import MethodInfo, get_method

__all__ = ["MultiheadAttention", "AttentionCore", "register_core"]


class AttentionCore(nn.Module):
    """Calls the method's op on ``(B, H, L, hd)`` tensors with the options fixed at
    construction. Subclasses registered with :func:`register_core` add state.

    ``module_options`` names the constructor options that belong to the core rather than to
    the op (they are not passed to the op).
    """

    module_options: tuple[str, ...] = ()

    def __init__(self, method: MethodInfo, num_heads: int, head_dim: int, options: dict, *,
                 dropout: float = 0.0, device=None, dtype=None):
        super().__init__()
        self.method = method
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.options = dict(options)
        self.dropout = dropout
        method.make_options(**self.options)  # validate now, not at the first forward

    def op_options(self) -> dict[str, Any]:
        return dict(self.options)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None, causal: bool) -> Tensor:
        return self.method.op(q, k, v, key_padding_mask=key_padding_mask, causal=causal, **self.op_options())

    def extra_repr(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        return f"method={self.method.name!r}" + (f", {opts}" if opts else "")


_CORES: dict[str, type[AttentionCore]] = {}


def register_core(name: str):
    """Class decorator: use this :class:`AttentionCore` subclass for method ``name``."""

    def decorator(cls):
        _CORES[name] = cls
        return cls

    return decorator


@register_core("softmax")
class SoftmaxCore(AttentionCore):
    """Exact attention; the module's ``dropout`` is dropout on the attention weights."""

    def op_options(self):
        return {**self.options, "dropout_p": self.dropout if self.training else 0.0}


@register_core("performer")
class PerformerCore(AttentionCore):
    """Performer with a fixed projection buffer for eval (deterministic) and, while training
    with ``redraw_features=True`` (default), a fresh projection at every forward."""

    module_options = ("redraw_features",)

    def __init__(self, method, num_heads, head_dim, options, *, dropout=0.0, device=None, dtype=None):
        options = dict(options)
        self.redraw_features = options.pop("redraw_features", True)
        if not isinstance(self.redraw_features, bool):
            raise TypeError(f"performer: redraw_features must be a bool, got {self.redraw_features!r}")
        if "features" in options:
            raise ValueError("performer: MultiheadAttention owns its features; do not pass 'features'")
        super().__init__(method, num_heads, head_dim, options)
        o = method.make_options(**options)
        w = random_projection(o.num_features, head_dim, orthogonal=o.orthogonal, generator=o.generator)
        self.register_buffer("features", w.to(device=device, dtype=torch.float32))

    @torch.no_grad()
    def redraw(self, generator: torch.Generator | None = None) -> None:
        """Draw a new fixed projection (the one used in eval)."""
        o = self.method.make_options(**self.options)
        w = random_projection(o.num_features, self.head_dim, orthogonal=o.orthogonal, generator=generator)
        self.features.copy_(w)

    def op_options(self):
        if self.training and self.redraw_features:
            return dict(self.options)
        return {**self.options, "features": self.features}


@register_core("nystrom")
class NystromCore(AttentionCore):
    """Nyström attention plus the optional depthwise conv skip on V (``conv_kernel_size``,
    odd, default off): one length-k kernel per head along the sequence, shared across the
    head's features (``Conv2d(H, H, (k, 1), groups=H)``), added to the attention output.
    Padded values are zeroed before the conv."""

    module_options = ("conv_kernel_size",)

    def __init__(self, method, num_heads, head_dim, options, *, dropout=0.0, device=None, dtype=None):
        options = dict(options)
        ks = options.pop("conv_kernel_size", None)
        super().__init__(method, num_heads, head_dim, options)
        self.conv = None
        if ks is not None:
            if isinstance(ks, bool) or not isinstance(ks, int) or ks < 1 or ks % 2 == 0:
                raise ValueError(f"nystrom: conv_kernel_size must be an odd positive int or None, got {ks!r}")
            self.conv = nn.Conv2d(num_heads, num_heads, (ks, 1), padding=(ks // 2, 0), groups=num_heads,
                                  bias=False, device=device, dtype=dtype)

    def forward(self, q, k, v, key_padding_mask, causal):
        out = super().forward(q, k, v, key_padding_mask, causal)
        if self.conv is not None:
            if q.shape[2] != v.shape[2]:
                raise ValueError("nystrom: the conv skip needs equal query and key lengths")
            if key_padding_mask is not None:
                v = v.masked_fill(key_padding_mask[:, None, :, None], 0.0)
            out = out + self.conv(v)
        return out

    def extra_repr(self):
        return super().extra_repr() + (f", conv_kernel_size={self.conv.kernel_size[0]}" if self.conv else "")


def _as_padding_mask(mask: Tensor | None, batch: int, length: int) -> Tensor | None:
    """Bool (True = padding) from a bool mask or a float additive mask of 0 / -inf."""
    if mask is None:
        return None
    if not isinstance(mask, Tensor):
        raise TypeError(f"key_padding_mask must be a tensor, got {type(mask).__name__}")
    if tuple(mask.shape) != (batch, length):
        raise ValueError(f"key_padding_mask must have shape (batch, source length) = {(batch, length)}, "
                         f"got {tuple(mask.shape)}")
    if mask.dtype == torch.bool:
        return mask
    if mask.is_floating_point():
        pad = torch.isneginf(mask)
        if not torch.all(pad | (mask == 0)):
            raise ValueError("a float key_padding_mask may hold only 0 (keep) and -inf (padding); "
                             "other additive biases are not supported")
        return pad
    raise TypeError(f"key_padding_mask must be bool or float, got {mask.dtype}")


def _is_causal_mask(mask: Tensor, n: int, s: int) -> bool:
    if tuple(mask.shape) != (n, s) or n != s:
        return False
    future = torch.ones(n, s, dtype=torch.bool, device=mask.device).triu_(1)
    blocked = mask if mask.dtype == torch.bool else torch.isneginf(mask)
    if mask.dtype != torch.bool and not torch.all(torch.isneginf(mask) | (mask == 0)):
        return False
    return bool(torch.equal(blocked, future))


class MultiheadAttention(nn.Module):
    """Drop-in for ``torch.nn.MultiheadAttention`` with ``method=`` and the method's options.

    Args mirror torch: ``embed_dim, num_heads, dropout=0.0, bias=True, add_bias_kv=False,
    add_zero_attn=False, kdim=None, vdim=None, batch_first=False, device=None, dtype=None``;
    then ``method`` (a name from :func:`subquad.list_methods`) and its options, e.g.
    ``MultiheadAttention(512, 8, method="nystrom", num_landmarks=64, batch_first=True)``.
    ``dropout`` (on attention weights) exists only for ``softmax``. ``add_bias_kv`` and
    ``add_zero_attn`` are not supported.

    ``forward(query, key, value, key_padding_mask=None, need_weights=False, attn_mask=None,
    average_attn_weights=True, is_causal=False)`` returns ``(output, weights)``; weights are
    None unless ``need_weights=True``, which only the exact ``softmax`` method can honour.
    ``key_padding_mask`` is bool (True = padding) or float 0/-inf as in torch. ``attn_mask``
    may only be the causal mask (or pass ``is_causal=True``). Works as the ``self_attn`` of a
    ``torch.nn.TransformerEncoderLayer``.
    """

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
                 add_bias_kv: bool = False, add_zero_attn: bool = False, kdim: int | None = None,
                 vdim: int | None = None, batch_first: bool = False, device=None, dtype=None, *,
                 method: str = "softmax", **options: Any):
        super().__init__()
        if isinstance(embed_dim, bool) or not isinstance(embed_dim, int) or embed_dim <= 0:
            raise ValueError(f"embed_dim must be a positive int, got {embed_dim!r}")
        if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads <= 0:
            raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        if add_bias_kv or add_zero_attn:
            raise ValueError("subquad.MultiheadAttention does not support add_bias_kv or add_zero_attn")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        info = get_method(method)
        if info.kind != "attention":
            raise ValueError(f"method {method!r} is a token mixer on x (B, N, C), not attention on q, k, v; "
                             f"build it with subquad.get_method({method!r}).module(embed_dim, num_heads)")
        if dropout > 0 and method != "softmax":
            raise ValueError(f"dropout on attention weights exists only for method='softmax', not {method!r}; "
                             "use dropout=0.0")
        factory = {"device": device, "dtype": dtype}
        self.embed_dim = embed_dim
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.dropout = dropout
        self.batch_first = batch_first
        self.method = method
        packed = self.kdim == embed_dim and self.vdim == embed_dim
        self._packed_qkv = packed
        # torch's TransformerEncoder(Layer) reads this flag to pick its fused exact-attention
        # fast path; only the softmax method may take it.
        self._qkv_same_embed_dim = packed and method == "softmax"
        if packed:
            self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim, **factory))
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        else:
            self.q_proj_weight = nn.Parameter(torch.empty(embed_dim, embed_dim, **factory))
            self.k_proj_weight = nn.Parameter(torch.empty(embed_dim, self.kdim, **factory))
            self.v_proj_weight = nn.Parameter(torch.empty(embed_dim, self.vdim, **factory))
            self.register_parameter("in_proj_weight", None)
        if bias:
            self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim, **factory))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = nn.modules.linear.NonDynamicallyQuantizableLinear(embed_dim, embed_dim, bias=bias, **factory)
        core_cls = _CORES.get(method, AttentionCore)
        self.core = core_cls(info, num_heads, self.head_dim, options, dropout=dropout, **factory)
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        if self._packed_qkv:
            nn.init.xavier_uniform_(self.in_proj_weight)
        else:
            nn.init.xavier_uniform_(self.q_proj_weight)
            nn.init.xavier_uniform_(self.k_proj_weight)
            nn.init.xavier_uniform_(self.v_proj_weight)
        if self.in_proj_bias is not None:
            nn.init.constant_(self.in_proj_bias, 0.0)
            nn.init.constant_(self.out_proj.bias, 0.0)

    def _project(self, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        E = self.embed_dim
        b = self.in_proj_bias
        bq, bk, bv = (None, None, None) if b is None else b.split(E)
        if self._packed_qkv:
            if query is key and key is value:
                return F.linear(query, self.in_proj_weight, b).split(E, dim=-1)
            wq, wk, wv = self.in_proj_weight.split(E)
        else:
            wq, wk, wv = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
        return F.linear(query, wq, bq), F.linear(key, wk, bk), F.linear(value, wv, bv)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Tensor | None = None,
                need_weights: bool = False, attn_mask: Tensor | None = None,
                average_attn_weights: bool = True, is_causal: bool = False) -> tuple[Tensor, Tensor | None]:
        for name, t in (("query", query), ("key", key), ("value", value)):
            if not isinstance(t, Tensor):
                raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
            if t.is_nested:
                raise TypeError(f"{name} is a nested tensor; subquad.MultiheadAttention takes padded "
                                "tensors and a key_padding_mask (build torch.nn.TransformerEncoder with "
                                "enable_nested_tensor=False)")
        if need_weights and self.method != "softmax":
            raise ValueError(f"need_weights=True needs the exact weight matrix, which method {self.method!r} "
                             "never forms; use method='softmax' or need_weights=False")
        unbatched = query.dim() == 2
        if unbatched:
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        for name, t, dim in (("query", query, self.embed_dim), ("key", key, self.kdim), ("value", value, self.vdim)):
            if t.dim() != 3:
                raise ValueError(f"{name} must be 2-D (unbatched) or 3-D, got shape {tuple(t.shape)}")
            if t.shape[-1] != dim:
                raise ValueError(f"{name} must have last dimension {dim}, got {t.shape[-1]}")
        if self.batch_first:
            B, N, S = query.shape[0], query.shape[1], key.shape[1]
        else:
            B, N, S = query.shape[1], query.shape[0], key.shape[0]
            # keep identity (query is key is value) so the packed projection runs once
            tq = query.transpose(0, 1)
            tk = tq if key is query else key.transpose(0, 1)
            value = tk if value is key else value.transpose(0, 1)
            query, key = tq, tk
        if key.shape[:2] != value.shape[:2] or key.shape[0] != B:
            raise ValueError(
                f"key and value must share batch and length, got {tuple(key.shape)} and {tuple(value.shape)}"
            )
        pad = _as_padding_mask(key_padding_mask, B, S)
        causal = bool(is_causal)
        if attn_mask is not None and not causal:
            if not _is_causal_mask(attn_mask, N, S):
                raise ValueError("subquad.MultiheadAttention accepts attn_mask only as the causal mask "
                                 "(or pass is_causal=True); use key_padding_mask for padding")
            causal = True
        q, k, v = self._project(query, key, value)
        H, hd = self.num_heads, self.head_dim
        q = q.unflatten(-1, (H, hd)).transpose(1, 2)
        k = k.unflatten(-1, (H, hd)).transpose(1, 2)
        v = v.unflatten(-1, (H, hd)).transpose(1, 2)
        weights = None
        if need_weights:
            out, weights = self._exact_with_weights(q, k, v, pad, causal)
            if average_attn_weights:
                weights = weights.mean(1)
        else:
            out = self.core(q, k, v, pad, causal)
        out = self.out_proj(out.transpose(1, 2).flatten(2))
        if not self.batch_first:
            out = out.transpose(0, 1)
        if unbatched:
            out = out.squeeze(1)
            if weights is not None:
                weights = weights.squeeze(0)
        return out, weights

    # torch's TransformerEncoderLayer fast path (taken for method="softmax" in eval under no_grad)
    # calls self_attn.merge_masks; the combination only needs num_heads, so torch's method serves
    merge_masks = nn.MultiheadAttention.merge_masks

    def _exact_with_weights(self, q, k, v, pad, causal):
        from ..ops.exact import attention_bias

        logits = (q @ k.transpose(-2, -1)) * (self.head_dim ** -0.5)
        bias = attention_bias(pad, q.shape[2], k.shape[2], causal, logits.dtype, q.device)
        if bias is not None:
            logits = logits + bias
        w = torch.softmax(logits, dim=-1)
        if pad is not None:
            from ..ops._masks import no_key_rows

            w = w.masked_fill(no_key_rows(pad, q.shape[2], causal), 0.0)
        return F.dropout(w, self.dropout, self.training) @ v, w

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, batch_first={self.batch_first}"
