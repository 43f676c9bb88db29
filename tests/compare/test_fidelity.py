"""The float64 reference, the error measure and the sharpness statistics of subquad.compare.fidelity."""

import math

import pytest
import torch

from subquad.compare.fidelity import attention_sharpness, exact_reference, relative_error
from subquad.ops.softmax.naive import softmax_attention_reference


@pytest.mark.parametrize("block_bytes", [1 << 28, 8 * 2 * 3 * 40 * 7])  # one block; blocks of 7 query rows
def test_exact_reference_in_blocks_matches_the_full_matrix(block_bytes):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 33, 8, generator=g)
    k = torch.randn(2, 3, 40, 8, generator=g)
    v = torch.randn(2, 3, 40, 5, generator=g)
    out = exact_reference(q, k, v, block_bytes=block_bytes)
    expected = softmax_attention_reference(q.double(), k.double(), v.double())
    assert out.dtype == torch.float64 and out.shape == (2, 3, 33, 5)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


def test_exact_reference_scale():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 9, 4, generator=g, dtype=torch.float64) for _ in range(3))
    torch.testing.assert_close(exact_reference(q, k, v, scale=0.3),
                               softmax_attention_reference(q, k, v, scale=0.3))


def test_relative_error():
    ref = torch.tensor([[3.0, 4.0]], dtype=torch.float64)
    assert relative_error(ref.float(), ref) == 0.0
    assert relative_error(torch.zeros(1, 2), ref) == pytest.approx(1.0)
    assert relative_error(torch.tensor([[3.0, 4.5]]), ref) == pytest.approx(0.1)


def test_sharpness_of_uniform_and_one_hot_attention():
    k = torch.randn(1, 1, 16, 4, generator=torch.Generator().manual_seed(0))
    uniform = attention_sharpness(torch.zeros(1, 1, 5, 4), k)
    assert uniform["normalised_entropy"] == pytest.approx(1.0)
    assert uniform["mean_max_weight"] == pytest.approx(1 / 16)
    keys = torch.eye(4).view(1, 1, 4, 4)
    sharp = attention_sharpness(keys * 100, keys, scale=1.0)  # each query matches one key exactly
    assert sharp["mean_max_weight"] == pytest.approx(1.0)
    assert sharp["normalised_entropy"] < 1e-6
    assert math.isfinite(sharp["normalised_entropy"])
