"""Nyström attention: the exact limit, convergence on smooth inputs, the explicit reference with
uneven segments and empty landmarks, landmark bookkeeping, the iterative pseudo-inverse,
cross-attention and the causal refusal."""

from __future__ import annotations

import itertools

import pytest
import torch

from conftest import qkv
from subquad.ops.nystrom import (
    iterative_pinv,
    nystrom_attention,
    segment_lengths,
    segment_means,
)
from subquad.ops.nystrom.naive import nystrom_attention_reference
from subquad.ops.softmax.naive import softmax_attention_reference


def make_qkv(b=2, h=2, n=37, m=None, d=6, dv=None, seed=0):
    """Seeded float64 q ``(b, h, n, d)``, k ``(b, h, m, d)``, v ``(b, h, m, dv)``."""
    return qkv(b, h, n, d, m=m, dv=dv, seed=seed)


def smooth(b, h, n, d, seed):
    """A random walk along the sequence with unit variance per feature: neighbouring tokens are
    similar, the regime segment-mean landmarks are made for."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, h, n, d, generator=g, dtype=torch.float64).cumsum(2)
    return (x - x.mean(2, keepdim=True)) / x.std(2, keepdim=True)


def relative_residual(a, z):
    """``||A Z A - A|| / ||A||`` per matrix of the batch."""
    return (a @ z @ a - a).flatten(-2).norm(dim=-1) / a.flatten(-2).norm(dim=-1)


def close(a, b, tol=1e-12):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


# (a) the exact limit ---------------------------------------------------------------------------------


@pytest.mark.parametrize("landmarks", [37, 50])
@pytest.mark.parametrize("masked", [False, True])
def test_landmarks_at_least_n_is_exact(landmarks, masked):
    q, k, v = make_qkv()
    mask = None
    if masked:
        mask = torch.zeros(2, 37, dtype=torch.bool)
        mask[0, 30:] = True
        mask[1] = True
    out = nystrom_attention(q, k, v, num_landmarks=landmarks, key_padding_mask=mask)
    close(out, softmax_attention_reference(q, k, v, mask), 1e-6)


def test_reference_with_one_token_per_segment_converges_to_exact():
    """With m = N every landmark is a token, so F = A = Bk = softmax(q k^T) and (F Z)(Bk V) is
    exact once Z has converged to A^{-1} (A is well conditioned at this size)."""
    q, k, v = make_qkv(n=8, d=4)
    out = nystrom_attention_reference(q, k, v, num_landmarks=8, pinv_iterations=30)
    close(out, softmax_attention_reference(q, k, v), 1e-10)


# (b) convergence on smooth inputs ----------------------------------------------------------------------


def test_error_falls_with_landmarks_on_smooth_inputs():
    sizes = [4, 16, 64]
    errors = []
    for m in sizes:
        per_seed = []
        for seed in range(3):
            q, k = smooth(1, 2, 256, 16, seed), smooth(1, 2, 256, 16, seed + 10)
            v = torch.randn(1, 2, 256, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
            exact = softmax_attention_reference(q, k, v)
            out = nystrom_attention(q, k, v, num_landmarks=m)
            per_seed.append(float((out - exact).norm() / exact.norm()))
        errors.append(sum(per_seed) / len(per_seed))
    assert all(a > b for a, b in itertools.pairwise(errors)), errors
    assert errors[-1] < 0.1, errors
    assert errors[0] / errors[-1] > 3, errors


# (c) the reference ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("n, m", [(37, 5), (40, 8), (37, 36), (9, 1)])
@pytest.mark.parametrize("init", ["per_matrix", "global"])
def test_matches_reference_unmasked(n, m, init):
    q, k, v = make_qkv(n=n, dv=3)
    out = nystrom_attention(q, k, v, num_landmarks=m, pinv_init=init)
    close(out, nystrom_attention_reference(q, k, v, num_landmarks=m, pinv_init=init), 1e-10)


def masks_37():
    """Padding patterns for N=37, m=5 (segments 7, 7, 7, 8, 8): right padding leaving the last
    segment empty, left padding emptying the first, a hole emptying a middle segment, partial
    segments, one fully padded sample."""
    patterns = {}
    right = torch.zeros(2, 37, dtype=torch.bool)
    right[0, 29:] = True  # last segment (29..36) empty
    right[1, 33:] = True  # last segment half padded
    patterns["right"] = right
    left = torch.zeros(2, 37, dtype=torch.bool)
    left[0, :7] = True  # first segment empty
    left[1, :10] = True  # first empty, second partial
    patterns["left"] = left
    hole = torch.zeros(2, 37, dtype=torch.bool)
    hole[0, 14:21] = True  # third segment empty
    hole[1, ::3] = True  # scattered padding
    patterns["hole"] = hole
    allpad = torch.zeros(2, 37, dtype=torch.bool)
    allpad[0] = True
    allpad[1, 20:] = True
    patterns["all_padded_sample"] = allpad
    return patterns


@pytest.mark.parametrize("pattern", ["right", "left", "hole", "all_padded_sample"])
def test_matches_reference_masked_with_empty_landmarks(pattern):
    mask = masks_37()[pattern]
    q, k, v = make_qkv(dv=3)
    out = nystrom_attention(q, k, v, num_landmarks=5, key_padding_mask=mask)
    ref = nystrom_attention_reference(q, k, v, mask, num_landmarks=5)
    assert torch.isfinite(out).all()
    close(out, ref, 1e-10)


@pytest.mark.parametrize("pattern", ["right", "left", "hole"])
def test_padding_contents_do_not_leak(pattern):
    mask = masks_37()[pattern]
    q, k, v = make_qkv()
    pad = mask[:, None, :, None]
    q2, k2, v2 = (torch.where(pad, t * 7 - 3, t) for t in (q, k, v))
    out = nystrom_attention(q, k, v, num_landmarks=5, key_padding_mask=mask)
    out2 = nystrom_attention(q2, k2, v2, num_landmarks=5, key_padding_mask=mask)
    real = ~mask[:, None, :, None]
    close(torch.where(real, out, 0.0), torch.where(real, out2, 0.0), 1e-12)


def test_all_padded_sample_outputs_zero_with_finite_grads():
    mask = masks_37()["all_padded_sample"]
    q, k, v = (t.requires_grad_() for t in make_qkv())
    out = nystrom_attention(q, k, v, num_landmarks=5, key_padding_mask=mask)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    out.square().sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


# (d) landmark bookkeeping ---------------------------------------------------------------------------------


@pytest.mark.parametrize("n, m", [(37, 5), (40, 8), (7, 7), (100, 3), (5, 1)])
def test_segment_lengths(n, m):
    lengths = segment_lengths(n, m)
    assert len(lengths) == m and sum(lengths) == n
    short = m - n % m
    assert lengths[:short] == [n // m] * short
    assert lengths[short:] == [n // m + 1] * (n % m)


def test_segment_means_unmasked():
    x = torch.randn(2, 3, 37, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    means, empty = segment_means(x, 5)
    assert empty is None and means.shape == (2, 3, 5, 4)
    start = 0
    for j, length in enumerate(segment_lengths(37, 5)):
        close(means[:, :, j], x[:, :, start : start + length].mean(2))
        start += length
    # a multiple of m is a plain reshape
    means8, _ = segment_means(x[:, :, :35], 5)
    close(means8, x[:, :, :35].reshape(2, 3, 5, 7, 4).mean(3))


def test_segment_means_masked_divide_by_real_tokens():
    x = torch.randn(2, 3, 37, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    mask = masks_37()["hole"]
    keep = ~mask
    means, empty = segment_means(x, 5, keep)
    assert empty.shape == (2, 5) and empty.dtype == torch.bool
    start = 0
    for j, length in enumerate(segment_lengths(37, 5)):
        for b in range(2):
            sel = keep[b, start : start + length]
            if sel.any():
                assert not empty[b, j]
                close(means[b, :, j], x[b, :, start : start + length][:, sel].mean(1))
            else:
                assert empty[b, j]
                assert torch.equal(means[b, :, j], torch.zeros_like(means[b, :, j]))
        start += length
    assert empty[0].tolist() == [False, False, True, False, False]
    # masked means differ from the plain means whenever a segment is partly padded
    assert not torch.allclose(means[1], segment_means(x, 5)[0][1])


# (e) the iterative pseudo-inverse --------------------------------------------------------------------------


def softmax_batch(m=16, scales=(0.1, 1.0, 3.0, 8.0), seed=0):
    """Row-softmax matrices ``(len(scales), m, m)`` from flat (small scale) to peaked (large scale):
    their max column sums, the norms the init divides by, differ."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(scales), m, m, generator=g, dtype=torch.float64)
    return torch.softmax(logits * torch.tensor(scales, dtype=torch.float64)[:, None, None], -1)


def test_pinv_per_matrix_beats_global_init():
    a = softmax_batch()
    col_norms = a.sum(-2).amax(-1)
    assert col_norms.max() > 2 * col_norms.min()
    z_per = iterative_pinv(a, 6, "per_matrix")
    z_glob = iterative_pinv(a, 6, "global")
    assert not torch.allclose(z_per, z_glob)
    r_per, r_glob = relative_residual(a, z_per), relative_residual(a, z_glob)
    assert (r_per <= r_glob * (1 + 1e-9)).all(), (r_per, r_glob)
    assert r_per.sum() < 0.8 * r_glob.sum(), (r_per, r_glob)
    # the matrix with the largest norm sets the global constant: there both agree
    top = int(col_norms.argmax())
    close(z_per[top], z_glob[top])
    # one matrix alone: the two inits are the same
    close(iterative_pinv(a[:1], 6, "per_matrix"), iterative_pinv(a[:1], 6, "global"))


def test_pinv_residual_decreases_with_iterations():
    a = softmax_batch()
    residuals = torch.stack([relative_residual(a, iterative_pinv(a, it)) for it in range(9)])
    assert (residuals[1:] <= residuals[:-1]).all(), residuals
    assert (residuals[-1] < 0.2 * residuals[0]).all(), residuals


def test_pinv_converges_to_inverse_of_well_conditioned_matrix():
    a = 0.7 * torch.eye(6, dtype=torch.float64) + 0.3 * softmax_batch(6, (1.0, 2.0))
    close(iterative_pinv(a, 30), torch.linalg.inv(a), 1e-10)


def test_pinv_init_name_checked():
    with pytest.raises(ValueError, match="init"):
        iterative_pinv(softmax_batch(), 2, "exact")
    q, k, v = make_qkv()
    with pytest.raises(ValueError, match="pinv_init"):
        nystrom_attention(q, k, v, num_landmarks=5, pinv_init="exact")


# (f) cross-attention -------------------------------------------------------------------------------------


def test_cross_attention_masks_only_keys():
    """N != M: the key landmarks are masked means over real keys; the query landmarks use every
    query (the mask is about keys)."""
    q, k, v = make_qkv(n=20, m=37, dv=3)
    mask = masks_37()["right"]
    out = nystrom_attention(q, k, v, num_landmarks=5, key_padding_mask=mask)
    assert out.shape == (2, 2, 20, 3)
    close(out, nystrom_attention_reference(q, k, v, mask, num_landmarks=5), 1e-10)
    # padded keys and values do not matter
    pad = mask[:, None, :, None]
    out2 = nystrom_attention(q, torch.where(pad, k + 5, k), torch.where(pad, -v, v), num_landmarks=5,
                             key_padding_mask=mask)
    close(out, out2, 1e-12)
    # every query matters, even at positions that are padded in the key mask
    q2 = q.clone()
    q2[0, :, 19] += 1.0
    out3 = nystrom_attention(q2, k, v, num_landmarks=5, key_padding_mask=mask)
    assert not torch.allclose(out3[0, :, :19], out[0, :, :19])


def test_cross_attention_mask_must_cover_keys():
    q, k, v = make_qkv(n=20, m=37)
    with pytest.raises(ValueError, match="key_padding_mask"):
        nystrom_attention(q, k, v, num_landmarks=5, key_padding_mask=torch.zeros(2, 20, dtype=torch.bool))


# (g) causal -------------------------------------------------------------------------------------------


def test_causal_raises():
    q, k, v = make_qkv()
    with pytest.raises(NotImplementedError, match="nystrom"):
        nystrom_attention(q, k, v, num_landmarks=5, causal=True)
