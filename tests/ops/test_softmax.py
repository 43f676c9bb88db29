"""Exact softmax attention: agreement with the explicit reference and with torch's SDPA, and the
library's convention that a query with no real key outputs 0."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import qkv, right_padding
from subquad.ops.softmax import softmax_attention
from subquad.ops.softmax.naive import softmax_attention_reference


def make_qkv(b=2, h=3, n=11, m=None, d=8, dv=None, seed=0):
    """Seeded float64 q ``(b, h, n, d)``, k ``(b, h, m, d)``, v ``(b, h, m, dv)``."""
    return qkv(b, h, n, d, m=m, dv=dv, seed=seed)


def sdpa_with_bool_mask(q, k, v, key_padding_mask=None, causal=False, scale=None):
    """torch SDPA with the equivalent boolean mask (True = may attend)."""
    n, m = q.shape[2], k.shape[2]
    allowed = torch.ones(q.shape[0], 1, n, m, dtype=torch.bool)
    if causal:
        allowed = allowed & torch.ones(n, m, dtype=torch.bool).tril()
    if key_padding_mask is not None:
        allowed = allowed & ~key_padding_mask[:, None, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_matches_reference_and_sdpa(causal, masked):
    q, k, v = make_qkv(dv=5)
    mask = right_padding(2, 11, [0, 4]) if masked else None
    out = softmax_attention(q, k, v, key_padding_mask=mask, causal=causal)
    ref = softmax_attention_reference(q, k, v, mask, causal)
    sdpa = sdpa_with_bool_mask(q, k, v, mask, causal)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out, sdpa, rtol=1e-12, atol=1e-12)


def test_cross_attention_and_scale():
    q, k, v = make_qkv(n=5, m=13, dv=3)
    mask = right_padding(2, 13, [3, 0])
    out = softmax_attention(q, k, v, key_padding_mask=mask, scale=0.3)
    torch.testing.assert_close(out, softmax_attention_reference(q, k, v, mask, scale=0.3), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out, sdpa_with_bool_mask(q, k, v, mask, scale=0.3), rtol=1e-12, atol=1e-12)


def test_causal_output_ignores_future_keys():
    q, k, v = make_qkv()
    out = softmax_attention(q, k, v, causal=True)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 6:] += 5.0
    v2[:, :, 6:] -= 3.0
    out2 = softmax_attention(q, k2, v2, causal=True)
    torch.testing.assert_close(out[:, :, :6], out2[:, :, :6], rtol=0, atol=1e-14)
    assert not torch.allclose(out[:, :, 6:], out2[:, :, 6:])


def test_causal_with_left_padding():
    """Left padding under causal masking: the first queries see only padded keys."""
    q, k, v = make_qkv()
    mask = torch.zeros(2, 11, dtype=torch.bool)
    mask[0, :3] = True  # queries 0..2 of batch 0 see no real key
    mask[1, 8:] = True
    out = softmax_attention(q, k, v, key_padding_mask=mask, causal=True)
    ref = softmax_attention_reference(q, k, v, mask, causal=True)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    assert torch.equal(out[0, :, :3], torch.zeros_like(out[0, :, :3]))
    sdpa = sdpa_with_bool_mask(q, k, v, mask, causal=True)
    torch.testing.assert_close(out[0, :, 3:], sdpa[0, :, 3:], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out[1], sdpa[1], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_query_without_real_key_outputs_zero_with_finite_grads(causal):
    q, k, v = make_qkv()
    mask = right_padding(2, 11, [0, 11])  # batch 1 is all padding
    if causal:
        mask[0, :2] = True  # and the first two queries of batch 0 see only padding
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = softmax_attention(q, k, v, key_padding_mask=mask, causal=causal)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    if causal:
        assert torch.equal(out[0, :, :2], torch.zeros_like(out[0, :, :2]))
    out.square().sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    # nothing flows into the all-padding sample
    assert torch.equal(q.grad[1], torch.zeros_like(q.grad[1]))
    assert torch.equal(v.grad[1], torch.zeros_like(v.grad[1]))
