"""Drop-in parity of ``subquad.MultiheadAttention`` with ``torch.nn.MultiheadAttention`` (issue 14).

A sweep in the style of ``tests/test_generic.py``:

- ``method="softmax"`` against torch with the same state dict, over torch's argument space:
  batched (batch_first or not) and unbatched inputs, ``key_padding_mask`` bool / float,
  ``attn_mask`` 2-D / 3-D bool / float, ``is_causal``, ``need_weights`` x
  ``average_attn_weights``, ``kdim`` / ``vdim``, ``bias=False``, ``add_bias_kv``,
  ``add_zero_attn``, dropout in training and eval, float32 / float64, bf16 autocast.
- every other registered method over the same argument space for shapes, dtypes, mask meaning
  (padding, causal, key-only masks, refusals) and errors (the exception type torch raises).
- module lifecycle (meta device, ``reset_parameters``, deepcopy, pickle, state dict, ``.to``) and
  hosting in torch's ``TransformerEncoder`` (built with torch's attention, then swapped) and
  ``TransformerDecoderLayer``.
"""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
from torch import nn

import subquad

F64 = torch.float64
E, H = 16, 4
B = 3
ATTENTION_METHODS = [m.name for m in subquad.list_methods() if m.kind == "attention"]
APPROX_METHODS = [m for m in ATTENTION_METHODS if m != "softmax"]
CAUSAL_METHODS = [m for m in ATTENTION_METHODS if subquad.get_method(m).causal]

# small options that keep each method approximate at these lengths
OPTIONS = {
    "nystrom": {"num_landmarks": 3},
    "performer": {"num_features": 16},
    "linear": {"chunk_size": 3},
    "lara": {"num_landmarks": 3},
    "sinkhorn": {"block_size": 4},
}
# options that give every method its own parameters / buffers, for the lifecycle tests
RICH_OPTIONS = {
    **OPTIONS,
    "nystrom": {"num_landmarks": 3, "conv_kernel_size": 3},
    "lara": {"num_landmarks": 3, "proposal": "adaptive-1d"},
    "sinkhorn": {"block_size": 4, "sort_net": "mlp", "max_blocks": 8},
}

CONFIGS = {
    "plain": {},
    "kdim_vdim": {"kdim": 6, "vdim": 10},
    "no_bias": {"bias": False},
    "bias_kv": {"add_bias_kv": True},
    "zero_attn": {"add_zero_attn": True},
    "bias_kv_zero_attn": {"add_bias_kv": True, "add_zero_attn": True, "kdim": 6, "vdim": 10},
}
LAYOUTS = ["batch_first", "seq_first", "unbatched"]

pytestmark = pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask")


def gen(seed):
    return torch.Generator().manual_seed(seed)


def randn(*shape, seed=0, dtype=F64):
    return torch.randn(*shape, generator=gen(seed), dtype=dtype)


def make_pair(config="plain", *, method="softmax", dtype=F64, layout="batch_first", dropout=0.0, seed=0, **options):
    """torch's module with random weights and biases, and ours (``method``) loaded with its state
    dict (strictly for softmax)."""
    kwargs = {**CONFIGS[config], "batch_first": layout == "batch_first", "dtype": dtype, "dropout": dropout}
    torch.manual_seed(seed)
    ref = nn.MultiheadAttention(E, H, **kwargs)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    opts = {**OPTIONS.get(method, {}), **options}
    ours = subquad.MultiheadAttention(E, H, method=method, **kwargs, **opts)
    ours.load_state_dict(ref.state_dict(), strict=method == "softmax")
    return ref, ours


def qkv(config, layout, L, S, dtype=F64, seed=0):
    """query (B, L, E), key (B, S, kdim), value (B, S, vdim) in ``layout``."""
    cfg = CONFIGS[config]
    q = randn(B, L, E, seed=seed, dtype=dtype)
    k = randn(B, S, cfg.get("kdim", E), seed=seed + 1, dtype=dtype)
    v = randn(B, S, cfg.get("vdim", E), seed=seed + 2, dtype=dtype)
    return tuple(to_layout(t, layout) for t in (q, k, v))


def to_layout(t, layout):
    if layout == "seq_first":
        return t.transpose(0, 1)
    if layout == "unbatched":
        return t[0]
    return t


def from_layout(t, layout):
    """Back to (B, L, E) (unbatched: (1, L, E))."""
    if layout == "seq_first":
        return t.transpose(0, 1)
    if layout == "unbatched":
        return t[None]
    return t


def key_padding(kind, S, layout, dtype=F64):
    """None, or (B, S) (unbatched (S,)) padding: last 2 keys of sequence 1, last key of sequence 2
    (sequence 0, the unbatched one, gets its last key padded)."""
    if kind is None:
        return None
    mask = torch.zeros(B, S, dtype=torch.bool)
    mask[0, -1] = True
    mask[1, -2:] = True
    mask[2, -1] = True
    if kind == "float":
        mask = torch.zeros(B, S, dtype=dtype).masked_fill(mask, float("-inf"))
    elif kind == "float_bias":  # torch adds any float key_padding_mask to the logits
        mask = (randn(B, S, seed=8, dtype=dtype) * 0.5).masked_fill(mask, float("-inf"))
    return mask[0] if layout == "unbatched" else mask


def general_mask(kind, L, S, layout, dtype=F64, seed=5):
    """None, or a random attn_mask "2d_bool", "2d_float", "3d_bool", "3d_float" ((B*H, L, S),
    unbatched (H, L, S)); key 0 is never masked, so every query sees a key. Float masks carry a
    finite bias and -inf where the bool one is True."""
    if kind is None:
        return None
    batch = 1 if layout == "unbatched" else B
    shape = (L, S) if kind.startswith("2d") else (batch * H, L, S)
    blocked = torch.rand(shape, generator=gen(seed)) < 0.35
    blocked[..., 0] = False
    if kind.endswith("bool"):
        return blocked
    return (randn(*shape, seed=seed + 1, dtype=dtype) * 0.7).masked_fill(blocked, float("-inf"))


def rel_error(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def assert_close(a, b, tol=1e-10):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


# =========================================================================== softmax against torch


@pytest.mark.parametrize("mask_kind", [None, "2d_bool", "2d_float", "3d_bool", "3d_float"])
@pytest.mark.parametrize("kpm_kind", [None, "bool", "float", "float_bias"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_softmax_matches_torch(config, layout, kpm_kind, mask_kind):
    """Same output and weights as torch for every need_weights / average_attn_weights."""
    ref, ours = make_pair(config, layout=layout)
    L, S = 5, 7
    q, k, v = qkv(config, layout, L, S)
    kw = {"key_padding_mask": key_padding(kpm_kind, S, layout), "attn_mask": general_mask(mask_kind, L, S, layout)}
    expected, got = ref(q, k, v, **kw), ours(q, k, v, **kw)  # torch's default: need_weights=True
    assert_close(got[0], expected[0])
    assert_close(got[1], expected[1])
    for average in (True, False):
        expected = ref(q, k, v, need_weights=True, average_attn_weights=average, **kw)
        got = ours(q, k, v, need_weights=True, average_attn_weights=average, **kw)
        assert got[1].shape == expected[1].shape
        assert_close(got[0], expected[0])
        assert_close(got[1], expected[1])
    expected = ref(q, k, v, need_weights=False, **kw)
    got = ours(q, k, v, need_weights=False, **kw)
    assert got[1] is None
    assert_close(got[0], expected[0])


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("kpm_kind", [None, "bool", "float"])
@pytest.mark.parametrize("mask_dtype", ["bool", "float"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("config", ["plain", "zero_attn", "bias_kv"])
def test_softmax_causal_matches_torch(config, layout, mask_dtype, kpm_kind, need_weights):
    """torch wants attn_mask with is_causal=True (a hint); ours gives the same with the mask, and
    with is_causal=True alone. The extra keys stay visible to every query, as in torch's weights
    path (torch's need_weights=False path without key_padding_mask hands is_causal to SDPA with
    the extra keys appended last, where no query sees them: the one place torch disagrees with
    itself, and we follow its weights path)."""
    ref, ours = make_pair(config, layout=layout)
    x = to_layout(randn(B, 6, E), layout)
    causal = torch.ones(6, 6, dtype=torch.bool).triu(1)
    if mask_dtype == "float":
        causal = torch.zeros(6, 6, dtype=F64).masked_fill(causal, float("-inf"))
    kpm = key_padding(kpm_kind, 6, layout)
    kw = {"key_padding_mask": kpm, "need_weights": need_weights}
    expected = ref(x, x, x, attn_mask=causal, is_causal=True, **kw)
    if config != "plain" and kpm is None and not need_weights:
        expected = ref(x, x, x, attn_mask=causal, is_causal=True, key_padding_mask=None, need_weights=True)[0], None
    for got in (ours(x, x, x, attn_mask=causal, is_causal=True, **kw), ours(x, x, x, attn_mask=causal, **kw),
                ours(x, x, x, is_causal=True, **kw)):
        assert_close(got[0], expected[0])
        if need_weights:
            assert_close(got[1], expected[1])


@pytest.mark.parametrize("layout", ["batch_first", "seq_first"])
def test_softmax_self_attention_same_tensor(layout):
    """query is key is value (torch's packed projection) gives the same numbers."""
    ref, ours = make_pair(layout=layout)
    x = to_layout(randn(B, 6, E), layout)
    kpm = key_padding("bool", 6, layout)
    for nw in (False, True):
        assert_close(ours(x, x, x, key_padding_mask=kpm, need_weights=nw)[0],
                     ref(x, x, x, key_padding_mask=kpm, need_weights=nw)[0])


@pytest.mark.parametrize("mask_kind", [None, "2d_bool", "3d_float"])
@pytest.mark.parametrize("kpm_kind", [None, "bool"])
@pytest.mark.parametrize("need_weights", [False, True])
def test_softmax_dropout_matches_torch(need_weights, kpm_kind, mask_kind):
    """In training, the same seed gives torch's dropout pattern (output and the dropped-out
    weights torch returns); in eval there is no dropout."""
    ref, ours = make_pair("plain", dtype=torch.float32, dropout=0.4)
    q, k, v = qkv("plain", "batch_first", 5, 7, dtype=torch.float32)
    kw = {"key_padding_mask": key_padding(kpm_kind, 7, "batch_first"),
          "attn_mask": general_mask(mask_kind, 5, 7, "batch_first", dtype=torch.float32),
          "need_weights": need_weights}
    torch.manual_seed(11)
    expected = ref(q, k, v, **kw)
    torch.manual_seed(11)
    got = ours(q, k, v, **kw)
    assert_close(got[0], expected[0], tol=1e-5)
    if need_weights:
        assert_close(got[1], expected[1], tol=1e-5)
    torch.manual_seed(12)
    assert not torch.allclose(ours(q, k, v, **kw)[0], got[0])  # dropout is on
    ref.eval(), ours.eval()
    assert_close(ours(q, k, v, **kw)[0], ref(q, k, v, **kw)[0], tol=1e-5)
    assert_close(ours(q, k, v, **kw)[0], ours(q, k, v, **kw)[0], tol=0)


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["f32", "f64"])
@pytest.mark.parametrize("config", ["plain", "bias_kv_zero_attn"])
def test_softmax_dtypes(config, dtype):
    ref, ours = make_pair(config, dtype=dtype)
    q, k, v = qkv(config, "batch_first", 5, 7, dtype=dtype)
    kpm = key_padding("bool", 7, "batch_first")
    got, expected = ours(q, k, v, key_padding_mask=kpm), ref(q, k, v, key_padding_mask=kpm)
    assert got[0].dtype == got[1].dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-10
    assert_close(got[0], expected[0], tol)
    assert_close(got[1], expected[1], tol)


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("mask_kind", [None, "2d_bool", "3d_float"])
def test_softmax_bf16_autocast(mask_kind, need_weights):
    ref, ours = make_pair(dtype=torch.float32)
    q, k, v = qkv("plain", "batch_first", 5, 7, dtype=torch.float32)
    kw = {"key_padding_mask": key_padding("bool", 7, "batch_first"), "need_weights": need_weights,
          "attn_mask": general_mask(mask_kind, 5, 7, "batch_first", dtype=torch.float32)}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, got = ref(q, k, v, **kw), ours(q, k, v, **kw)
    assert got[0].dtype == expected[0].dtype
    assert rel_error(got[0], expected[0]) < 1e-2  # bf16 rounding: a few units in the last place
    if need_weights:
        assert got[1].dtype == expected[1].dtype
        assert rel_error(got[1], expected[1]) < 1e-2


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("mask_kind", [None, "3d_float"])
def test_softmax_float64_under_bf16_autocast(mask_kind, need_weights):
    """Autocast leaves float64 alone: torch's numbers in float64 (the masks too)."""
    ref, ours = make_pair()
    q, k, v = qkv("plain", "batch_first", 5, 7)
    kw = {"key_padding_mask": key_padding("bool", 7, "batch_first"), "need_weights": need_weights,
          "attn_mask": general_mask(mask_kind, 5, 7, "batch_first")}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, got = ref(q, k, v, **kw), ours(q, k, v, **kw)
    assert got[0].dtype == F64
    assert_close(got[0], expected[0])
    if need_weights:
        assert_close(got[1], expected[1])


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_softmax_nested_matches_torch_fast_path():
    """A nested batch (torch accepts it on its eval / no_grad fast path) gives torch's output."""
    ref, ours = make_pair(dtype=torch.float32)
    ref.eval(), ours.eval()
    nested = torch.nested.nested_tensor([randn(6, E, dtype=torch.float32), randn(3, E, seed=1, dtype=torch.float32)])
    with torch.no_grad():
        expected, _ = ref(nested, nested, nested, need_weights=False)
        got, weights = ours(nested, nested, nested, need_weights=False)
    assert got.is_nested and weights is None
    for a, b in zip(got.unbind(), expected.unbind()):
        assert_close(a, b, tol=1e-5)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("layout", [torch.strided, torch.jagged], ids=["strided", "jagged"])
@pytest.mark.parametrize("method", ATTENTION_METHODS)
def test_nested_inputs_every_method(method, layout):
    """Nested query and key/value (self and cross), any layout, in training with grad: the output
    is nested in the query's layout and lengths, equal to the padded computation, and gradients
    reach the inputs and the parameters."""
    _, ours = make_pair(method=method, dtype=torch.float32)
    ours.eval()
    seqs = [randn(8, E, seed=1, dtype=torch.float32).requires_grad_(), randn(5, E, seed=2, dtype=torch.float32)]
    nested = torch.nested.as_nested_tensor(seqs, layout=layout)
    memory = torch.nested.as_nested_tensor([randn(8, E, seed=3, dtype=torch.float32)] * 2, layout=layout)
    for key in (nested, memory):
        out, weights = ours(nested, key, key)
        assert out.is_nested and out.layout == layout and weights is None
        assert [t.shape[0] for t in out.unbind()] == [8, 5]
        padded_q = torch.nested.to_padded_tensor(nested, 0.0)
        padded_k = torch.nested.to_padded_tensor(key, 0.0)
        lengths = [t.shape[0] for t in key.unbind()]
        kpm = torch.arange(8)[None, :] >= torch.tensor(lengths)[:, None]
        expected = ours(padded_q, padded_k, padded_k, key_padding_mask=kpm, need_weights=False)[0]
        for got, want in zip(out.unbind(), expected):
            assert_close(got, want[: got.shape[0]], tol=1e-5)
    ours.train()
    torch.nested.to_padded_tensor(ours(nested, nested, nested)[0], 0.0).sum().backward()
    assert seqs[0].grad is not None and ours.out_proj.weight.grad is not None


@pytest.mark.parametrize("method", ATTENTION_METHODS)
def test_empty_batch(method):
    """B = 0 gives torch's empty shapes."""
    ref, ours = make_pair(method=method)
    q, k, v = (t[:0] for t in qkv("plain", "batch_first", 8, 8))
    kpm = torch.zeros(0, 8, dtype=torch.bool)
    expected, got = ref(q, k, v, key_padding_mask=kpm), ours(q, k, v, key_padding_mask=kpm)
    assert got[0].shape == expected[0].shape
    if method == "softmax":
        assert got[1].shape == expected[1].shape


def test_fully_masked_query_outputs_zeros():
    """The one documented difference: a query that sees no key outputs 0 (torch: NaN)."""
    _, ours = make_pair()
    q, k, v = qkv("plain", "batch_first", 5, 7)
    mask = torch.zeros(5, 7, dtype=torch.bool)
    mask[2] = True
    out, w = ours(q, k, v, attn_mask=mask, average_attn_weights=False)
    assert torch.isfinite(out).all() and torch.isfinite(w).all()
    assert (w[:, :, 2] == 0).all()
    inner = ours.core.forward_masked(*(t.unflatten(-1, (H, E // H)).transpose(1, 2) for t in ours._project(q, k, v)),
                                     None, None, None, mask[None, None], False, False)[0]
    assert (inner[:, :, 2] == 0).all()


# =========================================================================== errors: torch's types


def _cases():
    q, k = randn(B, 5, E), randn(B, 7, E)
    return {
        "query_4d": lambda f: f(q[None], k, k),
        "key_2d_for_batched": lambda f: f(q, k[0], k[0]),
        "kpm_1d_for_batched": lambda f: f(q, k, k, key_padding_mask=torch.zeros(7, dtype=torch.bool)),
        "kpm_wrong_length": lambda f: f(q, k, k, key_padding_mask=torch.zeros(B, 6, dtype=torch.bool)),
        "kpm_int": lambda f: f(q, k, k, key_padding_mask=torch.zeros(B, 7, dtype=torch.long)),
        "attn_mask_int": lambda f: f(q, k, k, attn_mask=torch.zeros(5, 7, dtype=torch.long)),
        "attn_mask_2d_shape": lambda f: f(q, k, k, attn_mask=torch.zeros(5, 6, dtype=torch.bool)),
        "attn_mask_3d_shape": lambda f: f(q, k, k, attn_mask=torch.zeros(H, 5, 7, dtype=torch.bool)),
        "attn_mask_4d": lambda f: f(q, k, k, attn_mask=torch.zeros(1, B * H, 5, 7, dtype=torch.bool)),
        "query_width": lambda f: f(randn(B, 5, E + 2), k, k),
        "key_width": lambda f: f(q, randn(B, 7, E + 2), randn(B, 7, E + 2)),
        "key_value_lengths": lambda f: f(q, k, k[:, :6]),
        "batch_mismatch": lambda f: f(q, k[:1], k[:1]),
        "unbatched_3d_attn_mask_shape": lambda f: f(q[0], k[0], k[0], attn_mask=torch.zeros(2, 5, 7, dtype=torch.bool)),
        "unbatched_kpm_2d": lambda f: f(q[0], k[0], k[0], key_padding_mask=torch.zeros(1, 7, dtype=torch.bool)),
        "unbatched_key_3d": lambda f: f(q[0], k, k),
    }


CASES = list(_cases())


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("method", ATTENTION_METHODS)
def test_invalid_shapes_raise_torchs_exception(method, case):
    """Whatever torch raises (AssertionError or RuntimeError) ours raises too, as a ValueError or
    TypeError (the library's policy) that is also torch's type."""
    call = _cases()[case]
    ref, ours = make_pair(method=method)
    with pytest.raises(Exception) as torch_error:
        call(ref)
    expected = type(torch_error.value)
    assert expected in (AssertionError, RuntimeError)
    with pytest.raises(expected) as ours_error:
        call(ours)
    assert isinstance(ours_error.value, (ValueError, TypeError))


@pytest.mark.parametrize("kwargs", [{"embed_dim": 16, "num_heads": 3}, {"embed_dim": 0, "num_heads": 4},
                                    {"embed_dim": 16, "num_heads": 0}, {"embed_dim": 16.0, "num_heads": 4}])
@pytest.mark.parametrize("method", ATTENTION_METHODS)
def test_invalid_constructor_raises_torchs_exception(method, kwargs):
    with pytest.raises(Exception) as torch_error:
        nn.MultiheadAttention(**kwargs)
    with pytest.raises(type(torch_error.value)) as ours_error:
        subquad.MultiheadAttention(**kwargs, method=method)
    assert isinstance(ours_error.value, (ValueError, TypeError))
    assert ("embed_dim" in str(ours_error.value)) or ("num_heads" in str(ours_error.value))


# =========================================================================== every other method


def approx_pair(method, config="plain", layout="batch_first", **options):
    ref, ours = make_pair(config, method=method, layout=layout, **options)
    return ref, ours.eval()


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["f32", "f64"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("method", APPROX_METHODS)
def test_approx_shapes_and_dtypes(method, config, layout, dtype):
    """Output of torch's shape in the input dtype, finite; weights None (torch's default
    need_weights=True asks quietly); unbatched = the first sequence of the batch."""
    ref, ours = make_pair(config, method=method, layout=layout, dtype=dtype)
    ours.eval()
    q, k, v = qkv(config, layout, 8, 8, dtype=dtype)
    kpm = key_padding("bool", 8, layout)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, weights = ours(q, k, v, key_padding_mask=kpm)
    expected, _ = ref(q, k, v, key_padding_mask=kpm)
    assert weights is None
    assert out.shape == expected.shape and out.dtype == dtype and torch.isfinite(out).all()
    if layout != "unbatched":
        single = (from_layout(t, layout)[0] for t in (q, k, v))
        first = ours(*single, key_padding_mask=key_padding("bool", 8, "unbatched"))
        tol = 1e-5 if dtype == torch.float32 else 1e-10
        assert_close(first[0], from_layout(out, layout)[0], tol)


@pytest.mark.parametrize("method", ATTENTION_METHODS)
def test_bf16_autocast_every_method(method):
    _, ours = make_pair(method=method, dtype=torch.float32)
    ours.eval()
    q, k, v = qkv("plain", "batch_first", 8, 8, dtype=torch.float32)
    kpm = key_padding("bool", 8, "batch_first")
    torch.manual_seed(0)  # ra and lara: the same samples in both calls
    full, _ = ours(q, k, v, key_padding_mask=kpm, need_weights=False)
    torch.manual_seed(0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = ours(q, k, v, key_padding_mask=kpm, need_weights=False)
    assert out.dtype == torch.bfloat16
    error = ((out.float() - full).norm() / full.norm()).item()
    assert error < 0.03, error  # bfloat16 keeps 8 bits: ~0.4 % per rounding


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("method", APPROX_METHODS)
def test_approx_padding_and_float_mask(method, config):
    """Padded keys and values never reach a real query's output; a float 0/-inf mask is the bool one."""
    _, ours = approx_pair(method, config)
    q, k, v = qkv(config, "batch_first", 8, 8)
    kpm = key_padding("bool", 8, "batch_first")
    out = ours(q, k, v, key_padding_mask=kpm)[0]
    k2 = torch.where(kpm[..., None], randn(*k.shape, seed=9) * 3, k)
    v2 = torch.where(kpm[..., None], randn(*v.shape, seed=10) * 3, v)
    out2 = ours(q, k2, v2, key_padding_mask=kpm)[0]
    assert_close(out2[~kpm], out[~kpm], tol=1e-8)
    assert_close(ours(q, k, v, key_padding_mask=key_padding("float", 8, "batch_first"))[0], out, tol=0)
    with pytest.raises(ValueError, match="key_padding_mask"):
        ours(q, k, v, key_padding_mask=torch.zeros(B, 8, dtype=F64).masked_fill(kpm, -1e4))


@pytest.mark.parametrize("form", ["none_bool", "none_float", "keys_bool", "keys_float"])
@pytest.mark.parametrize("ndim", [2, 3])
@pytest.mark.parametrize("method", APPROX_METHODS)
def test_approx_masks_honoured_exactly(method, ndim, form):
    """An attn_mask that masks nothing is no mask; one that hides the same keys from every query
    and head (2-D: in every sequence; 3-D: per sequence) is a key padding mask."""
    _, ours = approx_pair(method)
    q, k, v = qkv("plain", "batch_first", 8, 8)
    keys = key_padding("bool", 8, "batch_first") if ndim == 3 else torch.zeros(B, 8, dtype=torch.bool)
    if ndim == 2:
        keys[:, 6] = True
    if form.startswith("none"):
        keys = torch.zeros_like(keys)
    mask = keys[:, None, None, :].expand(B, H, 8, 8).reshape(B * H, 8, 8)
    if ndim == 2:
        mask = mask[0]
    if form.endswith("float"):
        mask = torch.zeros(mask.shape, dtype=F64).masked_fill(mask, float("-inf"))
    expected = ours(q, k, v, key_padding_mask=None if form.startswith("none") else keys)[0]
    assert_close(ours(q, k, v, attn_mask=mask)[0], expected, tol=0)


@pytest.mark.parametrize("form", ["2d_bool", "2d_float", "3d_bool", "hint_only"])
@pytest.mark.parametrize("config", ["plain", "bias_kv_zero_attn"])
@pytest.mark.parametrize("method", APPROX_METHODS)
def test_approx_causal_masks(method, config, form):
    """The causal attn_mask (any form) is is_causal=True for causal methods; the others refuse it
    with NotImplementedError. Causal for real: later tokens do not change earlier outputs."""
    _, ours = approx_pair(method, config)
    cfg = CONFIGS[config]
    x = randn(B, 8, E)
    k, v = randn(B, 8, cfg.get("kdim", E), seed=1), randn(B, 8, cfg.get("vdim", E), seed=2)
    causal = torch.ones(8, 8, dtype=torch.bool).triu(1)
    mask = {"2d_bool": causal, "2d_float": torch.zeros(8, 8, dtype=F64).masked_fill(causal, float("-inf")),
            "3d_bool": causal.expand(B * H, 8, 8), "hint_only": None}[form]
    if method not in CAUSAL_METHODS:
        with pytest.raises(NotImplementedError):
            ours(x, k, v, attn_mask=mask, is_causal=form == "hint_only")
        return
    out = ours(x, k, v, attn_mask=mask, is_causal=form == "hint_only")[0]
    assert_close(out, ours(x, k, v, is_causal=True)[0], tol=0)
    k2, v2 = k.clone(), v.clone()
    k2[:, 5:] += 2.0
    v2[:, 5:] -= 1.0
    assert_close(ours(x, k2, v2, is_causal=True)[0][:, :5], out[:, :5], tol=1e-8)


@pytest.mark.parametrize("mask_kind", ["random_bool", "finite_float", "anti_causal"])
@pytest.mark.parametrize("method", APPROX_METHODS)
def test_approx_refuses_masks_it_cannot_honour(method, mask_kind):
    _, ours = approx_pair(method)
    q, k, v = qkv("plain", "batch_first", 8, 8)
    mask = {"random_bool": general_mask("3d_bool", 8, 8, "batch_first"),
            "finite_float": general_mask("2d_float", 8, 8, "batch_first").nan_to_num(neginf=-1e4),
            "anti_causal": torch.ones(8, 8, dtype=torch.bool).tril(-1)}[mask_kind]
    with pytest.raises(ValueError, match=method):
        ours(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("config", ["bias_kv", "zero_attn", "bias_kv_zero_attn"])
def test_extra_keys_exact_through_nystrom_limit(config):
    """Nyström with landmarks >= the key count is exact attention: with add_bias_kv /
    add_zero_attn it equals softmax (so the extras are keys every query sees)."""
    ref, exact = make_pair(config)
    _, ny = make_pair(config, method="nystrom", num_landmarks=64)
    q, k, v = qkv(config, "batch_first", 6, 6)
    kpm = key_padding("bool", 6, "batch_first")
    assert_close(ny(q, k, v, key_padding_mask=kpm)[0], ref(q, k, v, key_padding_mask=kpm)[0])


@pytest.mark.parametrize("config", ["bias_kv", "zero_attn", "bias_kv_zero_attn"])
def test_extra_keys_seen_by_every_query_when_causal(config):
    """Causal linear attention with extra keys: query i sees keys 0..i and the extras, computed
    query by query with the non-causal op."""
    _, ours = make_pair(config, method="linear")
    q, k, v = qkv(config, "batch_first", 6, 6)
    out = ours(q, k, v, is_causal=True)[0]
    qh, kh, vh = (t.unflatten(-1, (H, E // H)).transpose(1, 2) for t in ours._project(q, k, v))
    ek, ev = ours._extra_keys(B, kh)
    rows = []
    for i in range(6):
        keys, values = torch.cat([kh[:, :, : i + 1], ek], 2), torch.cat([vh[:, :, : i + 1], ev], 2)
        rows.append(subquad.attention(qh[:, :, i : i + 1], keys, values, method="linear"))
    expected = ours.out_proj(torch.cat(rows, 2).transpose(1, 2).flatten(2))
    assert_close(out, expected)


def test_ra_is_deterministic_in_eval_only():
    _, ours = make_pair(method="ra")
    q, k, v = qkv("plain", "batch_first", 8, 8)
    a, b = ours(q, k, v)[0], ours(q, k, v)[0]
    assert not torch.allclose(a, b)  # training: the sampling estimator
    ours.eval()
    a = ours(q, k, v)[0]
    assert_close(ours(q, k, v)[0], a, tol=0)
    qh, kh, vh = (t.unflatten(-1, (H, E // H)).transpose(1, 2) for t in ours._project(q, k, v))
    core = subquad.attention(qh, kh, vh, method="ra", estimator="mixture_mean")
    assert_close(a, ours.out_proj(core.transpose(1, 2).flatten(2)))


# =========================================================================== lifecycle


def rich(method, seed=0, **kwargs):
    torch.manual_seed(seed)
    return subquad.MultiheadAttention(E, H, batch_first=True, method=method, add_bias_kv=True,
                                      **RICH_OPTIONS.get(method, {}), **kwargs)


@pytest.mark.parametrize("method", ATTENTION_METHODS)
def test_meta_to_empty_reset_parameters(method):
    """Built on the meta device, then to_empty() + reset_parameters(): every parameter and buffer
    (Performer's projection too) is what reset_parameters() gives a normal module under the same seed."""
    meta = rich(method, device="meta")
    assert all(t.is_meta for t in meta.state_dict().values())
    meta.to_empty(device="cpu")
    torch.manual_seed(3)
    meta.reset_parameters()
    normal = rich(method, seed=1)
    torch.manual_seed(3)
    normal.reset_parameters()
    state, expected = meta.state_dict(), normal.state_dict()
    assert state.keys() == expected.keys()
    for name in state:
        assert torch.equal(state[name], expected[name]), name
        assert torch.isfinite(state[name]).all(), name
    x = randn(B, 8, E, dtype=torch.float32)
    assert torch.isfinite(meta.eval()(x, x, x)[0]).all()


def test_reset_parameters_matches_torch_initialisation():
    torch.manual_seed(4)
    ref = nn.MultiheadAttention(E, H, add_bias_kv=True, kdim=6, vdim=10)
    torch.manual_seed(4)
    fresh = subquad.MultiheadAttention(E, H, add_bias_kv=True, kdim=6, vdim=10)
    ours = subquad.MultiheadAttention(E, H, add_bias_kv=True, kdim=6, vdim=10)
    torch.manual_seed(4)
    ours.reset_parameters()
    for module in (fresh, ours):
        for name, value in ref.state_dict().items():
            assert torch.equal(module.state_dict()[name], value), name


@pytest.mark.parametrize("method", ATTENTION_METHODS)
def test_copy_pickle_state_dict_and_to(method):
    source = rich(method).eval()
    x = randn(B, 8, E, dtype=torch.float32)
    expected = source(x, x, x, need_weights=False)[0]
    for clone in (copy.deepcopy(source), pickle.loads(pickle.dumps(source))):
        assert_close(clone(x, x, x, need_weights=False)[0], expected, tol=0)
    target = rich(method, seed=7).eval()
    target.load_state_dict(source.state_dict())
    assert_close(target(x, x, x, need_weights=False)[0], expected, tol=0)
    wide = copy.deepcopy(source).to(F64)
    assert all(p.dtype == F64 for p in wide.parameters())
    out = wide(x.double(), x.double(), x.double(), need_weights=False)[0]
    assert out.dtype == F64
    assert_close(out.float(), expected, tol=1e-4)


# =========================================================================== hosts


def swap_in(encoder, method, **extra):
    for layer in encoder.layers:
        attn = subquad.MultiheadAttention(32, 4, batch_first=layer.self_attn.batch_first, method=method,
                                          **OPTIONS.get(method, {}), **extra)
        attn.load_state_dict(layer.self_attn.state_dict(), strict=False)
        layer.self_attn = attn
    return encoder


@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("method", ATTENTION_METHODS)
def test_swap_into_built_encoder(method, batch_first):
    """A TransformerEncoder built with torch's attention (its nested-tensor fast path decided at
    construction), then given our attention: eval under no_grad (nested tensors reach our module)
    equals eval with grad and, for softmax, torch's own encoder; training runs backward."""
    torch.manual_seed(0)
    built = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, dropout=0.0, batch_first=batch_first), 2)
    reference = copy.deepcopy(built).eval()
    encoder = swap_in(built, method).eval()
    x = randn(2, 10, 32, dtype=torch.float32)
    pad = torch.zeros(2, 10, dtype=torch.bool)
    pad[1, 6:] = True
    if not batch_first:
        x = x.transpose(0, 1)
    real = ~pad if batch_first else ~pad.T
    with torch.no_grad():
        fast = encoder(x, src_key_padding_mask=pad)
        torch_out = reference(x, src_key_padding_mask=pad)
    slow = encoder(x, src_key_padding_mask=pad)
    assert fast.shape == x.shape
    assert_close(fast[real], slow[real].detach(), tol=1e-5)
    if method == "softmax":
        assert_close(fast[real], torch_out[real], tol=1e-5)
        assert_close(slow[real].detach(), torch_out[real], tol=1e-5)
    encoder.train()
    out = encoder(x, src_key_padding_mask=pad)
    out[real].sum().backward()
    assert all(p.grad is not None for p in encoder.layers[0].self_attn.parameters())


@pytest.mark.parametrize("method", ATTENTION_METHODS)
def test_decoder_layer_host(method):
    """TransformerDecoderLayer with our self-attention (causal where the method is) and
    cross-attention; softmax equals torch's layer."""
    torch.manual_seed(0)
    layer = nn.TransformerDecoderLayer(32, 4, dropout=0.0, batch_first=True)
    reference = copy.deepcopy(layer).eval()
    for name in ("self_attn", "multihead_attn"):
        attn = subquad.MultiheadAttention(32, 4, batch_first=True, method=method, **OPTIONS.get(method, {}))
        attn.load_state_dict(getattr(layer, name).state_dict(), strict=False)
        setattr(layer, name, attn)
    layer.eval()
    tgt, memory = randn(2, 8, 32, dtype=torch.float32), randn(2, 8, 32, seed=1, dtype=torch.float32)
    pad = torch.zeros(2, 8, dtype=torch.bool)
    pad[1, 5:] = True
    kw = {"memory_key_padding_mask": pad}
    if method in CAUSAL_METHODS:
        kw.update(tgt_mask=nn.Transformer.generate_square_subsequent_mask(8), tgt_is_causal=True)
    out = layer(tgt, memory, **kw)
    assert out.shape == tgt.shape and torch.isfinite(out).all()
    if method == "softmax":
        assert_close(out, reference(tgt, memory, **kw), tol=1e-5)
