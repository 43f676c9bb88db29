"""topk against its naive reference (naive.py), and what top-k means at its edges."""

import pytest
import torch

from conftest import qkv
from subquad.ops.softmax.naive import softmax_attention_reference
from subquad.ops.topk import topk_attention
from subquad.ops.topk.naive import topk_attention_reference


def _mask(B, M):
    mask = torch.zeros(B, M, dtype=torch.bool)
    mask[0, -4:] = True
    if B > 1:
        mask[1, 3:9] = True
    return mask


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("top_k", [1, 4, 50])
def test_matches_naive(causal, top_k):
    q, k, v = qkv(2, 2, 13, 8, dv=5)
    mask = _mask(2, 13)
    out = topk_attention(q, k, v, key_padding_mask=mask, causal=causal, top_k=top_k, scale=0.7)
    ref = topk_attention_reference(q, k, v, mask, causal, scale=0.7, top_k=top_k)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_cross_lengths_and_a_key_budget_over_every_key_is_softmax():
    q, k, v = qkv(1, 2, 7, 8, m=11)
    torch.testing.assert_close(topk_attention(q, k, v, top_k=3),
                               topk_attention_reference(q, k, v, top_k=3), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(topk_attention(q, k, v, top_k=11), softmax_attention_reference(q, k, v))
    q, k, v = qkv(1, 2, 9, 8)
    torch.testing.assert_close(topk_attention(q, k, v, causal=True, top_k=9),
                               softmax_attention_reference(q, k, v, causal=True))


def test_each_query_keeps_exactly_its_top_keys():
    """With distinct logits, a one-hot value per key shows which keys each query used: exactly the
    top_k largest logits."""
    q, k, _ = qkv(1, 1, 6, 4, m=10)
    v = torch.eye(10, dtype=q.dtype)[None, None]
    out = topk_attention(q, k, v, top_k=3)
    used = out[0, 0] > 0
    top = (q[0, 0] @ k[0, 0].T).topk(3, dim=-1).indices
    assert torch.equal(used, torch.zeros_like(used).scatter_(1, top, True))


def test_gradients_through_the_selected_keys():
    q, k, v = (t.requires_grad_() for t in qkv(1, 2, 9, 4))
    torch.autograd.gradcheck(lambda q, k, v: topk_attention(q, k, v, causal=True, top_k=3), (q, k, v))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("top_p", [0.3, 0.8, 0.999])
def test_top_p_matches_naive(causal, top_p):
    q, k, v = qkv(2, 2, 13, 8, dv=5)
    mask = _mask(2, 13)
    out = topk_attention(q, k, v, key_padding_mask=mask, causal=causal, top_k=6, top_p=top_p, scale=1.5)
    ref = topk_attention_reference(q, k, v, mask, causal, scale=1.5, top_k=6, top_p=top_p)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_top_p_keeps_the_fewest_keys_that_hold_the_share():
    """A query whose softmax puts 0.6, 0.3, 0.1 on three keys: p = 0.5 keeps one key, 0.7 two, 0.95 three."""
    k = torch.eye(3, dtype=torch.float64)[None, None]
    q = torch.log(torch.tensor([[0.6, 0.3, 0.1]], dtype=torch.float64))[None, None]
    v = torch.eye(3, dtype=torch.float64)[None, None]
    for p, used in ((0.5, 1), (0.7, 2), (0.95, 3)):
        out = topk_attention(q, k, v, top_k=3, top_p=p, scale=1.0)
        assert int((out[0, 0, 0] > 0).sum()) == used, p
    # the share is of the chosen keys' softmax (Twilight's): of the top 2, the first holds 2/3
    assert int((topk_attention(q, k, v, top_k=2, top_p=0.65, scale=1.0)[0, 0, 0] > 0).sum()) == 1
    assert int((topk_attention(q, k, v, top_k=2, top_p=0.7, scale=1.0)[0, 0, 0] > 0).sum()) == 2
