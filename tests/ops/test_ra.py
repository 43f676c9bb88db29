"""RA op: agreement with the slow reference on the same samples, sampling from the masked softmax
row, convergence with paper noise and the plateau of reference noise, the deterministic
mixture-mean estimator, gradients, seeding, and the estimator invariants shared with LARA."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import right_padding
from randomized_checks import F64, assert_unbiased_convergence, check_invariants, gen, make_qkv, mean_abs_error
from subquad.ops.ra import _sample_key_indices, ra_attention, ra_samples
from subquad.ops.ra.naive import ra_attention_reference
from subquad.ops.softmax.naive import softmax_attention_reference


@pytest.mark.parametrize("n,m", [(7, 7), (5, 9)])
@pytest.mark.parametrize("masked", [False, True])
def test_ra_matches_reference_on_the_same_samples(n, m, masked):
    q, k, v = make_qkv(n=n, m=m, dv=3)
    mask = right_padding(2, m, [0, 3]) if masked else None
    out = ra_attention(q, k, v, key_padding_mask=mask, num_samples=5, generator=gen())
    omega = ra_samples(q, k, mask, num_samples=5, generator=gen())
    ref = ra_attention_reference(q, k, v, omega, mask)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)


def test_ra_samples_key_indices_from_the_masked_softmax_row():
    q, k, _ = make_qkv(b=1, h=1, n=2, m=6, d=4)
    mask = right_padding(1, 6, [2])
    idx = _sample_key_indices(q, k, mask, 0.5, 40000, gen())  # (1, 1, 2, S)
    logits = (q @ k.transpose(-2, -1) * 0.5).masked_fill(mask[:, None, None, :], float("-inf"))
    probs = torch.softmax(logits, dim=-1)[0, 0]
    for n in range(2):
        freq = torch.bincount(idx[0, 0, n], minlength=6).to(F64) / 40000
        assert freq[4:].sum() == 0  # padded keys are never drawn
        torch.testing.assert_close(freq, probs[n], rtol=0, atol=0.01)


def test_ra_paper_noise_converges_to_softmax():
    q, k, v = make_qkv(b=1, h=1, n=16, d=16, qk_scale=0.5)
    exact = softmax_attention_reference(q, k, v)
    errors = [
        mean_abs_error(ra_attention(q, k, v, num_samples=s, noise="paper", generator=gen()), exact)
        for s in (64, 1024, 16384)
    ]
    assert_unbiased_convergence(errors, 0.004)


def test_ra_reference_noise_plateaus():
    q, k, v = make_qkv(b=1, h=1, n=16, d=16, qk_scale=0.5)
    exact = softmax_attention_reference(q, k, v)
    ref_errors = [
        mean_abs_error(ra_attention(q, k, v, num_samples=s, noise="reference", generator=gen()), exact)
        for s in (1024, 16384)
    ]
    paper = mean_abs_error(ra_attention(q, k, v, num_samples=16384, noise="paper", generator=gen()), exact)
    # biased: 16x the samples barely helps, and it ends well above the paper-noise estimator
    assert ref_errors[1] > 0.7 * ref_errors[0], ref_errors
    assert ref_errors[1] > 3 * paper, (ref_errors, paper)


def test_ra_mixture_mean_is_deterministic_and_differentiable():
    q, k, v = make_qkv(n=6)
    q.requires_grad_(True)
    k.requires_grad_(True)
    a = ra_attention(q, k, v, estimator="mixture_mean")
    b = ra_attention(q, k, v, estimator="mixture_mean")
    assert torch.equal(a, b)
    a.sum().backward()
    assert q.grad.abs().sum() > 0 and k.grad.abs().sum() > 0
    # it is f at w = sqrt(s) (q + sum_m pi_nm k_m), written out
    s = 6 ** -0.5
    pi = torch.softmax(q @ k.transpose(-2, -1) * s, dim=-1)
    omega = ((q + pi @ k) * math.sqrt(s)).unsqueeze(-2)
    torch.testing.assert_close(a, ra_attention_reference(q, k, v, omega), rtol=0, atol=1e-12)


def test_ra_gradients_reach_q_k_v():
    q, k, v = make_qkv(b=1, h=2, n=5, d=4)
    for t in (q, k, v):
        t.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda q, k, v: ra_attention(q, k, v, num_samples=3, generator=gen()), (q, k, v))


def test_ra_seeded_reproducible_and_stochastic():
    q, k, v = make_qkv()
    a = ra_attention(q, k, v, generator=gen(3))
    b = ra_attention(q, k, v, generator=gen(3))
    c = ra_attention(q, k, v, generator=gen(4))
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)
    torch.manual_seed(0)
    d = ra_attention(q, k, v)
    torch.manual_seed(0)
    assert torch.equal(d, ra_attention(q, k, v))



def test_ra_option_errors():
    q, k, v = make_qkv()
    with pytest.raises(TypeError, match="generator"):
        ra_attention(q, k, v, generator=0)
    with pytest.raises(ValueError, match="estimator"):
        ra_attention(q, k, v, estimator="mean")
    with pytest.raises(ValueError, match="noise"):
        ra_attention(q, k, v, noise="code")
    with pytest.raises(NotImplementedError):
        ra_attention(q, k, v, causal=True)


# the estimator invariants (see randomized_checks), for the sampling and the mixture-mean estimator
CONFIGS = {"ra": dict(num_samples=3), "ra_mixture_mean": dict(estimator="mixture_mean")}


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_estimator_invariants(config):
    check_invariants(ra_attention, CONFIGS[config], deterministic=config == "ra_mixture_mean")
