"""``subquad.MultiheadAttention``: a drop-in for ``torch.nn.MultiheadAttention`` (same state dict,
same outputs with method="softmax"), every registered method as the ``self_attn`` of a
``torch.nn.TransformerEncoderLayer`` (never bypassed by torch's fused fast path), and the
state owned by the Nyström and Performer cores."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import subquad
from conftest import generic_options, right_padding
from subquad.ops.performer import performer_attention

ATTENTION_METHODS = [m.name for m in subquad.list_methods() if m.kind == "attention"]
CAUSAL_METHODS = [name for name in ATTENTION_METHODS if subquad.get_method(name).causal]

# options that make each method approximate (not an exact fallback) at N = 12, over the registry
# entry's test_options
LAYER_OPTIONS = {
    "nystrom": {"num_landmarks": 4},
    "performer": {"num_features": 16},
    "linear": {"chunk_size": 5},
    "lara": {"num_landmarks": 4},
    "sinkhorn": {"block_size": 4},
}

F64 = torch.float64


def seeded(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def torch_and_subquad(embed_dim=16, num_heads=4, *, seed=0, **kwargs):
    """A ``torch.nn.MultiheadAttention`` with random weights and biases, and a
    ``subquad.MultiheadAttention(method="softmax")`` loaded (strictly) with its state dict."""
    torch.manual_seed(seed)
    ref = nn.MultiheadAttention(embed_dim, num_heads, dtype=F64, **kwargs)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    ours = subquad.MultiheadAttention(embed_dim, num_heads, dtype=F64, method="softmax", **kwargs)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def encoder_layer(method, seed=0, **options):
    """``TransformerEncoderLayer(d_model=32, nhead=4, batch_first=True)`` whose ``self_attn`` is a
    subquad module with ``method``; the same seed gives the same weights for every method."""
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(d_model=32, nhead=4, batch_first=True)
    opts = {**generic_options(method), **LAYER_OPTIONS.get(method, {}), **options}
    attn = subquad.MultiheadAttention(32, 4, batch_first=True, method=method, **opts)
    with torch.no_grad():
        attn.in_proj_weight.copy_(layer.self_attn.in_proj_weight)
        attn.in_proj_bias.copy_(torch.randn_like(attn.in_proj_bias) * 0.1)
        attn.out_proj.load_state_dict(layer.self_attn.out_proj.state_dict())
    layer.self_attn = attn
    return layer


def layer_by_hand(layer, x, pad):
    """What a post-norm ``TransformerEncoderLayer`` computes in eval, calling our module directly."""
    sa = layer.self_attn(x, x, x, key_padding_mask=pad, need_weights=False)[0]
    h = layer.norm1(x + sa)
    return layer.norm2(h + layer.linear2(layer.activation(layer.linear1(h))))


X = seeded(2, 12, 32, seed=1)
PAD = right_padding(2, 12, [0, 4])


# torch.nn.MultiheadAttention equivalence ----------------------------------------------------------------


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("mask_kind", [None, "bool", "float"])
def test_softmax_matches_torch(batch_first, mask_kind):
    ref, ours = torch_and_subquad(batch_first=batch_first)
    x = seeded(3, 9, 16, dtype=F64) if batch_first else seeded(9, 3, 16, dtype=F64)
    mask = None
    if mask_kind is not None:
        mask = right_padding(3, 9, [0, 3, 8])
        if mask_kind == "float":
            mask = torch.zeros(3, 9, dtype=F64).masked_fill(mask, float("-inf"))
    expected, _ = ref(x, x, x, key_padding_mask=mask, need_weights=False)
    out, weights = ours(x, x, x, key_padding_mask=mask, need_weights=False)
    assert weights is None
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    # torch's default need_weights=True: head-averaged weights, same output
    expected_default = ref(x, x, x, key_padding_mask=mask)
    out_default = ours(x, x, x, key_padding_mask=mask)
    torch.testing.assert_close(out_default[0], expected_default[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out_default[1], expected_default[1], rtol=1e-12, atol=1e-12)
    # distinct query, key and value tensors (no packed projection shortcut)
    y, z = x * 0.5 + 1, x.flip(-1)
    torch.testing.assert_close(ours(x, y, z, key_padding_mask=mask)[0], ref(x, y, z, key_padding_mask=mask)[0],
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("average", [True, False])
@pytest.mark.parametrize("batch_first", [True, False])
def test_softmax_attention_weights_match_torch(average, batch_first):
    ref, ours = torch_and_subquad(batch_first=batch_first)
    x = seeded(2, 7, 16, dtype=F64)
    if not batch_first:
        x = x.transpose(0, 1)
    mask = right_padding(2, 7, [2, 0])
    expected, expected_w = ref(x, x, x, key_padding_mask=mask, need_weights=True, average_attn_weights=average)
    out, w = ours(x, x, x, key_padding_mask=mask, need_weights=True, average_attn_weights=average)
    assert w.shape == ((2, 7, 7) if average else (2, 4, 7, 7))
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(w, expected_w, rtol=1e-12, atol=1e-12)


def test_kdim_vdim_cross_attention_matches_torch():
    ref, ours = torch_and_subquad(kdim=10, vdim=6, batch_first=True)
    assert {"q_proj_weight", "k_proj_weight", "v_proj_weight"} <= set(ours.state_dict())
    q, k, v = seeded(2, 5, 16, dtype=F64), seeded(2, 11, 10, seed=1, dtype=F64), seeded(2, 11, 6, seed=2, dtype=F64)
    mask = right_padding(2, 11, [4, 0])
    for need_weights in (False, True):
        expected = ref(q, k, v, key_padding_mask=mask, need_weights=need_weights)
        out = ours(q, k, v, key_padding_mask=mask, need_weights=need_weights)
        torch.testing.assert_close(out[0], expected[0], rtol=1e-12, atol=1e-12)
        if need_weights:
            torch.testing.assert_close(out[1], expected[1], rtol=1e-12, atol=1e-12)


def test_unbatched_input_matches_torch():
    ref, ours = torch_and_subquad()
    x = seeded(9, 16, dtype=F64)
    mask = torch.zeros(9, dtype=torch.bool)
    mask[6:] = True
    expected, expected_w = ref(x, x, x, key_padding_mask=mask)
    out, w = ours(x, x, x, key_padding_mask=mask, need_weights=True)
    assert out.shape == (9, 16) and w.shape == (9, 9)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(w, expected_w, rtol=1e-12, atol=1e-12)


def test_bias_false_state_dict_loads():
    ref, ours = torch_and_subquad(bias=False, batch_first=True)
    x = seeded(2, 5, 16, dtype=F64)
    torch.testing.assert_close(ours(x, x, x)[0], ref(x, x, x)[0], rtol=1e-12, atol=1e-12)


# causal masks ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mask_dtype", [torch.bool, F64])
def test_causal_attn_mask_matches_torch_and_is_causal(mask_dtype):
    ref, ours = torch_and_subquad(batch_first=True)
    x = seeded(2, 8, 16, dtype=F64)
    future = torch.ones(8, 8, dtype=torch.bool).triu(1)
    attn_mask = future if mask_dtype == torch.bool else torch.zeros(8, 8, dtype=F64).masked_fill(future, float("-inf"))
    pad = right_padding(2, 8, [0, 3])
    if mask_dtype != torch.bool:  # torch wants both masks of one kind
        pad = torch.zeros(2, 8, dtype=F64).masked_fill(pad, float("-inf"))
    expected, _ = ref(x, x, x, attn_mask=attn_mask, key_padding_mask=pad)
    out, _ = ours(x, x, x, attn_mask=attn_mask, key_padding_mask=pad)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ours(x, x, x, is_causal=True, key_padding_mask=pad)[0], out, rtol=0, atol=0)


@pytest.mark.parametrize("method", CAUSAL_METHODS)
def test_causal_attn_mask_same_as_is_causal(method):
    attn = subquad.MultiheadAttention(32, 4, batch_first=True, method=method, **LAYER_OPTIONS.get(method, {}))
    attn.eval()
    future = torch.ones(12, 12, dtype=torch.bool).triu(1)
    torch.manual_seed(0)
    a = attn(X, X, X, attn_mask=future)[0]
    torch.manual_seed(0)
    b = attn(X, X, X, is_causal=True)[0]
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    # causal for real: the first positions do not see later tokens
    x2 = X.clone()
    x2[:, 8:] += 1.0
    torch.manual_seed(0)
    c = attn(x2, x2, x2, is_causal=True)[0]
    torch.testing.assert_close(c[:, :8], b[:, :8], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "attn_mask",
    [
        torch.ones(12, 12, dtype=torch.bool).triu(2),  # not the causal mask
        torch.ones(12, 12, dtype=torch.bool).tril(-1),  # anti-causal
        torch.zeros(12, 12).masked_fill(torch.ones(12, 12, dtype=torch.bool).triu(1), -1e4),  # finite bias
        torch.ones(11, 11, dtype=torch.bool).triu(1),  # wrong size
    ],
)
def test_other_attn_masks_raise_for_approximate_methods(attn_mask):
    """(Changed with issue 14: method="softmax" now takes every mask torch takes, see
    test_mha_parity.py; approximate methods still refuse masks they cannot honour exactly.)"""
    attn = subquad.MultiheadAttention(32, 4, batch_first=True, method="linear")
    with pytest.raises(ValueError, match="attn_mask"):
        attn(X, X, X, attn_mask=attn_mask)


def test_all_zero_attn_mask_is_no_mask_for_approximate_methods():
    attn = subquad.MultiheadAttention(32, 4, batch_first=True, method="linear")
    out = attn(X, X, X, attn_mask=torch.zeros(12, 12))[0]
    torch.testing.assert_close(out, attn(X, X, X)[0], rtol=0, atol=0)


def test_non_causal_method_refuses_causal_mask():
    attn = subquad.MultiheadAttention(32, 4, batch_first=True, method="nystrom", num_landmarks=4)
    with pytest.raises(NotImplementedError):
        attn(X, X, X, is_causal=True)


# refusals ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", [m for m in ATTENTION_METHODS if m != "softmax"])
def test_need_weights_gives_none_for_approximate_methods(method, recwarn):
    """(Changed with issue 14: torch's default is need_weights=True, so approximate methods return
    None weights instead of raising; only an explicit request warns, once per module.)"""
    attn = subquad.MultiheadAttention(32, 4, batch_first=True, method=method, **LAYER_OPTIONS.get(method, {}))
    attn.eval()
    out, weights = attn(X, X, X)  # the default: no weights, no warning
    assert weights is None and not recwarn.list
    with pytest.warns(UserWarning, match="need_weights"):
        out2, weights = attn(X, X, X, need_weights=True)
    assert weights is None
    torch.testing.assert_close(out2, out, rtol=0, atol=0)  # eval is deterministic for every method
    attn(X, X, X, need_weights=True)
    assert not recwarn.list  # once per module


def test_need_weights_warning_points_at_the_caller():
    attn = subquad.MultiheadAttention(32, 4, batch_first=True, method="linear")
    with pytest.warns(UserWarning, match="need_weights") as record:
        attn(X, X, X, need_weights=True)
    assert record[0].filename == __file__  # this line, not torch's Module.__call__


@pytest.mark.parametrize("method", [m for m in ATTENTION_METHODS if m != "softmax"])
def test_dropout_refused_for_approximate_methods(method):
    with pytest.raises(ValueError, match="dropout"):
        subquad.MultiheadAttention(32, 4, dropout=0.1, method=method)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("method", ATTENTION_METHODS)
def test_nested_tensor_input_is_padded_input(method):
    """(Changed with issue 14: nested inputs were refused.) A nested batch gives a nested output
    equal, sequence by sequence, to the padded batch with its key padding mask."""
    attn = subquad.MultiheadAttention(32, 4, batch_first=True, method=method, **LAYER_OPTIONS.get(method, {})).eval()
    seqs = [seeded(12, 32, seed=3), seeded(8, 32, seed=4)]
    nested = torch.nested.nested_tensor(seqs)
    out, weights = attn(nested, nested, nested)
    assert out.is_nested and weights is None
    padded = torch.stack([seqs[0], torch.cat([seqs[1], torch.zeros(4, 32)])])
    expected = attn(padded, padded, padded, key_padding_mask=right_padding(2, 12, [0, 4]), need_weights=False)[0]
    for got, want, n in zip(out.unbind(), expected, (12, 8)):
        assert got.shape == (n, 32)
        torch.testing.assert_close(got, want[:n], rtol=1e-5, atol=1e-5)


# every method inside torch.nn.TransformerEncoderLayer ----------------------------------------------------------


@pytest.mark.parametrize("method", ATTENTION_METHODS)
def test_encoder_layer_train_forward_backward(method):
    layer = encoder_layer(method)
    layer.train()
    x = X.clone().requires_grad_()
    out = layer(x, src_key_padding_mask=PAD)
    assert out.shape == X.shape and torch.isfinite(out).all()
    out.sum().backward()
    assert torch.isfinite(x.grad).all()
    for name, p in layer.self_attn.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert layer.self_attn.in_proj_weight.grad.abs().sum() > 0


@pytest.mark.parametrize("method", ATTENTION_METHODS)
@pytest.mark.parametrize("no_grad", [False, True])
def test_encoder_layer_eval_calls_our_module(method, no_grad, monkeypatch):
    """In eval (and under no_grad, where torch would take its fused path for its own attention)
    the layer output equals the layer computed by hand around our module: a non-softmax method
    is never replaced by torch's exact attention."""
    fused_calls = []
    fused = torch._transformer_encoder_layer_fwd

    def record(*args, **kwargs):
        fused_calls.append(1)
        return fused(*args, **kwargs)

    monkeypatch.setattr(torch, "_transformer_encoder_layer_fwd", record)
    layer = encoder_layer(method)
    layer.eval()
    with torch.no_grad():
        torch.manual_seed(1)
        expected = layer_by_hand(layer, X, PAD)
    with torch.set_grad_enabled(not no_grad):
        torch.manual_seed(1)
        out = layer(X, src_key_padding_mask=PAD)
    real = ~PAD[..., None]
    # softmax may take torch's fused kernel; other methods run our code, where SDPA may still pick
    # another kernel with grad enabled (rounding only). Replacing any of them with exact attention
    # would change the output far beyond these tolerances.
    tol = 1e-5 if method == "softmax" else 1e-6
    torch.testing.assert_close(torch.where(real, out, 0.0), torch.where(real, expected, 0.0), rtol=tol, atol=tol)
    # torch's fused path is allowed for exact attention only
    assert bool(fused_calls) == (method == "softmax" and no_grad)


def test_fused_path_would_be_taken_by_torch_itself(monkeypatch):
    """Sanity check of the configuration above: torch's own layer takes the fused path there."""
    calls = []
    fused = torch._transformer_encoder_layer_fwd
    monkeypatch.setattr(torch, "_transformer_encoder_layer_fwd", lambda *a, **k: calls.append(1) or fused(*a, **k))
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=32, nhead=4, batch_first=True).eval()
    with torch.no_grad():
        layer(X, src_key_padding_mask=PAD)
    assert calls


@pytest.mark.parametrize("method", [m for m in ATTENTION_METHODS if m != "softmax"])
def test_approximate_method_differs_from_softmax_in_layer(method):
    exact, approx = encoder_layer("softmax").eval(), encoder_layer(method).eval()
    with torch.no_grad():
        torch.manual_seed(1)
        a = approx(X, src_key_padding_mask=PAD)
        b = exact(X, src_key_padding_mask=PAD)
    assert (a - b)[~PAD].abs().max() > 1e-4


@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("method", ATTENTION_METHODS)
def test_encoder_stack_eval_no_grad(method):
    """``TransformerEncoder`` (nested-tensor path enabled by default) in eval under no_grad gives
    the same real-position outputs as with grad enabled (our module called directly)."""
    stack = nn.TransformerEncoder(encoder_layer(method), num_layers=2).eval()
    with torch.no_grad():
        torch.manual_seed(1)
        fast = stack(X, src_key_padding_mask=PAD)
    torch.manual_seed(1)
    slow = stack(X, src_key_padding_mask=PAD)
    torch.testing.assert_close(fast[~PAD], slow[~PAD], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ATTENTION_METHODS)
def test_padding_invariance_through_layer(method):
    layer = encoder_layer(method).eval()
    x2 = torch.where(PAD[..., None], seeded(2, 12, 32, seed=7) * 3, X)
    with torch.no_grad():
        torch.manual_seed(1)
        a = layer(X, src_key_padding_mask=PAD)
        torch.manual_seed(1)
        b = layer(x2, src_key_padding_mask=PAD)
    torch.testing.assert_close(a[~PAD], b[~PAD], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ATTENTION_METHODS)
def test_state_dict_of_torch_mha_loads(method):
    """The projections carry torch's parameter names, for every method."""
    ref = nn.MultiheadAttention(32, 4, batch_first=True)
    ours = subquad.MultiheadAttention(32, 4, batch_first=True, method=method, **LAYER_OPTIONS.get(method, {}))
    result = ours.load_state_dict(ref.state_dict(), strict=False)
    assert not result.unexpected_keys
    assert all(key.startswith("core.") for key in result.missing_keys)
    assert torch.equal(ours.in_proj_weight, ref.in_proj_weight)


# Nyström conv skip -------------------------------------------------------------------------------------------


def nystrom_mha(kernel_size, seed=0):
    torch.manual_seed(seed)
    return subquad.MultiheadAttention(32, 4, batch_first=True, method="nystrom", num_landmarks=4,
                                      conv_kernel_size=kernel_size)


@pytest.mark.parametrize("kernel_size", [1, 3, 5])
def test_nystrom_conv_odd_kernel(kernel_size):
    attn = nystrom_mha(kernel_size)
    assert attn.core.conv.weight.shape == (4, 1, kernel_size, 1)  # one kernel per head
    out = attn(X, X, X, key_padding_mask=PAD)[0]
    assert out.shape == X.shape and torch.isfinite(out).all()


@pytest.mark.parametrize("kernel_size", [2, 4, 0, -1, 3.0, True])
def test_nystrom_conv_bad_kernel_raises(kernel_size):
    with pytest.raises(ValueError, match="conv_kernel_size"):
        nystrom_mha(kernel_size)


def test_nystrom_conv_adds_to_output():
    plain = nystrom_mha(None)
    with_conv = nystrom_mha(5)
    result = with_conv.load_state_dict(plain.state_dict(), strict=False)
    assert result.missing_keys == ["core.conv.weight"]
    with torch.no_grad():
        with_conv.core.conv.weight.zero_()
    base = plain(X, X, X, key_padding_mask=PAD)[0]
    torch.testing.assert_close(with_conv(X, X, X, key_padding_mask=PAD)[0], base, rtol=0, atol=0)
    with torch.no_grad():
        with_conv.core.conv.weight.normal_()
    assert (with_conv(X, X, X, key_padding_mask=PAD)[0] - base).abs().max() > 1e-3


def test_nystrom_conv_does_not_leak_padding():
    """Padded values are zeroed before the conv: changing them changes no real output, even for
    the real tokens within the kernel's reach of the padding."""
    attn = nystrom_mha(5)
    with torch.no_grad():
        attn.core.conv.weight.normal_()
    x2 = torch.where(PAD[..., None], seeded(2, 12, 32, seed=7) * 5, X)
    a = attn(X, X, X, key_padding_mask=PAD)[0]
    b = attn(x2, x2, x2, key_padding_mask=PAD)[0]
    torch.testing.assert_close(a[~PAD], b[~PAD], rtol=1e-6, atol=1e-6)


# Performer features ------------------------------------------------------------------------------------------


def performer_mha(seed=0, **options):
    torch.manual_seed(seed)
    return subquad.MultiheadAttention(32, 4, batch_first=True, method="performer", num_features=16, **options)


def test_performer_eval_is_deterministic_and_uses_buffer():
    attn = performer_mha().eval()
    a = attn(X, X, X, key_padding_mask=PAD)[0]
    b = attn(X, X, X, key_padding_mask=PAD)[0]
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    # the eval output is the op with the buffer as its projection
    q, k, v = (t.unflatten(-1, (4, 8)).transpose(1, 2) for t in attn._project(X, X, X))
    core = performer_attention(q, k, v, key_padding_mask=PAD, features=attn.core.features)
    expected = attn.out_proj(core.transpose(1, 2).flatten(2))
    torch.testing.assert_close(a, expected, rtol=1e-6, atol=1e-6)
    assert attn.core.features.shape == (16, 8)


def test_performer_training_redraws_features():
    attn = performer_mha().train()
    a = attn(X, X, X, key_padding_mask=PAD)[0]
    b = attn(X, X, X, key_padding_mask=PAD)[0]
    assert not torch.allclose(a, b)
    # without redraw, training uses the fixed buffer like eval
    fixed = performer_mha(redraw_features=False).train()
    torch.testing.assert_close(fixed(X, X, X)[0], fixed(X, X, X)[0], rtol=0, atol=0)
    torch.testing.assert_close(fixed(X, X, X)[0], fixed.eval()(X, X, X)[0], rtol=0, atol=0)


def test_performer_redraw_changes_buffer():
    attn = performer_mha().eval()
    before = attn.core.features.clone()
    out_before = attn(X, X, X)[0]
    attn.core.redraw(torch.Generator().manual_seed(3))
    assert not torch.equal(attn.core.features, before)
    assert not torch.allclose(attn(X, X, X)[0], out_before)
    drawn = attn.core.features.clone()
    attn.core.redraw(torch.Generator().manual_seed(3))
    assert torch.equal(attn.core.features, drawn)  # reproducible with a generator


def test_performer_buffer_survives_state_dict_round_trip():
    source = performer_mha(seed=0).eval()
    target = performer_mha(seed=1).eval()
    assert not torch.equal(source.core.features, target.core.features)
    assert "core.features" in source.state_dict()
    target.load_state_dict(source.state_dict())
    assert torch.equal(source.core.features, target.core.features)
    torch.testing.assert_close(target(X, X, X)[0], source(X, X, X)[0], rtol=0, atol=0)


def test_performer_module_refuses_features_option():
    with pytest.raises(ValueError, match="features"):
        performer_mha(features=torch.randn(16, 8))
