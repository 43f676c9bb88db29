"""The method registry: one entry per attention mechanism, with its capabilities and options.

An op is registered with :func:`register_method` (a token mixer with :func:`register_mixer`). The
entry declares everything about the method: its op and options, its capabilities, the layer core
:class:`subquad.MultiheadAttention` builds for it, its FLOP formula, the peer package it is compared
with and the options the generic tests run it under. Things above ``ops`` in the package (layer
cores, peer adapters) are named by import path (``"package.module:attr"``) and imported only when
used, so this module imports nothing of subquad but :mod:`subquad.checks`. The built-in methods
register when :mod:`subquad.ops` is imported, which the registry does by name the first time it is
asked for a method it lacks, listed or added to (so ``import subquad`` stays cheap: the ``subquad``
command answers ``--help`` without importing torch).

The decorator returns the *checked* op: it validates q/k/v and the mask, refuses combinations the
method does not support (causal, cross-attention), builds the method's options dataclass (whose
``__post_init__`` validates ranges) and calls the raw implementation with ``scale`` resolved. So
every public op and :func:`subquad.attention` share one path of checks.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from .checks import check_qkv, check_scale

__all__ = ["MethodInfo", "register_method", "register_mixer", "get_method", "list_methods", "attention", "prepare_call",
           "resolve_path"]

TestOptions = dict[str, Any] | Callable[[int, torch.dtype], dict[str, Any]]


@dataclass(frozen=True)
class MethodInfo:
    """What a method is and what it can do.

    ``kind`` is ``"attention"`` (an op on q, k, v with the library signature, in ``op``) or
    ``"mixer"`` (a token mixer on ``x`` ``(B, N, C)`` with no q/k/v, such as Hamburger; its
    ``nn.Module`` class is ``module`` and ``op`` is None).
    ``complexity`` is ``"linear"`` (nothing of size N x M is formed) or ``"quadratic"``.
    ``stochastic`` is True when the op can draw randomness (it then takes ``generator``; its
    default mode may still be deterministic, as LARA's and Sinkhorn's eval modes are).
    ``learned_parameters`` is True when the method's module owns parameters beyond the
    q/k/v/out projections (a sort network, landmark networks).
    """

    name: str
    summary: str
    causal: bool
    key_padding: bool
    cross_attention: bool
    complexity: str
    stochastic: bool
    learned_parameters: bool
    options: type
    op: Callable[..., Tensor] | None = dataclasses.field(repr=False, compare=False)
    kind: str = "attention"
    #: import path of a token mixer's module class (``kind == "mixer"``; see :attr:`module`)
    module_path: str | None = dataclasses.field(default=None, repr=False, compare=False)
    #: import path of the :class:`subquad.layers.AttentionCore` subclass the module builds for
    #: this method (None: the plain core, which calls ``op`` with the module's options)
    core: str | None = dataclasses.field(default=None, repr=False, compare=False)
    #: ``flops(B, H, N, M, D, Dv, options) -> int``: matmul FLOPs of one non-causal forward with the
    #: full options (see :mod:`subquad.compare.flops`); None: counted at run time
    flops: Callable[..., int] | None = dataclasses.field(default=None, repr=False, compare=False)
    #: import path of the :class:`subquad.compare.peers.Peer` this method is compared with
    peer: str | None = dataclasses.field(default=None, repr=False, compare=False)
    #: options for the generic tests' tiny shapes (a dict, or ``(head_dim, dtype) -> dict``)
    test_options: TestOptions | None = dataclasses.field(default=None, repr=False, compare=False)
    #: options under which a stochastic method samples (for the test that seeds matter)
    sampling_options: dict[str, Any] | None = dataclasses.field(default=None, repr=False, compare=False)
    #: False when the op, given a ``key_padding_mask``, takes shapes from the mask's values (so
    #: ``torch.compile(fullgraph=True)`` cannot trace it; with graph breaks allowed it compiles)
    fullgraph_with_padding: bool = dataclasses.field(default=True, compare=False)
    #: True for exact softmax attention: it forms the attention weights (``need_weights``, dropout
    #: on them, torch's fused encoder path) and is the baseline the benchmarks measure against
    exact: bool = dataclasses.field(default=False, compare=False)
    #: False for a method without a logit scale (its op refuses an explicit ``scale``)
    logit_scale: bool = dataclasses.field(default=True, compare=False)
    #: True when a query's causal output depends on that query and the keys and values only, not
    #: on the other queries: a decoder may then compute new queries alone against the cache
    query_local: bool = dataclasses.field(default=False, compare=False)
    #: ``fixed_draw(options, head_dim, generator) -> {option name: tensor}``: the random tensors a
    #: stochastic method also takes as options, drawn once (Performer's ``features``), so that a
    #: layer can keep them as buffers and run deterministically
    fixed_draw: Callable[..., dict[str, Tensor]] | None = dataclasses.field(default=None, repr=False, compare=False)
    #: ``length_multiple(options) -> int``: what a padded batch's length should be a multiple of
    #: for these options (the full options dataclass; Sinkhorn's block size); None: any length
    length_multiple: Callable[[Any], int] | None = dataclasses.field(default=None, repr=False, compare=False)
    #: ``kernel_features(options) -> features | None`` with ``features(q, k, scale) -> (phi(q),
    #: phi(k))``: for a method whose causal form, under these options (the full dataclass), is
    #: normalised kernel attention with non-negative features (linear, performer, hedgehog without a
    #: window), its feature maps, so that a decoder can carry the running sums instead of the keys
    #: and values (:class:`subquad.ops.linear.state.KernelState`); None for options without that form
    kernel_features: Callable[[Any], Callable[..., tuple[Tensor, Tensor]] | None] | None = dataclasses.field(
        default=None, repr=False, compare=False)
    #: ``decode_state(options) -> state``: for a causal method that decodes through a state of its
    #: own rather than kernel features (hybrid: the keys and values and its selection), a fresh
    #: per-layer state with ``attend(q, k, v, key_padding_mask, scale) -> out`` for the new tokens
    #: (which then join it), ``select(batch_index)``, ``nbytes()`` and ``seen``
    decode_state: Callable[[Any], Any] | None = dataclasses.field(default=None, repr=False, compare=False)
    #: True for a method that forms every logit to measure a selection rule's quality (topk, quest,
    #: moba, xattention, magicpig): ``subquad compare`` runs it when named, not by default
    quality_reference: bool = False
    #: ``budget_options(options, keys) -> {option name: value}``: for a sparse method, the options
    #: that change from ``options`` so that a query attends exactly to about ``keys`` keys (beyond
    #: its own block or page; ValueError for a budget below its smallest selection): one budget for
    #: every sparse method, so they compare at equal cost
    budget_options: Callable[[Any, int], dict[str, Any]] | None = dataclasses.field(default=None, repr=False,
                                                                                   compare=False)
    #: ``expected_keys(q, k, causal, options) -> (B, H, N)``: for a method whose number of keys a
    #: query attends is random or set by the inputs (magicpig's hashed sample), the expected number
    #: each query attends on these q and k (the full options dataclass); ``subquad compare --source
    #: smollm`` reports it as the row's keys per query
    expected_keys: Callable[..., Tensor] | None = dataclasses.field(default=None, repr=False, compare=False)
    #: ``learned_init(options, num_heads, head_dim) -> {option name: tensor}``: the tensors a method
    #: learns, which its op takes as options, at their initial values (hedgehog's feature maps); a
    #: layer (:class:`subquad.layers.AttentionCore`, a retrofit) keeps them as parameters
    learned_init: Callable[..., dict[str, Tensor]] | None = dataclasses.field(default=None, repr=False,
                                                                             compare=False)
    #: ``context_parallel(q, k, v, key_padding_mask, causal, scale, options, group) -> Tensor``: the
    #: op on one process's contiguous shard of a sequence split over a ``torch.distributed`` group
    #: (the full options dataclass; ``scale`` None when the caller gave none), differentiable through
    #: the collectives; called by :func:`subquad.distributed.attention`. None: not supported
    context_parallel: Callable[..., Tensor] | None = dataclasses.field(default=None, repr=False, compare=False)
    # the options' field names, read once here: torch.compile cannot trace dataclasses.fields()
    option_names: tuple[str, ...] = dataclasses.field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "option_names", tuple(f.name for f in dataclasses.fields(self.options)))

    def option_defaults(self) -> dict[str, Any]:
        """The method's options and their default values."""
        out = {}
        for f in dataclasses.fields(self.options):
            if f.default is not dataclasses.MISSING:
                out[f.name] = f.default
            elif f.default_factory is not dataclasses.MISSING:  # pragma: no cover
                out[f.name] = f.default_factory()
        return out

    @property
    def module(self) -> type | None:
        """A token mixer's module class, ``module(embed_dim, num_heads, **options)`` (imported now)."""
        return None if self.module_path is None else resolve_path(self.module_path)

    def module_option_defaults(self) -> dict[str, Any]:
        """The options of the method's layer core (``MultiheadAttention``) beyond the op's, and their
        defaults: the fields of its core's ``module_options`` dataclass (checked there)."""
        if self.core is None:
            return {}
        options = getattr(resolve_path(self.core), "module_options", None)
        return {} if options is None else {f.name: f.default for f in dataclasses.fields(options)}

    def make_options(self, **options: Any):
        """Build (and so validate) the options dataclass; unknown names are a ValueError.
        Traceable by ``torch.compile(fullgraph=True)``."""
        unknown = sorted(name for name in options if name not in self.option_names)
        if unknown:
            raise ValueError(
                f"method {self.name!r} got unknown option(s) {unknown}; "
                f"valid options are {list(self.option_names) or 'none'}"
            )
        return self.options(**options)


_REGISTRY: dict[str, MethodInfo] = {}
#: the package whose import registers the built-in methods (named, not imported: it is above this module)
BUILT_IN = "subquad.ops"
_built_in_loaded = False


def _load_built_in() -> None:
    """Import :data:`BUILT_IN` once, so the built-in methods are registered before any lookup,
    listing or new entry (a new entry after them, and a clash with one of them refused). During
    that import the package is already in ``sys.modules``, so its own entries do not recurse."""
    global _built_in_loaded
    if not _built_in_loaded:
        _built_in_loaded = True
        importlib.import_module(BUILT_IN)


def _check_new(name: str, complexity: str, **paths: str | None) -> None:
    """Refuse a bad name, a taken name, an unknown complexity or a malformed import path."""
    _load_built_in()
    if not isinstance(name, str) or not name:
        raise ValueError(f"a method name must be a non-empty str, got {name!r}")
    if name in _REGISTRY:
        raise ValueError(f"method {name!r} is already registered")
    if complexity not in ("linear", "quadratic"):
        raise ValueError(f"complexity must be 'linear' or 'quadratic', got {complexity!r}")
    for key, path in paths.items():
        if path is not None and (not isinstance(path, str) or path.count(":") != 1):
            raise ValueError(f"method {name!r}: {key} must be an import path 'package.module:attr', got {path!r}")


def _add(name: str, complexity: str, **fields: Any) -> MethodInfo:
    """Build the entry and store it under ``name``."""
    _check_new(name, complexity, core=fields.get("core"), peer=fields.get("peer"), module=fields.get("module_path"))
    info = MethodInfo(name=name, complexity=complexity, **fields)
    _REGISTRY[name] = info
    return info


def unregister(name: str) -> None:
    """Remove ``name`` from the registry (for tests and notebooks that register a throwaway
    method); KeyError when it is not registered."""
    del _REGISTRY[name]


def _check_call(info: MethodInfo, q: Tensor, k: Tensor, key_padding_mask: Tensor | None, causal: bool,
                scale: float | None, generator: Any) -> float | None:
    """What the op checks beyond the shapes: causal, padding and scale against the entry, a
    generator under torch.compile; returns the checked scale."""
    name = info.name
    if not isinstance(causal, bool):
        raise TypeError(f"{name}: causal must be a bool, got {type(causal).__name__} {causal!r}")
    if causal:
        if not info.causal:
            supported = [m.name for m in _REGISTRY.values() if m.causal]
            raise NotImplementedError(f"method {name!r} is not causal by construction; causal=True is "
                                      f"supported by {supported}")
        if q.shape[2] != k.shape[2]:
            raise ValueError(f"{name}: causal=True needs equal query and key lengths, got N={q.shape[2]}, "
                             f"M={k.shape[2]}")
    if key_padding_mask is not None and not info.key_padding:
        raise NotImplementedError(f"method {name!r} does not support key_padding_mask")
    if generator is not None and torch.compiler.is_compiling():
        raise ValueError(f"{name}: torch.compile cannot trace a torch.Generator; under torch.compile pass "
                         "generator=None (the op draws from the global RNG: seed it with torch.manual_seed)")
    return None if scale is None else check_scale(name, scale)


def prepare_call(info: MethodInfo, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None, causal: bool,
                 scale: float | None, options: dict[str, Any]) -> tuple[float | None, Any]:
    """What every op of ``info`` checks before it runs: the shapes, dtypes and mask of q, k, v,
    causal, padding and scale against the entry, and the options; returns the checked scale (None
    when none was given) and the options dataclass."""
    check_qkv(q, k, v, key_padding_mask, name=info.name, cross_attention=info.cross_attention)
    scale = _check_call(info, q, k, key_padding_mask, causal, scale, options.get("generator"))
    return scale, info.make_options(**options)


def register_method(
    name: str,
    *,
    options: type,
    summary: str,
    causal: bool,
    cross_attention: bool,
    complexity: str,
    stochastic: bool = False, learned_parameters: bool = False, key_padding: bool = True,
    core: str | None = None, flops: Callable[..., int] | None = None, peer: str | None = None,
    test_options: TestOptions | None = None, sampling_options: dict[str, Any] | None = None,
    fullgraph_with_padding: bool = True, length_multiple: Callable[[Any], int] | None = None,
    exact: bool = False, logit_scale: bool = True, query_local: bool = False,
    fixed_draw: Callable[..., dict[str, Tensor]] | None = None,
    kernel_features: Callable[[Any], Callable[..., tuple[Tensor, Tensor]] | None] | None = None,
    learned_init: Callable[..., dict[str, Tensor]] | None = None,
    decode_state: Callable[[Any], Any] | None = None,
    budget_options: Callable[[Any, int], dict[str, Any]] | None = None,
    quality_reference: bool = False,
    expected_keys: Callable[..., Tensor] | None = None,
    context_parallel: Callable[..., Tensor] | None = None,
) -> Callable[[Callable[..., Tensor]], Callable[..., Tensor]]:
    """Decorator: register ``impl(q, k, v, key_padding_mask, causal, scale, **options)`` (or, when it
    has a parameter ``options``, ``impl(..., options=<the validated dataclass>)``) under ``name``
    and return the checked public op. ``impl`` gets ``scale=None`` when the caller gave none (methods
    without a logit scale can then refuse an explicit one). Keywords: the fields of :class:`MethodInfo`."""
    _check_new(name, complexity, core=core, peer=peer)

    def decorator(impl: Callable[..., Tensor]) -> Callable[..., Tensor]:
        info: MethodInfo | None = None  # set below; the wrapper reads it from its closure
        whole = "options" in inspect.signature(impl).parameters  # the validated dataclass, not its fields

        def op(
            q: Tensor,
            k: Tensor,
            v: Tensor,
            *,
            key_padding_mask: Tensor | None = None,
            causal: bool = False,
            scale: float | None = None,
            **opts: Any,
        ) -> Tensor:
            scale, o = prepare_call(info, q, k, v, key_padding_mask, causal, scale, opts)
            if whole:
                return impl(q, k, v, key_padding_mask, causal, scale, options=o)
            return impl(q, k, v, key_padding_mask, causal, scale, **{n: getattr(o, n) for n in info.option_names})

        # One code object per method: torch.compile caches compiled graphs per code object, so
        # sharing one wrapper between methods would make a model whose layers use several
        # methods (or options) recompile it until dynamo's recompile limit.
        op.__code__ = op.__code__.replace(co_name=impl.__name__, co_qualname=impl.__qualname__)
        # the op and its implementation read apart in a traceback
        impl.__code__ = impl.__code__.replace(co_name=f"{impl.__name__}_impl", co_qualname=f"{impl.__qualname__}_impl")
        functools.update_wrapper(op, impl)
        del op.__wrapped__  # the internal signature is not the public one
        op.__signature__ = _public_signature(name, options)
        info = _add(name, complexity, summary=summary, causal=causal, key_padding=key_padding, options=options,
                    cross_attention=cross_attention, stochastic=stochastic, learned_parameters=learned_parameters,
                    op=op, core=core, flops=flops,
                    peer=peer, test_options=test_options, sampling_options=sampling_options,
                    fullgraph_with_padding=fullgraph_with_padding, length_multiple=length_multiple, exact=exact,
                    logit_scale=logit_scale, query_local=query_local, fixed_draw=fixed_draw,
                    kernel_features=kernel_features, learned_init=learned_init, decode_state=decode_state,
                    budget_options=budget_options, quality_reference=quality_reference, expected_keys=expected_keys,
                    context_parallel=context_parallel)
        return op

    return decorator


_COMMON = ("q", "k", "v", "key_padding_mask", "causal", "scale")


def _public_signature(name: str, options: type) -> inspect.Signature:
    """``(q, k, v, *, key_padding_mask=None, causal=False, scale=None, <options with defaults>)``."""
    P = inspect.Parameter
    params = [P(arg, P.POSITIONAL_OR_KEYWORD, annotation="Tensor") for arg in "qkv"]
    params += [
        P("key_padding_mask", P.KEYWORD_ONLY, default=None, annotation="Tensor | None"),
        P("causal", P.KEYWORD_ONLY, default=False, annotation="bool"),
        P("scale", P.KEYWORD_ONLY, default=None, annotation="float | None"),
    ]
    for f in dataclasses.fields(options):
        if f.name in _COMMON:
            raise ValueError(f"method {name!r}: option {f.name!r} clashes with an argument of every op")
        default = f.default
        if default is dataclasses.MISSING and f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        params.append(P(f.name, P.KEYWORD_ONLY, default=default, annotation=f.type))
    return inspect.Signature(params, return_annotation="Tensor")


def register_mixer(
    name: str,
    *,
    module: str,
    options: type,
    summary: str,
    complexity: str,
    causal: bool = False,
    key_padding: bool = True,
    stochastic: bool = False,
    learned_parameters: bool = True,
    peer: str | None = None,
    test_options: TestOptions | None = None,
) -> None:
    """Register a token mixer that is not a q/k/v op: ``module`` is the import path
    (``"package.module:Class"``) of a class whose ``Class(embed_dim, num_heads, **options)`` builds
    an ``nn.Module`` whose ``forward(x, key_padding_mask=None)`` maps ``(B, N, C)``
    to ``(B, N, C)``. Mixers are self-only (no cross-attention)."""
    _add(name, complexity, summary=summary, causal=causal, key_padding=key_padding, cross_attention=False,
         stochastic=stochastic, learned_parameters=learned_parameters, options=options, op=None,
         kind="mixer", module_path=module, peer=peer, test_options=test_options)


def resolve_path(path: str) -> Any:
    """The object an import path ``"package.module:attr"`` names (a registry entry's ``core`` or
    ``peer``), importing its module now."""
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def get_method(name: str) -> MethodInfo:
    """The registry entry for ``name``; ValueError listing the known methods otherwise."""
    if isinstance(name, str) and name not in _REGISTRY:
        _load_built_in()
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(f"unknown method {name!r}; known methods are {sorted(_REGISTRY)}")
    return _REGISTRY[name]


def list_methods() -> list[MethodInfo]:
    """Every registered method with its capabilities, in registration order."""
    _load_built_in()
    return list(_REGISTRY.values())


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    method: str = "softmax",
    key_padding_mask: Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    **options: Any,
) -> Tensor:
    """Attention by any registered method.

    Args:
        q: ``(B, H, N, D)`` queries. k: ``(B, H, M, D)`` keys. v: ``(B, H, M, Dv)`` values.
        method: a name from :func:`list_methods`.
        key_padding_mask: bool ``(B, M)``, True marks padding.
        causal: query i sees keys 0..i (only for methods that are causal by construction).
        scale: logit scale, default ``D ** -0.5``.
        **options: the method's options (see ``get_method(method).option_defaults()``).

    Returns:
        ``(B, H, N, Dv)`` in the dtype of ``q``.
    """
    info = get_method(method)
    if info.op is None:
        raise ValueError(
            f"method {method!r} is a token mixer on x (B, N, C), not an attention op on q, k, v; "
            f"build it with subquad.layers (see get_method({method!r}).module)"
        )
    return info.op(
        q, k, v, key_padding_mask=key_padding_mask, causal=causal, scale=scale, **options
    )

