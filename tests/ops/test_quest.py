"""quest against its naive reference (naive.py), and what its page bound promises."""

import pytest
import torch

from conftest import qkv
from subquad.ops.quest import page_bounds, quest_attention
from subquad.ops.quest.naive import quest_attention_reference
from subquad.ops.softmax.naive import softmax_attention_reference


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("page_size,num_pages", [(1, 3), (2, 2), (3, 1), (4, 10)])
@pytest.mark.parametrize("top_p", [1.0, 0.6])
def test_matches_naive(causal, page_size, num_pages, top_p):
    q, k, v = qkv(2, 2, 13, 8, dv=5)
    mask = torch.zeros(2, 13, dtype=torch.bool)
    mask[0, -4:] = True
    mask[1, 3:9] = True  # pages are cut over the real keys
    out = quest_attention(q, k, v, key_padding_mask=mask, causal=causal, scale=0.6, page_size=page_size,
                          num_pages=num_pages, top_p=top_p)
    ref = quest_attention_reference(q, k, v, mask, causal, scale=0.6, page_size=page_size, num_pages=num_pages,
                                    top_p=top_p)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_cross_lengths_and_every_page_is_softmax():
    q, k, v = qkv(1, 2, 7, 8, m=11)
    torch.testing.assert_close(quest_attention(q, k, v, page_size=2, num_pages=2),
                               quest_attention_reference(q, k, v, page_size=2, num_pages=2), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(quest_attention(q, k, v, page_size=2, num_pages=6), softmax_attention_reference(q, k, v))
    q, k, v = qkv(1, 2, 9, 8)
    torch.testing.assert_close(quest_attention(q, k, v, causal=True, page_size=2, num_pages=5),
                               softmax_attention_reference(q, k, v, causal=True))


def test_the_bound_is_an_upper_bound_of_every_logit_in_the_page():
    q, k, _ = qkv(1, 2, 5, 8, m=24)
    lo, hi = page_bounds(k, 6)
    bound = q.clamp(min=0) @ hi.mT + q.clamp(max=0) @ lo.mT  # (1, 2, 5, 4)
    logits = (q @ k.mT).view(1, 2, 5, 4, 6)
    assert bool((bound >= logits.amax(-1) - 1e-12).all())


def test_page_size_one_is_top_k():
    """With pages of one key the bound is the logit itself: quest is topk."""
    from subquad.ops.topk import topk_attention

    q, k, v = qkv(1, 2, 10, 8)
    torch.testing.assert_close(quest_attention(q, k, v, page_size=1, num_pages=4),
                               topk_attention(q, k, v, top_k=4), rtol=1e-12, atol=1e-12)


def test_gradients_through_the_chosen_pages():
    q, k, v = (t.requires_grad_() for t in qkv(1, 2, 9, 4))
    torch.autograd.gradcheck(lambda q, k, v: quest_attention(q, k, v, causal=True, page_size=2, num_pages=2),
                             (q, k, v))
