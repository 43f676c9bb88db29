"""The method registry: built-in entries and their capabilities, lookups, options, and the
``subquad.attention`` dispatch."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import pytest
import torch

import subquad
import subquad.ops
from conftest import ATTENTION_METHODS, generic_options, method_options, qkv, sampling_options
from subquad import registry
from subquad.layers import AttentionCore

# name -> (causal, cross_attention, complexity, stochastic)
BUILT_IN = {
    "softmax": (True, True, "quadratic", False),
    "linear": (True, True, "linear", False),
    "efficient": (False, True, "linear", False),
    "performer": (True, True, "linear", True),
    "nystrom": (False, True, "linear", False),
}

BUILT_IN_OPS = {
    "softmax": subquad.ops.softmax_attention,
    "linear": subquad.ops.linear_attention,
    "efficient": subquad.ops.efficient_attention,
    "performer": subquad.ops.performer_attention,
    "nystrom": subquad.ops.nystrom_attention,
}

BUILT_IN_DEFAULTS = {
    "softmax": {"dropout_p": 0.0},
    "linear": {"chunk_size": 64},
    "efficient": {},
    "performer": {
        "num_features": 256,
        "orthogonal": True,
        "features": None,
        "generator": None,
        "eps": 1e-6,
        "chunk_size": 64,
    },
    "nystrom": {"num_landmarks": 64, "pinv_iterations": 6, "pinv_init": "per_matrix"},
}

# the layer cores of the methods whose modules own state: each in its method's file
BUILT_IN_CORES = {
    "softmax": "subquad.layers.softmax:SoftmaxCore",
    "performer": "subquad.layers.performer:PerformerCore",
    "nystrom": "subquad.layers.nystrom:NystromCore",
    "ra": "subquad.layers.ra:RaCore",
    "lara": "subquad.layers.lara:LaraCore",
    "sinkhorn": "subquad.layers.sinkhorn:SinkhornCore",
}

BUILT_IN_PEERS = {
    "nystrom": "subquad.compare.peers:NYSTROM_ATTENTION",
    "performer": "subquad.compare.peers:PERFORMER_PYTORCH",
    "sinkhorn": "subquad.compare.peers:SINKHORN_TRANSFORMER",
    "hamburger": "subquad.compare.peers:HAMBURGER_PYTORCH",
}


@pytest.fixture
def scratch_registry():
    """Lets a test register throwaway methods; the registry is restored afterwards."""
    saved = dict(registry._REGISTRY)
    yield
    registry._REGISTRY.clear()
    registry._REGISTRY.update(saved)


@dataclass
class _NoOptions:
    pass


def test_built_in_methods_are_listed_with_their_capabilities():
    infos = {m.name: m for m in subquad.list_methods()}
    assert set(BUILT_IN) <= set(infos)
    for name, (causal, cross, complexity, stochastic) in BUILT_IN.items():
        info = infos[name]
        assert info.kind == "attention"
        assert info.causal is causal, name
        assert info.cross_attention is cross, name
        assert info.complexity == complexity, name
        assert info.stochastic is stochastic, name
        assert info.key_padding is True, name
        assert info.learned_parameters is False, name
        assert info.op is not None and info.summary


def test_list_methods_registration_order_and_get_method():
    names = [m.name for m in subquad.list_methods()]
    assert names[:5] == list(BUILT_IN)
    assert len(names) == len(set(names))
    for info in subquad.list_methods():
        assert subquad.get_method(info.name) is info
        assert info.complexity in ("linear", "quadratic")
        assert info.kind in ("attention", "mixer")


def test_unknown_method_lists_known_names():
    with pytest.raises(ValueError, match="unknown method 'nope'") as err:
        subquad.get_method("nope")
    for name in (m.name for m in subquad.list_methods()):
        assert repr(name) in str(err.value)
    q, k, v = qkv(1, 1, 4, 8)
    with pytest.raises(ValueError, match="known methods are .*'softmax'"):
        subquad.attention(q, k, v, method="nope")


@pytest.mark.parametrize("name", ATTENTION_METHODS)
def test_unknown_option_names_valid_options(name):
    info = subquad.get_method(name)
    q, k, v = qkv(1, 2, 6, 8)
    with pytest.raises(ValueError, match=rf"{name}.*unknown option.*'not_an_option'") as err:
        subquad.attention(q, k, v, method=name, not_an_option=1)
    valid = list(info.option_defaults())
    message = str(err.value)
    if valid:
        for option in valid:
            assert repr(option) in message
    else:
        assert "none" in message


@pytest.mark.parametrize("name", list(BUILT_IN_DEFAULTS))
def test_built_in_option_defaults(name):
    assert subquad.get_method(name).option_defaults() == BUILT_IN_DEFAULTS[name]


@pytest.mark.parametrize("name", ATTENTION_METHODS)
def test_defaults_are_valid_options(name):
    """Every option has a default, and the defaults pass the options' own validation."""
    info = subquad.get_method(name)
    options = info.make_options(**info.option_defaults())
    assert options == info.make_options()


@pytest.mark.parametrize("name", list(BUILT_IN_OPS))
def test_attention_dispatches_to_the_op(name):
    """``subquad.attention(..., method=name)`` equals the op in ``subquad.ops`` (and the
    registry entry's op), with a mask and without."""
    assert subquad.get_method(name).op is BUILT_IN_OPS[name]
    q, k, v = qkv(2, 2, 9, 8, dv=5)
    mask = torch.zeros(2, 9, dtype=torch.bool)
    mask[1, 4:] = True
    for kpm in (None, mask):
        via_api = subquad.attention(
            q, k, v, method=name, key_padding_mask=kpm, **method_options(name, 8, q.dtype)
        )
        direct = BUILT_IN_OPS[name](q, k, v, key_padding_mask=kpm, **method_options(name, 8, q.dtype))
        assert torch.equal(via_api, direct)


def test_attention_default_method_is_softmax():
    q, k, v = qkv(1, 2, 6, 8)
    assert torch.equal(subquad.attention(q, k, v), subquad.ops.softmax_attention(q, k, v))


def test_register_twice_raises(scratch_registry):
    def impl(q, k, v, key_padding_mask, causal, scale):
        return v

    kwargs = {
        "options": _NoOptions, "summary": "test", "causal": False, "cross_attention": True, "complexity": "linear",
    }
    with pytest.raises(ValueError, match="'softmax' is already registered"):
        subquad.register_method("softmax", **kwargs)(impl)
    op = subquad.register_method("_scratch_identity", **kwargs)(impl)
    assert "_scratch_identity" in [m.name for m in subquad.list_methods()]
    q, k, v = qkv(1, 2, 6, 8)
    assert torch.equal(subquad.attention(q, k, v, method="_scratch_identity"), v)
    assert torch.equal(op(q, k, v), v)
    with pytest.raises(ValueError, match="'_scratch_identity' is already registered"):
        subquad.register_method("_scratch_identity", **kwargs)(impl)


def test_registered_op_is_checked(scratch_registry):
    """The op returned by register_method validates inputs and refuses what its flags exclude."""

    def impl(q, k, v, key_padding_mask, causal, scale):
        return v

    op = subquad.register_method(
        "_scratch_self", options=_NoOptions, summary="test", causal=False, cross_attention=False,
        complexity="quadratic", key_padding=False,
    )(impl)
    q, k, v = qkv(1, 2, 6, 8)
    with pytest.raises(NotImplementedError, match="causal=True is supported by"):
        op(q, k, v, causal=True)
    with pytest.raises(NotImplementedError, match="key_padding_mask"):
        op(q, k, v, key_padding_mask=torch.zeros(1, 6, dtype=torch.bool))
    q2, k2, v2 = qkv(1, 2, 6, 8, m=7)
    with pytest.raises(ValueError, match="self-attention only"):
        op(q2, k2, v2)
    with pytest.raises(ValueError, match="unknown option"):
        op(q, k, v, anything=1)


def test_register_bad_complexity_raises():
    with pytest.raises(ValueError, match="complexity must be 'linear' or 'quadratic'"):
        subquad.register_method(
            "_scratch_bad", options=_NoOptions, summary="", causal=False, cross_attention=True,
            complexity="cubic",
        )
    assert "_scratch_bad" not in [m.name for m in subquad.list_methods()]


def test_attention_refuses_a_mixer(scratch_registry):
    registry.register_mixer(
        "_scratch_mixer", module="torch.nn:Identity", options=_NoOptions, summary="test", complexity="linear"
    )
    info = subquad.get_method("_scratch_mixer")
    assert info.kind == "mixer" and info.op is None and info.cross_attention is False
    q, k, v = qkv(1, 2, 6, 8)
    with pytest.raises(ValueError, match="token mixer"):
        subquad.attention(q, k, v, method="_scratch_mixer")
    with pytest.raises(ValueError, match="already registered"):
        registry.register_mixer(
            "_scratch_mixer", module="torch.nn:Identity", options=_NoOptions, summary="", complexity="linear"
        )


@pytest.mark.parametrize("name", ATTENTION_METHODS)
def test_op_signature_is_the_public_one(name):
    """``inspect.signature`` of a registered op shows what a caller passes: q, k, v, then
    keyword-only key_padding_mask, causal, scale and the method's options with their defaults
    (not the wrapper's ``**opts`` nor the implementation's positional internals)."""
    info = subquad.get_method(name)
    sig = inspect.signature(info.op)
    params = list(sig.parameters.values())
    assert [p.name for p in params[:3]] == ["q", "k", "v"]
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params[:3])
    rest = {p.name: p.default for p in params[3:]}
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params[3:])
    assert rest == {"key_padding_mask": None, "causal": False, "scale": None, **info.option_defaults()}
    assert info.op.__name__ == info.op.__code__.co_name
    assert info.op.__doc__ and "Shapes" in info.op.__doc__
    # the signature binds what the op accepts
    sig.bind(1, 2, 3, key_padding_mask=None, causal=False, **info.option_defaults())


def test_each_method_has_its_own_code_object():
    """torch.compile caches per code object: one wrapper code shared by every method would
    recompile on every change of method, up to dynamo's recompile limit."""
    codes = [subquad.get_method(name).op.__code__ for name in ATTENTION_METHODS]
    assert len({id(c) for c in codes}) == len(codes)


def test_registered_signature_of_a_new_method(scratch_registry):
    @dataclass
    class _Opts:
        width: int = 3

    def impl(q, k, v, key_padding_mask, causal, scale, *, width):
        """Shapes: identity on v."""
        return v

    op = subquad.register_method(
        "_scratch_sig", options=_Opts, summary="test", causal=False, cross_attention=True, complexity="linear"
    )(impl)
    assert str(inspect.signature(op)) == (
        "(q: 'Tensor', k: 'Tensor', v: 'Tensor', *, key_padding_mask: 'Tensor | None' = None, "
        "causal: 'bool' = False, scale: 'float | None' = None, width: 'int' = 3) -> 'Tensor'"
    )


def test_option_named_like_an_argument_is_refused(scratch_registry):
    @dataclass
    class _Clash:
        scale: float = 1.0

    with pytest.raises(ValueError, match="option 'scale' clashes"):
        subquad.register_method(
            "_scratch_clash", options=_Clash, summary="", causal=False, cross_attention=True, complexity="linear"
        )(lambda q, k, v, key_padding_mask, causal, scale: v)
    assert "_scratch_clash" not in [m.name for m in subquad.list_methods()]


@pytest.mark.parametrize("name", list(BUILT_IN_CORES))
def test_built_in_cores_are_named_by_their_entries(name):
    info = subquad.get_method(name)
    assert info.core == BUILT_IN_CORES[name]
    assert issubclass(registry.resolve_path(info.core), AttentionCore)


@pytest.mark.parametrize("name", ATTENTION_METHODS)
def test_module_builds_the_core_its_entry_names(name):
    """``MultiheadAttention`` builds the entry's ``core`` (the plain ``AttentionCore`` without one)."""
    info = subquad.get_method(name)
    expected = AttentionCore if info.core is None else registry.resolve_path(info.core)
    assert type(subquad.MultiheadAttention(16, 2, method=name, **generic_options(name)).core) is expected


def test_a_new_method_names_its_core(scratch_registry):
    kwargs = {"options": _NoOptions, "summary": "test", "causal": False, "cross_attention": True,
              "complexity": "linear"}
    subquad.register_method("_scratch_plain", **kwargs)(lambda q, k, v, key_padding_mask, causal, scale: v)
    subquad.register_method("_scratch_ra_core", core="subquad.layers.ra:RaCore", **kwargs)(
        lambda q, k, v, key_padding_mask, causal, scale: v
    )
    assert type(subquad.MultiheadAttention(8, 2, method="_scratch_plain").core) is AttentionCore
    assert type(subquad.MultiheadAttention(8, 2, method="_scratch_ra_core").core).__name__ == "RaCore"
    with pytest.raises(ValueError, match="import path"):
        subquad.register_method("_scratch_bad_core", core="subquad.layers.ra.RaCore", **kwargs)


def test_peers_are_named_by_import_path():
    peers = {m.name: m.peer for m in subquad.list_methods() if m.peer is not None}
    assert {name: peers.get(name) for name in BUILT_IN_PEERS} == BUILT_IN_PEERS


@pytest.mark.parametrize("name", ["softmax", "linear", "efficient", "performer", "nystrom", "ra", "lara", "sinkhorn"])
def test_flops_formula_is_registered(name):
    """These attention methods declare their FLOP formula (a method without one is counted at run
    time by the benchmarks): a positive int at a small shape."""
    info = subquad.get_method(name)
    assert callable(info.flops)
    assert info.flops(1, 2, 16, 16, 8, 8, info.option_defaults()) > 0


@pytest.mark.parametrize("name", ATTENTION_METHODS)
def test_test_and_sampling_options_are_valid(name):
    info = subquad.get_method(name)
    info.make_options(**generic_options(name), **sampling_options(name))
    if info.sampling_options:
        assert info.stochastic


def test_unregister(scratch_registry):
    subquad.register_method(
        "_scratch_gone", options=_NoOptions, summary="test", causal=False, cross_attention=True, complexity="linear"
    )(lambda q, k, v, key_padding_mask, causal, scale: v)
    registry.unregister("_scratch_gone")
    assert "_scratch_gone" not in [m.name for m in subquad.list_methods()]
    with pytest.raises(KeyError):
        registry.unregister("_scratch_gone")


@pytest.mark.parametrize("name", [m.name for m in subquad.list_methods() if m.kind == "attention"])
def test_module_options_are_registry_facts(name):
    """A layer core's own options (``module_options``, a dataclass) are listed with their defaults by
    the entry, are accepted by ``MultiheadAttention`` at those defaults, never reach the op, and
    are checked with the method's name."""
    info = subquad.get_method(name)
    module = info.module_option_defaults()
    assert not set(module) & set(info.option_names), name
    tiny = info.test_options if isinstance(info.test_options, dict) else {}
    mha = subquad.MultiheadAttention(16, 2, method=name, batch_first=True, **module, **tiny)
    assert not set(module) & set(mha.core.options), name
    if module:
        first = next(iter(module))
        with pytest.raises((ValueError, TypeError), match=name):
            subquad.MultiheadAttention(16, 2, method=name, **{first: object()})


def test_one_call_checks_once(monkeypatch):
    """``MultiheadAttention(method="hybrid")`` on a short input (where hybrid falls back to exact
    attention) validates its options and its inputs once per call, and a traceback tells the
    checked op from its implementation."""
    import traceback

    from subquad.ops import hybrid

    counts = {"options": 0, "qkv": 0}
    post_init = hybrid.HybridOptions.__post_init__
    check_qkv = registry.check_qkv

    def counted_post_init(self):
        counts["options"] += 1
        post_init(self)

    def counted_check_qkv(*args, **kwargs):
        counts["qkv"] += 1
        return check_qkv(*args, **kwargs)

    mha = subquad.MultiheadAttention(32, 4, method="hybrid", batch_first=True)
    x = torch.randn(2, 10, 32)
    monkeypatch.setattr(hybrid.HybridOptions, "__post_init__", counted_post_init)
    monkeypatch.setattr(registry, "check_qkv", counted_check_qkv)
    mha(x, x, x)
    assert counts == {"options": 1, "qkv": 1}

    def fail(*args, **kwargs):
        raise RuntimeError("inside")

    monkeypatch.setattr(hybrid, "sdpa", fail)  # at 200 keys the defaults select every block: exact
    q = torch.randn(1, 2, 200, 8)
    with pytest.raises(RuntimeError) as err:
        hybrid.hybrid_attention(q, q, q)
    names = [frame.name for frame in traceback.extract_tb(err.value.__traceback__)]
    assert names.count("hybrid_attention") == 1 and names.count("hybrid_attention_impl") == 1


SPARSE = [m.name for m in subquad.list_methods() if m.budget_options is not None]
SMALL_BLOCKS = {"hybrid": {"query_block": 16, "key_block": 16}, "quest": {"page_size": 8}, "moba": {"block_size": 8}}


@pytest.mark.parametrize("method", SPARSE)
@pytest.mark.parametrize("causal", [False, True])
def test_budget_options_attend_about_the_budget(method, causal):
    """Under ``budget_options(options, 64)`` the last query attends exactly to at least 64 keys
    and at most 64 + its own block's 16 (one-hot values show which keys it used)."""
    assert {"topk", "quest", "moba", "hybrid"} <= set(SPARSE)
    info = subquad.get_method(method)
    base = SMALL_BLOCKS.get(method, {})
    options = {**base, **info.budget_options(info.make_options(**base), 64)}
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, 256, 8, generator=g, dtype=torch.float64), torch.randn(1, 1, 256, 8, generator=g,
                                                                                   dtype=torch.float64)
    v = torch.eye(256, dtype=torch.float64)[None, None]
    used = int((subquad.attention(q, k, v, method=method, causal=causal, **options)[0, 0, -1] > 0).sum())
    assert 64 <= used <= 64 + 16, (options, used)


@pytest.mark.parametrize("method", SPARSE)
def test_budget_options_refuse_a_budget_below_their_smallest_selection(method):
    """At the defaults (128-key blocks for hybrid and moba), a budget below one selection raises."""
    info = subquad.get_method(method)
    if method == "topk":
        assert info.budget_options(info.make_options(), 1) == {"top_k": 1}
        return
    with pytest.raises(ValueError, match="fewer than"):
        info.budget_options(info.make_options(), 8)
