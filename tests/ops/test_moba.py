"""moba against its naive reference (naive.py)."""

import pytest
import torch

from conftest import qkv
from subquad.ops.moba import moba_attention
from subquad.ops.moba.naive import moba_attention_reference
from subquad.ops.softmax.naive import softmax_attention_reference


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block_size,top_blocks", [(1, 3), (2, 2), (3, 1), (4, 10)])
@pytest.mark.parametrize("top_p", [1.0, 0.6])
def test_matches_naive(causal, block_size, top_blocks, top_p):
    q, k, v = qkv(2, 2, 13, 8, dv=5)
    mask = torch.zeros(2, 13, dtype=torch.bool)
    mask[0, -4:] = True
    mask[1, 3:9] = True
    out = moba_attention(q, k, v, key_padding_mask=mask, causal=causal, scale=0.6, block_size=block_size,
                         top_blocks=top_blocks, top_p=top_p)
    ref = moba_attention_reference(q, k, v, mask, causal, scale=0.6, block_size=block_size, top_blocks=top_blocks,
                                   top_p=top_p)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_cross_lengths_and_every_block_is_softmax():
    q, k, v = qkv(1, 2, 7, 8, m=11)
    torch.testing.assert_close(moba_attention(q, k, v, block_size=2, top_blocks=2),
                               moba_attention_reference(q, k, v, block_size=2, top_blocks=2), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(moba_attention(q, k, v, block_size=2, top_blocks=6),
                               softmax_attention_reference(q, k, v))
    q, k, v = qkv(1, 2, 9, 8)
    torch.testing.assert_close(moba_attention(q, k, v, causal=True, block_size=2, top_blocks=5),
                               softmax_attention_reference(q, k, v, causal=True))


def test_gradients_through_the_chosen_blocks():
    q, k, v = (t.requires_grad_() for t in qkv(1, 2, 9, 4))
    torch.autograd.gradcheck(lambda q, k, v: moba_attention(q, k, v, causal=True, block_size=2, top_blocks=2),
                             (q, k, v))
