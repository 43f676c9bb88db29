"""``subquad.MultiheadAttention``: ``torch.nn.MultiheadAttention`` with a choice of method.

The module owns the q/k/v/out projections (same parameter names as torch, so a trained
``nn.MultiheadAttention`` state dict loads into it) and an *attention core*: a small module
per method that calls the op and owns what the method itself needs (softmax's torch-style masks,
Performer's fixed features for eval, Nyström's depthwise conv skip, Sinkhorn's sort and LARA's
landmark networks). Each core is in its method's file beside this one (``layers/<method>.py``),
named by the method's registry entry (``core``); a method without one gets the plain
:class:`AttentionCore`. The module itself reproduces torch's argument handling (masks, unbatched
and nested inputs, ``add_bias_kv`` / ``add_zero_attn``, weights, errors); see its docstring.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from ..checks import check_int, user_stacklevel
from ..registry import MethodInfo, get_method, resolve_path

__all__ = ["MultiheadAttention", "AttentionCore", "MHAShapeError", "MHADtypeError", "MHAShapeRuntimeError"]


class AttentionCore(nn.Module):
    """Calls the method's op on ``(B, H, L, hd)`` tensors with the options fixed at
    construction. A method that needs state has a subclass in its own file (``layers/<method>.py``),
    named by the ``core`` import path of its registry entry.

    ``module_options``: a dataclass of the constructor options that belong to the core rather
    than to the op (with defaults, checked in its ``__post_init__``); the core reads them from
    ``self.module``, and the op never sees them. The tensors a method learns (its entry's
    ``learned_init``, e.g. hedgehog's feature maps) are parameters of the core, named as the op's
    options, and reach the op with them.
    """

    module_options: type | None = None

    def __init__(self, method: MethodInfo, num_heads: int, head_dim: int, options: dict, *,
                 dropout: float = 0.0, device=None, dtype=None):
        super().__init__()
        self.method = method
        self.num_heads = num_heads
        self.head_dim = head_dim
        options = dict(options)
        self.module = None
        if self.module_options is not None:
            mine = [f.name for f in dataclasses.fields(self.module_options) if f.name in options]
            self.module = self.module_options(**{name: options.pop(name) for name in mine})
        self.options = options
        self.dropout = dropout
        o = method.make_options(**self.options)  # validate now, not at the first forward
        init = {} if method.learned_init is None else method.learned_init(o, num_heads, head_dim)
        for name, t in init.items():
            self.register_parameter(name, nn.Parameter(t.to(device=device, dtype=dtype)))
        self.learned = tuple(init)

    def op_options(self) -> dict[str, Any]:
        return {**self.options, **{name: getattr(self, name) for name in self.learned}}

    def forward(self, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None, causal: bool,
                extra_keys: int = 0) -> Tensor:
        """q ``(B, H, N, hd)``, k, v ``(B, H, M, hd)`` -> ``(B, H, N, hd)``. ``extra_keys``: how many
        of the last keys are ``add_bias_kv`` / ``add_zero_attn`` extras (not tokens of the input)."""
        return self.method.op(q, k, v, key_padding_mask=key_padding_mask, causal=causal, **self.op_options())

    def reset_parameters(self) -> None:
        """Re-initialise what the core owns: the learned tensors to their initial values, and every
        child's own ``reset_parameters``."""
        if self.learned:
            init = self.method.learned_init(self.method.make_options(**self.options), self.num_heads, self.head_dim)
            with torch.no_grad():
                for name in self.learned:
                    getattr(self, name).copy_(init[name])
        for child in self.children():
            if hasattr(child, "reset_parameters"):
                child.reset_parameters()

    def extra_repr(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        return f"method={self.method.name!r}" + (f", {opts}" if opts else "")


class MHAShapeError(ValueError, AssertionError):
    """A bad argument shape or dtype: a ValueError, and also the AssertionError that
    ``torch.nn.MultiheadAttention`` raises for the same mistake (so code written for torch's
    exceptions keeps working)."""


class MHADtypeError(TypeError, AssertionError):
    """A mask of a dtype other than bool or float: a TypeError, and also the AssertionError
    ``torch.nn.MultiheadAttention`` raises."""


class MHAShapeRuntimeError(ValueError, RuntimeError):
    """A shape that torch rejects only inside an op (a batched ``attn_mask`` of the wrong size,
    key or value of the wrong width, a batch mismatch): a ValueError, and also the RuntimeError
    ``torch.nn.MultiheadAttention`` raises there."""


def _check_mask_dtype(name: str, mask: Tensor) -> None:
    if not isinstance(mask, Tensor):
        raise TypeError(f"{name} must be a tensor or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise MHADtypeError(f"{name} must be bool or float (bool: True = masked; float: added to the logits), "
                            f"got {mask.dtype}")


def _blocked_and_bias(mask: Tensor) -> tuple[Tensor, Tensor | None]:
    """A torch-style mask split into bool ``blocked`` (True or -inf) and the finite additive bias
    of a float mask (None for bool masks)."""
    if mask.dtype == torch.bool:
        return mask, None
    blocked = torch.isneginf(mask)
    return blocked, mask.masked_fill(blocked, 0.0)


def _as_padding_mask(mask: Tensor | None, batch: int, length: int) -> Tensor | None:
    """Bool ``(batch, length)`` (True = padding) from a bool mask or a float additive mask of 0 / -inf."""
    if mask is None:
        return None
    _check_mask_dtype("key_padding_mask", mask)
    if tuple(mask.shape) != (batch, length):
        raise MHAShapeError(f"key_padding_mask must have shape (batch, source length) = {(batch, length)}, "
                            f"got {tuple(mask.shape)}")
    blocked, bias = _blocked_and_bias(mask)
    # (a data-dependent check: skipped while torch.compile traces, where only -inf counts)
    if bias is not None and not torch.compiler.is_compiling() and bool(bias.ne(0).any()):
        raise ValueError("a float key_padding_mask may hold only 0 (keep) and -inf (padding) for approximate "
                         "methods; other additive biases need method='softmax'")
    return blocked


def _is_causal_pattern(blocked: Tensor) -> bool:
    """True when ``blocked`` ``(..., L, S)`` hides exactly the future keys (L == S) everywhere."""
    n, s = blocked.shape[-2:]
    if n != s:
        return False
    future = torch.ones(n, s, dtype=torch.bool, device=blocked.device).triu_(1)
    return bool(torch.equal(blocked, future.expand_as(blocked)))


def _nested_lengths(t: Tensor) -> list[int]:
    return [int(x.shape[0]) for x in t.unbind()]


class MultiheadAttention(nn.Module):
    """Drop-in for ``torch.nn.MultiheadAttention`` with ``method=`` and the method's options.

    Args mirror torch: ``embed_dim, num_heads, dropout=0.0, bias=True, add_bias_kv=False,
    add_zero_attn=False, kdim=None, vdim=None, batch_first=False, device=None, dtype=None``;
    then ``method`` (a name from :func:`subquad.list_methods`) and its options, e.g.
    ``MultiheadAttention(512, 8, method="nystrom", num_landmarks=64, batch_first=True)``.
    Parameter names, shapes and initialisation are torch's, so state dicts load both ways.
    ``dropout`` (on attention weights) exists only for ``softmax``. ``add_bias_kv`` and
    ``add_zero_attn`` append one learned / one zero key and value, visible to every query (when
    causal, and for self-attention-only methods, approximate methods get them as leading tokens
    with placeholder queries, so that causality holds for the input's tokens). In eval every
    method is deterministic (``ra`` then uses ``estimator="mixture_mean"``, see :class:`subquad.layers.ra.RaCore`).

    ``forward(query, key, value, key_padding_mask=None, need_weights=None, attn_mask=None,
    average_attn_weights=True, is_causal=False)`` takes ``(L, N, E)`` (``(N, L, E)`` with
    ``batch_first``), unbatched ``(L, E)`` (whatever ``batch_first`` says) or nested tensors
    ``(N, *, E)`` and returns ``(output, weights)``:

    - ``method="softmax"`` computes what torch computes for every argument: masks 2-D ``(L, S)`` or
      3-D ``(N * num_heads, L, S)``, bool (True = masked) or float (added to the logits),
      ``key_padding_mask`` ``(N, S)`` bool or float, weights averaged over heads ``(N, L, S)`` or
      per head ``(N, num_heads, L, S)`` (``need_weights=None`` means torch's default True). Where
      it differs: a query whose every key is masked outputs zeros (torch gives NaN);
      ``is_causal=True`` needs no ``attn_mask``; nested inputs work outside torch's fast path.
    - Other methods never form the weight matrix: ``weights`` is None. The default
      (``need_weights=None``) returns None quietly; an explicit ``need_weights=True`` also warns,
      once per module. ``attn_mask`` is accepted only where the method honours it exactly: one
      that masks nothing, the causal mask (same as ``is_causal=True``), or a mask that hides the same
      keys from every query and head (a key padding mask); anything else is a ValueError naming
      the method. A float ``key_padding_mask`` may hold only 0 and -inf.

    Bad shapes raise :class:`MHAShapeError` / :class:`MHAShapeRuntimeError`, ValueErrors that are
    also the AssertionError / RuntimeError torch raises for the same mistake; a mask of another
    dtype than bool or float raises :class:`MHADtypeError` (TypeError and AssertionError). Works
    as the ``self_attn`` / ``multihead_attn`` of ``torch.nn.TransformerEncoderLayer`` and
    ``TransformerDecoderLayer``, also when swapped into an already built ``TransformerEncoder``
    (whose eval fast path hands over nested tensors).
    """

    #: set inside :func:`subquad.distributed.context_parallel`: this rank's place in the sequence
    sequence_shards = None

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
                 add_bias_kv: bool = False, add_zero_attn: bool = False, kdim: int | None = None,
                 vdim: int | None = None, batch_first: bool = False, device=None, dtype=None, *,
                 method: str = "softmax", **options: Any):
        super().__init__()
        for name, d in (("embed_dim", embed_dim), ("num_heads", num_heads), ("kdim", kdim), ("vdim", vdim)):
            if d is None and name in ("kdim", "vdim"):
                continue
            check_int("MultiheadAttention", name, d, minimum=1)  # TypeError for a non-int, as torch
        if embed_dim % num_heads:
            raise MHAShapeError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        info = get_method(method)
        if info.kind != "attention":
            raise ValueError(f"method {method!r} is a token mixer on x (B, N, C), not attention on q, k, v; "
                             f"build it with subquad.get_method({method!r}).module(embed_dim, num_heads)")
        if dropout > 0 and not info.exact:
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
        self.add_zero_attn = bool(add_zero_attn)
        packed = self.kdim == embed_dim and self.vdim == embed_dim
        self._packed_qkv = packed
        # torch's TransformerEncoder(Layer) reads this flag to pick its fused exact-attention
        # fast path; only plain softmax may take it (the fused kernel knows no extra keys).
        self._qkv_same_embed_dim = packed and info.exact and not (add_bias_kv or add_zero_attn)
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
        if add_bias_kv:
            self.bias_k = nn.Parameter(torch.empty(1, 1, embed_dim, **factory))
            self.bias_v = nn.Parameter(torch.empty(1, 1, embed_dim, **factory))
        else:
            self.bias_k = self.bias_v = None
        self._reset_parameters()  # torch's order of draws: the same seed gives torch's weights
        core_cls = AttentionCore if info.core is None else resolve_path(info.core)
        self.core = core_cls(info, num_heads, self.head_dim, options, dropout=dropout, **factory)
        self._warned_weights = False

    def _reset_parameters(self) -> None:
        """torch's initialisation of the projections (xavier uniform, zero biases, xavier normal
        ``bias_k`` / ``bias_v``); ``out_proj.weight`` keeps the init of its ``nn.Linear``."""
        if self._packed_qkv:
            nn.init.xavier_uniform_(self.in_proj_weight)
        else:
            nn.init.xavier_uniform_(self.q_proj_weight)
            nn.init.xavier_uniform_(self.k_proj_weight)
            nn.init.xavier_uniform_(self.v_proj_weight)
        if self.in_proj_bias is not None:
            nn.init.constant_(self.in_proj_bias, 0.0)
            nn.init.constant_(self.out_proj.bias, 0.0)
        if self.bias_k is not None:
            nn.init.xavier_normal_(self.bias_k)
            nn.init.xavier_normal_(self.bias_v)

    def reset_parameters(self) -> None:
        """Initialise every parameter and buffer as a fresh module would: ``out_proj``, the q/k/v
        projections and biases (torch's init, in torch's order), then the core's own state
        (Performer's projection buffer, landmark and sort networks, Nyström's conv). Use it after
        ``to_empty()`` of a module built on the meta device."""
        self.out_proj.reset_parameters()
        self._reset_parameters()
        self.core.reset_parameters()

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
                need_weights: bool | None = None, attn_mask: Tensor | None = None,
                average_attn_weights: bool = True, is_causal: bool = False) -> tuple[Tensor, Tensor | None]:
        """See the class docstring. Returns ``(output, weights)``: output ``(L, N, E)`` /
        ``(N, L, E)`` / ``(L, E)`` (nested in, nested out); weights as torch's or None."""
        for name, t in (("query", query), ("key", key), ("value", value)):
            if not isinstance(t, Tensor):
                raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        exact = get_method(self.method).exact
        if need_weights is None:
            need_weights = exact
        elif need_weights and not exact:
            if not getattr(self, "_warned_weights", False):
                warnings.warn(f"need_weights=True: method {self.method!r} never forms the attention weight "
                              "matrix, so the weights returned are None (pass need_weights=False to say so)",
                              UserWarning, stacklevel=user_stacklevel())
                self._warned_weights = True
            need_weights = False
        if query.is_nested or key.is_nested or value.is_nested:
            return self._forward_nested(query, key, value, key_padding_mask, attn_mask, is_causal)
        return self._forward_dense(query, key, value, key_padding_mask, need_weights, attn_mask,
                                   average_attn_weights, bool(is_causal), self.batch_first)

    def _forward_dense(self, query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights,
                       is_causal, batch_first):
        """forward on plain tensors, with the layout given by ``batch_first`` (nested inputs come
        here padded, batch first)."""
        exact = get_method(self.method).exact
        unbatched = self._check_shapes(query, key, value, key_padding_mask, attn_mask)
        if unbatched:
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif not batch_first:
            # keep identity (query is key is value) so the packed projection runs once
            tq = query.transpose(0, 1)
            tk = tq if key is query else key.transpose(0, 1)
            value = tk if value is key else value.transpose(0, 1)
            query, key = tq, tk
        B, L, S = query.shape[0], query.shape[1], key.shape[1]
        if key.shape[0] != B:
            raise MHAShapeRuntimeError(f"query and key must have the same batch size, got {B} and {key.shape[0]}")
        if attn_mask is not None:
            _check_mask_dtype("attn_mask", attn_mask)
            want = (L, S) if attn_mask.dim() == 2 else (B * self.num_heads, L, S)
            if tuple(attn_mask.shape) != want:
                raise MHAShapeRuntimeError(f"attn_mask of {attn_mask.dim()} dims must have shape {want}, "
                                           f"got {tuple(attn_mask.shape)}")
            attn_mask = attn_mask.view(1, 1, L, S) if attn_mask.dim() == 2 else attn_mask.view(B, -1, L, S)
        if key_padding_mask is not None:
            _check_mask_dtype("key_padding_mask", key_padding_mask)
            if tuple(key_padding_mask.shape) != (B, S):
                raise MHAShapeError(f"key_padding_mask must have shape (batch, source length) = {(B, S)}, "
                                    f"got {tuple(key_padding_mask.shape)}")
        q, k, v = self._project(query, key, value)
        H, hd = self.num_heads, self.head_dim
        q = q.unflatten(-1, (H, hd)).transpose(1, 2)
        k = k.unflatten(-1, (H, hd)).transpose(1, 2)
        v = v.unflatten(-1, (H, hd)).transpose(1, 2)
        extra_k, extra_v = self._extra_keys(B, k)
        if self.sequence_shards is not None:
            out, weights = self._sharded(q, k, v, extra_k, key_padding_mask, attn_mask, is_causal, need_weights), None
        elif exact:
            out, weights = self.core.forward_masked(q, k, v, extra_k, extra_v, key_padding_mask, attn_mask,
                                                    is_causal, need_weights)
            if weights is not None and average_attn_weights:
                weights = weights.mean(1)
        else:
            out, weights = self._approximate(q, k, v, extra_k, extra_v, key_padding_mask, attn_mask,
                                             is_causal), None
        out = self.out_proj(out.transpose(1, 2).flatten(2))
        if unbatched:
            out = out.squeeze(0)
            if weights is not None:
                weights = weights.squeeze(0)
        elif not batch_first:
            out = out.transpose(0, 1)
        return out, weights

    def check_context_parallel(self) -> None:
        """ValueError when this layer cannot run on a shard of the sequence
        (:func:`subquad.distributed.context_parallel`): its method has no sharded form, or it has
        attention dropout."""
        from ..distributed import supported_methods

        if self.core.method.context_parallel is None:
            raise ValueError(f"method {self.method!r} has no context-parallel form; supported: {supported_methods()}")
        if self.dropout:
            raise ValueError(f"context parallelism runs without attention dropout (this layer has {self.dropout})")

    def _sharded(self, q, k, v, extra_k, key_padding_mask, attn_mask, causal, need_weights) -> Tensor:
        """Attention of this rank's q, k, v over the whole sequence of the ranks in
        ``sequence_shards`` (:func:`subquad.distributed.attention`)."""
        from ..distributed import attention

        if attn_mask is not None or extra_k is not None or need_weights:
            raise ValueError("under context parallelism a layer takes is_causal and key_padding_mask only: "
                             "no attn_mask, add_bias_kv / add_zero_attn or need_weights=True")
        pad = _as_padding_mask(key_padding_mask, k.shape[0], k.shape[2])
        return attention(q, k, v, method=self.method, causal=causal, key_padding_mask=pad,
                         group=self.sequence_shards.group, **self.core.op_options())

    # torch's TransformerEncoderLayer fast path (taken for method="softmax" in eval under no_grad)
    # calls self_attn.merge_masks; the combination only needs num_heads, so torch's method serves
    merge_masks = nn.MultiheadAttention.merge_masks

    def _check_shapes(self, query, key, value, key_padding_mask, attn_mask) -> bool:
        """torch's shape rules; True when the input is unbatched (2-D query)."""
        if query.dim() not in (2, 3):
            raise MHAShapeError(f"query should be unbatched 2-D or batched 3-D, got {query.dim()}-D")
        want = query.dim()
        for name, t in (("key", key), ("value", value)):
            if t.dim() != want:
                raise MHAShapeError(f"for {'batched' if want == 3 else 'unbatched'} {want}-D query, {name} "
                                    f"should be {want}-D, got {t.dim()}-D")
        if key_padding_mask is not None and isinstance(key_padding_mask, Tensor) and key_padding_mask.dim() != want - 1:
            raise MHAShapeError(f"for {want}-D query, key_padding_mask should be {want - 1}-D, "
                                f"got {key_padding_mask.dim()}-D")
        if attn_mask is not None and isinstance(attn_mask, Tensor):
            if attn_mask.dim() not in (2, 3):
                raise MHAShapeError(f"attn_mask should be 2-D or 3-D, got {attn_mask.dim()}-D")
            expected = (self.num_heads, query.shape[0], key.shape[0])
            if want == 2 and attn_mask.dim() == 3 and tuple(attn_mask.shape) != expected:
                raise MHAShapeError(f"for unbatched (L, E) query, a 3-D attn_mask should have shape "
                                    f"(num_heads, L, S) = {expected}, got {tuple(attn_mask.shape)}")
        if query.shape[-1] != self.embed_dim:
            raise MHAShapeError(f"query must have embedding dimension {self.embed_dim}, got {query.shape[-1]}")
        for name, t, dim in (("key", key, self.kdim), ("value", value, self.vdim)):
            if t.shape[-1] != dim:
                raise MHAShapeRuntimeError(f"{name} must have last dimension {dim}, got {t.shape[-1]}")
        if key.shape[:-1] != value.shape[:-1]:
            raise MHAShapeError(f"key and value must share batch and length, got {tuple(key.shape)} and "
                                f"{tuple(value.shape)}")
        return want == 2

    def _extra_keys(self, batch: int, k: Tensor) -> tuple[Tensor | None, Tensor | None]:
        """The ``add_bias_kv`` and ``add_zero_attn`` keys and values, ``(B, H, e, hd)`` (e <= 2), or None."""
        ks, vs = [], []
        shape = (batch, self.num_heads, 1, self.head_dim)
        if self.bias_k is not None:
            ks.append(self.bias_k.to(k.dtype).view(1, self.num_heads, 1, self.head_dim).expand(shape))
            vs.append(self.bias_v.to(k.dtype).view(1, self.num_heads, 1, self.head_dim).expand(shape))
        if self.add_zero_attn:
            zero = k.new_zeros(shape)
            ks.append(zero)
            vs.append(zero)
        if not ks:
            return None, None
        return torch.cat(ks, dim=2), torch.cat(vs, dim=2)

    def _approximate(self, q, k, v, extra_k, extra_v, key_padding_mask, attn_mask, causal) -> Tensor:
        """Every method but softmax: reduce the masks to (key padding, causal) or refuse, then
        add the extra keys and call the core."""
        B, S = k.shape[0], k.shape[2]
        pad = _as_padding_mask(key_padding_mask, B, S)
        # is_causal=True says attn_mask is the causal mask; trusted as torch trusts it (no
        # data-dependent check, so a compiled encoder passing both stays one graph)
        if attn_mask is not None and not causal:
            blocked, bias = _blocked_and_bias(attn_mask)
            if bias is not None and bool(bias.ne(0).any()):
                raise ValueError(f"method {self.method!r} cannot add a float attn_mask to its logits (it never "
                                 "forms them); only 0 / -inf masks that are causal or hide whole keys, or "
                                 "method='softmax'")
            if not bool(blocked.any()):
                pass
            elif _is_causal_pattern(blocked):
                causal = True
            elif bool((blocked == blocked[:, :1, :1, :]).all()):
                keys = blocked[:, 0, 0, :].expand(B, S)
                pad = keys if pad is None else pad | keys
            else:
                raise ValueError(f"method {self.method!r} cannot honour this attn_mask exactly: it takes only "
                                 "the causal mask (or is_causal=True) and masks that hide the same keys from "
                                 "every query (use key_padding_mask); use method='softmax' for other masks")
        if extra_k is None:
            return self.core(q, k, v, pad, causal)
        e = extra_k.shape[2]
        info = self.core.method
        if pad is not None:
            pad = torch.cat([pad, pad.new_zeros(B, e)], dim=1)
        if not causal and info.cross_attention:
            # extra keys appended, as torch does; every query sees them
            return self.core(q, torch.cat([k, extra_k], 2), torch.cat([v, extra_v], 2), pad, causal, extra_keys=e)
        # causal or self-attention-only methods: the extras go first, with e placeholder queries
        # (zeros, outputs dropped), so that every real query sees them and causality holds
        if pad is not None:
            pad = pad.roll(e, dims=1)
        q = torch.cat([q.new_zeros(q.shape[:2] + (e, q.shape[3])), q], 2)
        out = self.core(q, torch.cat([extra_k, k], 2), torch.cat([extra_v, v], 2), pad, causal)
        return out[:, :, e:]

    def _forward_nested(self, query, key, value, key_padding_mask, attn_mask, is_causal):
        """Nested ``(N, *, E)`` inputs (what torch's encoder fast path hands its layers): padded
        tensors plus the key padding mask their lengths imply, then a nested output with the
        query's lengths. Weights are None, as torch returns them for nested inputs."""
        if key_padding_mask is not None or attn_mask is not None:
            raise ValueError("with nested tensor inputs the lengths are the padding: pass no "
                             "key_padding_mask or attn_mask")
        nested = {}
        padded = []
        for t in (query, key, value):
            if id(t) not in nested:
                if t.is_nested:
                    nested[id(t)] = (torch.nested.to_padded_tensor(t, 0.0), _nested_lengths(t))
                else:
                    nested[id(t)] = (t, None)
            padded.append(nested[id(t)][0])
        q, k, v = padded
        lengths_q = nested[id(query)][1]
        lengths_k = nested[id(key)][1]
        if lengths_k is not None:
            lengths = torch.tensor(lengths_k, device=k.device)
            key_padding_mask = torch.arange(k.shape[1], device=k.device)[None, :] >= lengths[:, None]
        out, _ = self._forward_dense(q, k, v, key_padding_mask, False, None, True, bool(is_causal), True)
        if lengths_q is None:
            return out, None
        parts = [out[i, :n] for i, n in enumerate(lengths_q)]
        return torch.nested.as_nested_tensor(parts, layout=query.layout), None

    def extra_repr(self) -> str:
        extra = f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, batch_first={self.batch_first}"
        if self.bias_k is not None:
            extra += ", add_bias_kv=True"
        if self.add_zero_attn:
            extra += ", add_zero_attn=True"
        return extra
