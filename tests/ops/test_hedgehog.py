"""Hedgehog against its naive reference (learned feature maps away from the identity, the exact
window with sinks, masks, causal), its options, and the layer that keeps its learned tensors."""

from __future__ import annotations

import pytest
import torch

import subquad
from subquad.ops.hedgehog import learned_init
from subquad.ops.hedgehog.naive import hedgehog_attention as naive


def _learned(window, heads=2, d=8, feature_dim=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    o = subquad.get_method("hedgehog").make_options(window=window, feature_dim=feature_dim)
    return {name: t.double() + 0.3 * torch.randn(t.shape, generator=gen, dtype=torch.float64)
            for name, t in learned_init(o, heads, d).items()}


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window,sinks", [(0, 0), (3, 0), (3, 2), (2, 2)])
@pytest.mark.parametrize("feature_dim", [None, 5])
def test_matches_naive(causal, window, sinks, feature_dim):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 11, 8, dtype=torch.float64) for _ in range(3))
    mask = torch.zeros(2, 11, dtype=torch.bool)
    mask[1, 7:] = True
    mask[0, 0] = True  # a padded sink
    opts = dict(window=window, sinks=sinks, feature_dim=feature_dim, **_learned(window, feature_dim=feature_dim))
    got = subquad.attention(q, k, v, method="hedgehog", key_padding_mask=mask, causal=causal, chunk_size=4, **opts)
    torch.testing.assert_close(got, naive(q, k, v, mask, causal, **opts), rtol=1e-10, atol=1e-10)


def test_untrained_is_linear_attention_on_softmax_features():
    q, k, v = (torch.randn(1, 2, 9, 4, dtype=torch.float64) for _ in range(3))
    got = subquad.attention(q, k, v, method="hedgehog")
    phi = [torch.cat([x.softmax(-1), (-x).softmax(-1)], -1) for x in (q, k)]
    w = phi[0] @ phi[1].transpose(-2, -1)
    torch.testing.assert_close(got, (w / w.sum(-1, keepdim=True)) @ v)


def test_gradients_reach_the_learned_tensors():
    q, k, v = (torch.randn(1, 2, 10, 8, dtype=torch.float64) for _ in range(3))
    opts = {name: t.requires_grad_() for name, t in _learned(3).items()}
    torch.autograd.gradcheck(lambda w, b, lw: subquad.attention(q, k, v, method="hedgehog", causal=True, window=3,
                                                                 sinks=1, weight=w, bias=b, linear_log_weight=lw),
                             (opts["weight"], opts["bias"], opts["linear_log_weight"]))


@pytest.mark.parametrize("options,error,match", [
    (dict(window=2, sinks=3), ValueError, "sinks must be between 0 and window"),
    (dict(window=-1), ValueError, "window must be >= 0"),
    (dict(feature_dim=0), ValueError, "feature_dim must be >= 1"),
    (dict(weight=torch.zeros(3, 8, 8)), ValueError, r"weight must be \(H, D, F\)"),
])
def test_option_errors(options, error, match):
    q = torch.randn(1, 2, 6, 8)
    with pytest.raises(error, match=match):
        subquad.attention(q, q, q, method="hedgehog", **options)


def test_window_needs_equal_lengths():
    q, k = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 9, 8)
    with pytest.raises(ValueError, match="equal query and key lengths"):
        subquad.attention(q, k, k, method="hedgehog", window=2)
    assert subquad.attention(q, k, k, method="hedgehog").shape == (1, 2, 6, 8)  # no window: cross is fine


def test_module_keeps_the_learned_tensors_as_parameters():
    mha = subquad.MultiheadAttention(16, 2, method="hedgehog", window=4, batch_first=True)
    names = {n for n, _ in mha.named_parameters()}
    assert {"core.weight", "core.bias", "core.linear_log_weight"} <= names
    x = torch.randn(2, 12, 16)
    mha(x, x, x)[0].sum().backward()
    assert mha.core.weight.grad is not None and mha.core.weight.grad.abs().sum() > 0
    with torch.no_grad():
        mha.core.weight.add_(1.0)
    mha.core.reset_parameters()
    torch.testing.assert_close(mha.core.weight, torch.eye(8).expand(2, 8, 8))
