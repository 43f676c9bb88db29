"""xattention against its naive reference (naive.py)."""

import pytest
import torch

from conftest import qkv
from subquad.ops.softmax.naive import softmax_attention_reference
from subquad.ops.xattention import xattention_attention
from subquad.ops.xattention.naive import xattention_attention_reference


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block_size,stride,threshold", [(4, 2, 0.5), (2, 2, 0.3), (4, 4, 0.8), (3, 1, 0.6)])
@pytest.mark.parametrize("top_p", [1.0, 0.6])
def test_matches_naive(causal, block_size, stride, threshold, top_p):
    q, k, v = qkv(2, 2, 14, 8, dv=5)
    mask = torch.zeros(2, 14, dtype=torch.bool)
    mask[0, -4:] = True
    mask[1, 3:9] = True
    opts = dict(block_size=block_size, stride=stride, threshold=threshold, top_p=top_p)
    out = xattention_attention(q, k, v, key_padding_mask=mask, causal=causal, scale=0.6, **opts)
    ref = xattention_attention_reference(q, k, v, mask, causal, scale=0.6, **opts)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_cross_lengths_and_a_full_threshold_is_softmax():
    q, k, v = qkv(1, 2, 7, 8, m=11)
    opts = dict(block_size=2, stride=2, threshold=0.5)
    torch.testing.assert_close(xattention_attention(q, k, v, **opts),
                               xattention_attention_reference(q, k, v, **opts), rtol=1e-12, atol=1e-12)
    q, k, v = qkv(1, 2, 9, 8)
    torch.testing.assert_close(xattention_attention(q, k, v, causal=True, block_size=2, stride=1, threshold=1.0),
                               softmax_attention_reference(q, k, v, causal=True))


def test_a_threshold_of_zero_keeps_one_block_or_the_diagonal():
    """At threshold 0 a query block keeps its best block alone (causal: and its diagonal block)."""
    q, k, _ = qkv(1, 1, 16, 8)
    v = torch.eye(16, dtype=q.dtype)[None, None]
    out = xattention_attention(q, k, v, block_size=4, stride=2, threshold=0.0)
    assert int((out[0, 0, 0] > 0).sum()) == 4


def test_gradients_through_the_chosen_blocks():
    q, k, v = (t.requires_grad_() for t in qkv(1, 2, 9, 4))
    torch.autograd.gradcheck(
        lambda q, k, v: xattention_attention(q, k, v, causal=True, block_size=2, stride=2, threshold=0.5), (q, k, v))


@pytest.mark.parametrize("causal", [False, True])
def test_expected_keys_counts_the_naive_kept_blocks(causal):
    """The registry's keys per query: the kept blocks' keys (causal: at or before the query), from
    the naive selection; top_p's per-query pruning is not counted (NotImplementedError)."""
    from subquad.ops.xattention import XAttentionOptions, expected_keys
    from subquad.ops.xattention.naive import kept_blocks

    q, k, _ = qkv(1, 2, 30, 8)
    o = XAttentionOptions(block_size=4, stride=2, threshold=0.6)
    got = expected_keys(q, k, causal, o)
    kept = kept_blocks(q[0], k[0], causal, 8 ** -0.5, 4, 2, 0.6)
    for h in range(2):
        for p in range(30):
            want = sum(1 for j in range(30) if j // 4 in kept[h][p // 4] and (not causal or j <= p))
            assert got[0, h, p] == want, (h, p)
    assert got[0, :, -4:].mean() < (30 if not causal else 28)  # a real choice, not every key
    with pytest.raises(NotImplementedError, match="top_p"):
        expected_keys(q, k, causal, XAttentionOptions(block_size=4, top_p=0.5))
