"""elu(x)+1 linear attention: the chunked causal path and the non-causal path against the explicit
reference, and a structural check that the causal path never builds an (N, D, D) state."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from conftest import qkv
from subquad.ops.linear import linear_attention
from subquad.ops.linear.naive import linear_attention_reference


def make_qkv(b=2, h=2, n=37, m=None, d=6, dv=None, seed=0):
    """Seeded float64 q ``(b, h, n, d)``, k ``(b, h, m, d)``, v ``(b, h, m, dv)``."""
    return qkv(b, h, n, d, m=m, dv=dv, seed=seed)


class LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor produced by an aten op (forward and
    backward) while active."""

    def __init__(self):
        super().__init__()
        self.numel = 0
        self.op = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.numel() > self.numel:
                self.numel, self.op = t.numel(), (str(func), tuple(t.shape))
        return out


def test_non_causal_matches_reference():
    q, k, v = make_qkv(dv=3)
    torch.testing.assert_close(linear_attention(q, k, v), linear_attention_reference(q, k, v), rtol=1e-12,
                               atol=1e-12)


def test_non_causal_cross_attention_with_padding():
    q, k, v = make_qkv(n=9, m=21)
    mask = torch.zeros(2, 21, dtype=torch.bool)
    mask[0, 15:] = True
    mask[1, :4] = True
    out = linear_attention(q, k, v, key_padding_mask=mask)
    torch.testing.assert_close(out, linear_attention_reference(q, k, v, mask), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("chunk_size", [1, 5, 16, 36, 37, 64])
@pytest.mark.parametrize("masked", [False, True])
def test_causal_matches_reference(chunk_size, masked):
    """N = 37 is not a multiple of 5 or 16; chunk 1 is the pure recurrence; 64 > N is one chunk."""
    q, k, v = make_qkv(dv=4)
    mask = None
    if masked:
        mask = torch.zeros(2, 37, dtype=torch.bool)
        mask[0, 30:] = True
        mask[1, :6] = True  # left padding: the first queries see no real key
    out = linear_attention(q, k, v, key_padding_mask=mask, causal=True, chunk_size=chunk_size)
    ref = linear_attention_reference(q, k, v, mask, causal=True)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    if masked:
        assert torch.equal(out[1, :, :6], torch.zeros_like(out[1, :, :6]))


@pytest.mark.parametrize("chunk_size", [1, 8, 64])
def test_causal_last_position_equals_non_causal(chunk_size):
    q, k, v = make_qkv()
    causal = linear_attention(q, k, v, causal=True, chunk_size=chunk_size)
    full = linear_attention(q, k, v)
    torch.testing.assert_close(causal[:, :, -1], full[:, :, -1], rtol=1e-12, atol=1e-12)


def test_causal_ignores_future_keys():
    q, k, v = make_qkv()
    out = linear_attention(q, k, v, causal=True, chunk_size=8)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 20:] *= 3.0
    v2[:, :, 20:] += 1.0
    out2 = linear_attention(q, k2, v2, causal=True, chunk_size=8)
    torch.testing.assert_close(out[:, :, :20], out2[:, :, :20], rtol=0, atol=1e-13)


def test_causal_gradients_match_reference():
    q, k, v = (t.requires_grad_() for t in make_qkv(n=23))
    grads = torch.autograd.grad(linear_attention(q, k, v, causal=True, chunk_size=5).square().sum(), (q, k, v))
    ref = torch.autograd.grad(linear_attention_reference(q, k, v, causal=True).square().sum(), (q, k, v))
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)


def test_scale_is_refused():
    q, k, v = make_qkv()
    with pytest.raises(ValueError, match="scale"):
        linear_attention(q, k, v, scale=0.5)


@pytest.mark.parametrize("chunk_size", [0, -3])
def test_bad_chunk_size_raises(chunk_size):
    q, k, v = make_qkv()
    with pytest.raises(ValueError, match="chunk_size"):
        linear_attention(q, k, v, causal=True, chunk_size=chunk_size)


def test_causal_memory_never_grows_like_n_d_d():
    """The chunked path keeps one (D, D + 1) state per chunk: no tensor in forward or backward may
    come near N * D * D elements (a cumulative sum over per-token outer products would be that)."""
    n, d, chunk = 2048, 32, 64
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, n, d, generator=g, requires_grad=True) for _ in range(3))
    with LargestTensor() as largest:
        out = linear_attention(q, k, v, causal=True, chunk_size=chunk)
        out.sum().backward()
    # the largest legitimate tensors: intra-chunk scores (N * chunk) and per-chunk states
    # (N / chunk * D * (D + 1)); an (N, D, D) tensor has 2 097 152 elements
    bound = 2 * n * max(chunk, d + 1)
    assert largest.numel <= bound, largest.op
    assert bound * 4 <= n * d * d
