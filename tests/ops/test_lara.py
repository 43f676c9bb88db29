"""LARA op: agreement with the slow reference (explicit densities), antithetic samples, the
reduction to positive-random-feature attention, normalised weights, convergence with paper noise
and the plateau of reference noise, eval and training modes, the landmarks, option errors, a long
sequence, and the estimator invariants shared with RA."""

from __future__ import annotations

import pytest
import torch

from conftest import right_padding
from randomized_checks import F64, assert_unbiased_convergence, check_invariants, gen, make_qkv, mean_abs_error
from subquad.ops._masks import masked_fill_value
from subquad.ops.lara import lara_attention, lara_samples, lara_weights
from subquad.ops.lara.naive import lara_attention_reference
from subquad.ops.nystrom import segment_lengths
from subquad.ops.performer.naive import performer_attention_reference
from subquad.ops.softmax.naive import softmax_attention_reference


def landmarks(b, h, c, d, seed=5):
    g = torch.Generator().manual_seed(seed)
    return 0.5 * torch.randn(b, h, c, d, generator=g, dtype=F64), 0.5 * torch.randn(b, h, c, d, generator=g, dtype=F64)


@pytest.mark.parametrize("mis,alpha_coeff", [("opt", 1.5), ("opt", 0.0), ("bh", 1.0)])
@pytest.mark.parametrize("n,m,masked", [(7, 7, True), (5, 9, True), (6, 6, False)])
def test_lara_matches_reference_with_explicit_densities(mis, alpha_coeff, n, m, masked):
    q, k, v = make_qkv(n=n, m=m, dv=3)
    mask = right_padding(2, m, [0, 3]) if masked else None
    ql, kl = landmarks(2, 2, 3, 6)
    opts = dict(q_landmarks=ql, k_landmarks=kl, mis=mis, alpha_coeff=alpha_coeff)
    out = lara_attention(q, k, v, key_padding_mask=mask, training=True, num_samples=2, antithetic=True,
                         generator=gen(), **opts)
    omega = lara_samples((ql + kl) * 6 ** -0.25, num_samples=2, antithetic=True, noise="reference", scale=6 ** -0.5,
                         generator=gen())
    assert omega.shape == (2, 2, 12, 6)
    ref = lara_attention_reference(q, k, v, omega, ql, kl, mask, mis=mis, alpha_coeff=alpha_coeff)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    # eval mode: w = mu
    out = lara_attention(q, k, v, key_padding_mask=mask, **opts)
    ref = lara_attention_reference(q, k, v, (ql + kl) * 6 ** -0.25, ql, kl, mask, mis=mis, alpha_coeff=alpha_coeff)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)


def test_lara_antithetic_samples_mirror_around_the_proposal_means():
    mu = torch.randn(1, 2, 4, 5, dtype=F64)
    omega = lara_samples(mu, num_samples=3, antithetic=True, noise="paper", scale=0.25, generator=gen())
    assert omega.shape == (1, 2, 24, 5)
    first, mirrored = omega[:, :, :12], omega[:, :, 12:]
    torch.testing.assert_close(first + mirrored, 2 * mu.repeat(1, 1, 3, 1), rtol=0, atol=1e-12)
    # reference noise is sqrt(scale) times the paper noise, same draws
    ref = lara_samples(mu, num_samples=3, antithetic=True, noise="reference", scale=0.25, generator=gen())
    torch.testing.assert_close(ref - mu.repeat(1, 1, 6, 1), 0.5 * (omega - mu.repeat(1, 1, 6, 1)))


@pytest.mark.parametrize("mis", ["opt", "bh"])
@pytest.mark.parametrize("masked", [False, True])
def test_lara_reduces_to_positive_random_features(mis, masked):
    """mu = 0, lambda = 0: uniform MIS weights, and LARA is PRF attention on the same samples."""
    q, k, v = make_qkv(b=1, h=1, n=9, m=9, d=5)
    mask = right_padding(1, 9, [3]) if masked else None
    zeros = torch.zeros(1, 1, 6, 5, dtype=F64)
    out = lara_attention(q, k, v, key_padding_mask=mask, q_landmarks=zeros, k_landmarks=zeros, training=True,
                         alpha_coeff=0.0, mis=mis, num_samples=2, noise="paper", generator=gen())
    omega = lara_samples(zeros, num_samples=2, noise="paper", scale=5 ** -0.5, generator=gen())
    prf = performer_attention_reference(q, k, v, omega[0, 0], key_padding_mask=mask)
    torch.testing.assert_close(out, prf, rtol=0, atol=1e-10)


@pytest.mark.parametrize("mis", ["opt", "bh"])
def test_lara_snis_weights_are_normalised(mis):
    q, k, v = make_qkv(n=8, m=10, d=4, qk_scale=2.0)
    mask = right_padding(2, 10, [0, 3])
    ql, kl = landmarks(2, 2, 4, 4)
    mu = (ql + kl) * 0.5 ** 0.5
    omega = lara_samples(mu, num_samples=3, noise="paper", scale=0.5, generator=gen())
    w, values = lara_weights(q, k, v, mu, omega, ql, scale=0.5, key_padding_mask=mask, mis=mis, alpha_coeff=3.0)
    assert w.shape == (2, 2, 8, 12) and values.shape == (2, 2, 12, 4)
    assert torch.all(w >= 0)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 2, 8, dtype=F64), rtol=0, atol=1e-12)


@pytest.mark.parametrize("alpha_coeff", [0.0, 1.0])
def test_lara_paper_noise_converges_to_softmax(alpha_coeff):
    q, k, v = make_qkv(b=1, h=1, n=16, d=16, qk_scale=0.5)
    exact = softmax_attention_reference(q, k, v)
    errors = [
        mean_abs_error(
            lara_attention(q, k, v, num_landmarks=4, training=True, num_samples=s, alpha_coeff=alpha_coeff,
                           noise="paper", generator=gen()),
            exact,
        )
        for s in (16, 256, 4096)
    ]
    assert_unbiased_convergence(errors, 0.01)


def test_lara_reference_noise_plateaus():
    q, k, v = make_qkv(b=1, h=1, n=16, d=16, qk_scale=0.5)
    exact = softmax_attention_reference(q, k, v)

    def error(s, noise):
        out = lara_attention(q, k, v, num_landmarks=4, training=True, num_samples=s, noise=noise, generator=gen())
        return mean_abs_error(out, exact)

    ref_errors = [error(256, "reference"), error(4096, "reference")]
    assert ref_errors[1] > 0.7 * ref_errors[0], ref_errors
    assert ref_errors[1] > 3 * error(4096, "paper"), ref_errors


def test_lara_eval_mode_is_deterministic_and_draws_nothing():
    q, k, v = make_qkv()
    g = gen()
    state = g.get_state()
    a = lara_attention(q, k, v, num_landmarks=3, generator=g)
    b = lara_attention(q, k, v, num_landmarks=3, generator=g, num_samples=4, antithetic=True)
    assert torch.equal(a, b)
    assert torch.equal(g.get_state(), state)


def test_lara_training_mode_seeded_reproducible_and_stochastic():
    q, k, v = make_qkv()
    a = lara_attention(q, k, v, num_landmarks=3, training=True, generator=gen(3))
    b = lara_attention(q, k, v, num_landmarks=3, training=True, generator=gen(3))
    c = lara_attention(q, k, v, num_landmarks=3, training=True, generator=gen(4))
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)
    torch.manual_seed(0)
    d = lara_attention(q, k, v, num_landmarks=3, training=True)
    torch.manual_seed(0)
    assert torch.equal(d, lara_attention(q, k, v, num_landmarks=3, training=True))


def _loop_segment_means(x, c, keep=None):
    """Means over the uneven segments of ``segment_lengths``, by a loop (masked when ``keep``)."""
    out = torch.zeros(*x.shape[:2], c, x.shape[-1], dtype=x.dtype)
    start = 0
    for j, length in enumerate(segment_lengths(x.shape[2], c)):
        for b in range(x.shape[0]):
            sel = torch.arange(start, start + length)
            if keep is not None:
                sel = sel[keep[b, start : start + length]]
            if len(sel):
                out[b, :, j] = x[b, :, sel].mean(1)
        start += length
    return out


def test_lara_default_landmarks_are_uneven_segment_means():
    assert segment_lengths(10, 4) == [2, 2, 3, 3]
    q, k, v = make_qkv(n=10)
    mask = right_padding(2, 10, [0, 4])
    for m in (None, mask):
        keep = None if m is None else ~m
        out = lara_attention(q, k, v, key_padding_mask=m, num_landmarks=4)
        ql, kl = _loop_segment_means(q, 4, keep), _loop_segment_means(k, 4, keep)
        ref = lara_attention(q, k, v, key_padding_mask=m, q_landmarks=ql, k_landmarks=kl)
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("n,m,num_landmarks,expected", [(10, 10, 50, 10), (10, 6, 8, 6), (4, 9, 64, 4), (1, 1, 64, 1)])
def test_lara_number_of_proposals_is_min_of_landmarks_and_lengths(n, m, num_landmarks, expected):
    q, k, v = make_qkv(n=n, m=m)
    out = lara_attention(q, k, v, num_landmarks=num_landmarks)
    ql, kl = _loop_segment_means(q, expected), _loop_segment_means(k, expected)
    torch.testing.assert_close(out, lara_attention(q, k, v, q_landmarks=ql, k_landmarks=kl), rtol=0, atol=1e-12)
    if n == m and expected == n:  # landmarks are the tokens themselves
        torch.testing.assert_close(ql, q)


def test_lara_option_errors():
    q, k, v = make_qkv()
    ql, kl = landmarks(2, 2, 3, 6)
    with pytest.raises(ValueError, match="noise"):
        lara_attention(q, k, v, noise="code")
    with pytest.raises(ValueError, match="mis"):
        lara_attention(q, k, v, mis="biased")
    with pytest.raises(ValueError, match="both q_landmarks and k_landmarks"):
        lara_attention(q, k, v, q_landmarks=ql)
    with pytest.raises(ValueError, match="k_landmarks"):
        lara_attention(q, k, v, q_landmarks=ql, k_landmarks=kl[..., :4])
    with pytest.raises(ValueError, match="alpha_coeff"):
        lara_attention(q, k, v, alpha_coeff=-1.0)
    with pytest.raises(TypeError, match="generator"):
        lara_attention(q, k, v, generator=0)
    with pytest.raises(NotImplementedError):
        lara_attention(q, k, v, causal=True)


def test_lara_masked_logits_are_finite_for_a_fully_padded_row():
    q, k, v = make_qkv(b=1, n=5)
    mask = torch.ones(1, 5, dtype=torch.bool)
    for t in (q, k, v):
        t.requires_grad_(True)
    out = lara_attention(q, k, v, key_padding_mask=mask, num_landmarks=2, training=True, generator=gen())
    assert torch.all(out == 0)
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    assert masked_fill_value(F64) > float("-inf")


@pytest.mark.slow
def test_lara_long_sequence_forward_and_backward():
    """N = 131072: an N x N matrix would need 64 GiB; LARA keeps O(N C) memory."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 131072, 32, generator=g, requires_grad=True) for _ in range(3))
    out = lara_attention(q, k, v, training=True, generator=gen())
    out.square().mean().backward()
    assert out.shape == (1, 1, 131072, 32) and torch.isfinite(out).all()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


# the estimator invariants (see randomized_checks), in eval and training modes
CONFIGS = {
    "lara_eval": dict(num_landmarks=3),
    "lara_train": dict(num_landmarks=3, training=True, antithetic=True),
    "lara_train_bh": dict(num_landmarks=3, training=True, mis="bh"),
    "lara_reference_noise": dict(num_landmarks=4, training=True, noise="reference", alpha_coeff=2.0),
}


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_estimator_invariants(config):
    check_invariants(lara_attention, CONFIGS[config], deterministic=config == "lara_eval")
