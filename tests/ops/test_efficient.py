"""Double-softmax ("efficient") attention: the reference, rows of the implied weight matrix are
convex weights, and padded keys get zero weight."""

from __future__ import annotations

import pytest
import torch

from conftest import qkv
from subquad.ops.efficient import efficient_attention
from subquad.ops.efficient.naive import efficient_attention_reference


def make_qkv(b=2, h=2, n=13, m=None, d=6, dv=None, seed=0):
    """Seeded float64 q ``(b, h, n, d)``, k ``(b, h, m, d)``, v ``(b, h, m, dv)``."""
    return qkv(b, h, n, d, m=m, dv=dv, seed=seed)


def implied_weights(q, k, key_padding_mask=None):
    """The ``(B, H, N, M)`` weight matrix of the op, read off by attending to one-hot values."""
    b, h, m, _ = k.shape
    eye = torch.eye(m, dtype=q.dtype).expand(b, h, m, m)
    return efficient_attention(q, k, eye, key_padding_mask=key_padding_mask)


MASK = torch.tensor([[False] * 10 + [True] * 3, [True] * 2 + [False] * 11])


@pytest.mark.parametrize("masked", [False, True])
def test_matches_reference(masked):
    q, k, v = make_qkv(dv=4)
    mask = MASK if masked else None
    out = efficient_attention(q, k, v, key_padding_mask=mask)
    torch.testing.assert_close(out, efficient_attention_reference(q, k, v, mask), rtol=1e-12, atol=1e-12)


def test_cross_attention_matches_reference():
    q, k, v = make_qkv(n=5, m=13, dv=3)
    out = efficient_attention(q, k, v, key_padding_mask=MASK)
    torch.testing.assert_close(out, efficient_attention_reference(q, k, v, MASK), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("masked", [False, True])
def test_weight_rows_sum_to_one(masked):
    q, k, _ = make_qkv()
    mask = MASK if masked else None
    w = implied_weights(q, k, mask)
    assert (w >= 0).all()
    torch.testing.assert_close(w.sum(-1), torch.ones(w.shape[:-1], dtype=w.dtype), rtol=0, atol=1e-13)
    # equivalently: a constant value is reproduced exactly
    v = torch.full((2, 2, 13, 3), 2.5, dtype=torch.float64)
    out = efficient_attention(q, k, v, key_padding_mask=mask)
    torch.testing.assert_close(out, torch.full_like(out, 2.5), rtol=0, atol=1e-13)


def test_padded_keys_get_zero_weight():
    q, k, v = make_qkv()
    w = implied_weights(q, k, MASK)
    assert torch.equal(w[0, :, :, 10:], torch.zeros_like(w[0, :, :, 10:]))
    assert torch.equal(w[1, :, :, :2], torch.zeros_like(w[1, :, :, :2]))
    # so changing padded keys and values changes nothing
    k2, v2 = k.clone(), v.clone()
    pad = MASK[:, None, :, None]
    k2 = torch.where(pad, k2 * 10 + 3, k2)
    v2 = torch.where(pad, v2 - 100, v2)
    torch.testing.assert_close(efficient_attention(q, k2, v2, key_padding_mask=MASK),
                               efficient_attention(q, k, v, key_padding_mask=MASK), rtol=0, atol=1e-13)


def test_all_padded_sample_outputs_zero_with_finite_grads():
    q, k, v = (t.requires_grad_() for t in make_qkv())
    mask = torch.zeros(2, 13, dtype=torch.bool)
    mask[1] = True
    out = efficient_attention(q, k, v, key_padding_mask=mask)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    out.square().sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_scale_and_causal_are_refused():
    q, k, v = make_qkv()
    with pytest.raises(ValueError, match="scale"):
        efficient_attention(q, k, v, scale=0.5)
    with pytest.raises(NotImplementedError):
        efficient_attention(q, k, v, causal=True)
