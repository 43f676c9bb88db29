"""Performer / FAVOR+: the positive-random-feature estimator, orthogonal random features, the
stabilisers, the chunked causal path, convergence to softmax and key padding."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import subquad.ops.performer as performer_module
from conftest import qkv
from subquad.ops.performer import (
    performer_attention,
    performer_features,
    random_projection,
)
from subquad.ops.performer.naive import performer_attention_reference
from subquad.ops.softmax.naive import softmax_attention_reference


def make_qkv(b=2, h=2, n=29, m=None, d=8, dv=None, seed=0, norm=1.0):
    """Seeded float64 q ``(b, h, n, d)``, k ``(b, h, m, d)`` (entries of std ``norm``) and
    v ``(b, h, m, dv)``."""
    q, k, v = qkv(b, h, n, d, m=m, dv=dv, seed=seed)
    return q * norm, k * norm, v


def projection(m, d, seed=1, orthogonal=True):
    """A seeded float64 ``(m, d)`` projection."""
    g = torch.Generator().manual_seed(seed)
    return random_projection(m, d, orthogonal=orthogonal, generator=g, dtype=torch.float64)


MASK = torch.tensor([[False] * 22 + [True] * 7, [True] * 5 + [False] * 24])


# (a) the estimator ------------------------------------------------------------------------------


@pytest.mark.parametrize("orthogonal", [False, True])
def test_positive_features_are_unbiased_for_exp_dot(orthogonal):
    """The mean of phi(x) . phi(y) over 200 independent projections of 512 features each
    (102 400 features) is exp(x . y) within 5 standard errors, the standard error coming from the
    PRF mean squared error ``MSE_1 = exp(|x+y|^2) SM^2 (1 - exp(-|x+y|^2))`` of one feature."""
    x = torch.tensor([0.3, -0.2, 0.4, 0.1], dtype=torch.float64)
    y = torch.tensor([0.5, 0.1, 0.3, -0.4], dtype=torch.float64)
    d, m, draws = 4, 512, 200
    sm = math.exp(float(x @ y))
    s2 = float((x + y) @ (x + y))
    mse_one = math.exp(s2) * sm**2 * (1 - math.exp(-s2))
    g = torch.Generator().manual_seed(0)
    estimates = []
    for _ in range(draws):
        w = random_projection(m, d, orthogonal=orthogonal, generator=g, dtype=torch.float64)
        fx = performer_features(x.view(1, 1, 1, d), w, kind="raw")
        fy = performer_features(y.view(1, 1, 1, d), w, kind="raw")
        assert (fx > 0).all() and (fy > 0).all()
        estimates.append(float((fx * fy).sum()))
    estimates = torch.tensor(estimates)
    standard_error = math.sqrt(mse_one / (m * draws))
    assert abs(float(estimates.mean()) - sm) < 5 * standard_error
    assert 5 * standard_error < 0.05 * sm  # the check is sharp enough to tell exp(x.y) from 1
    if not orthogonal:  # i.i.d. features: the spread of one draw is the formula's
        per_draw = math.sqrt(mse_one / m)
        assert 0.75 * per_draw < float(estimates.std()) < 1.25 * per_draw


def test_raw_features_use_paper_units():
    """``scale`` rescales x to ``sqrt(scale) x`` before the features are taken."""
    x = torch.randn(1, 1, 3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    w = projection(16, 4)
    torch.testing.assert_close(performer_features(x, w, kind="raw", scale=0.25),
                               performer_features(x * 0.5, w, kind="raw"), rtol=1e-14, atol=0)
    with pytest.raises(ValueError, match="kind"):
        performer_features(x, w, kind="value")


# (b) orthogonal random features -----------------------------------------------------------------


@pytest.mark.parametrize("m, d", [(40, 8), (16, 16), (5, 8)])
def test_orthogonal_blocks(m, d):
    w = projection(m, d)
    assert w.shape == (m, d) and w.dtype == torch.float64
    for start in range(0, m, d):
        block = w[start : start + d]
        gram = block @ block.T
        off = gram - torch.diag(torch.diagonal(gram))
        assert off.abs().max() < 1e-12 * gram.diagonal().max()


def test_orthogonal_row_norms_follow_chi():
    """Rows are rescaled by independent chi_d norms: not all equal, mean square about d (the
    standard error of the mean of chi^2_d over m rows is sqrt(2 d / m)); the entries are
    marginally N(0, 1)."""
    m, d = 4096, 16
    w = projection(m, d)
    sq = w.square().sum(-1)
    assert float(sq.sqrt().std()) > 0.3  # chi_16 has std ~0.7; equal norms would give 0
    assert abs(float(sq.mean()) - d) < 5 * math.sqrt(2 * d / m)
    assert abs(float(w.mean())) < 5 / math.sqrt(m * d)
    assert abs(float(w.var()) - 1) < 0.05


def test_iid_projection_is_not_orthogonal():
    w = projection(16, 16, orthogonal=False)
    gram = w @ w.T
    off = gram - torch.diag(torch.diagonal(gram))
    assert off.abs().max() > 1.0


@pytest.mark.parametrize("orthogonal", [False, True])
def test_projection_generator_reproducible(orthogonal):
    a = projection(24, 8, seed=3, orthogonal=orthogonal)
    b = projection(24, 8, seed=3, orthogonal=orthogonal)
    c = projection(24, 8, seed=4, orthogonal=orthogonal)
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)
    w32 = random_projection(24, 8, orthogonal=orthogonal, generator=torch.Generator().manual_seed(3))
    assert w32.dtype == torch.float32


def test_op_generator_reproducible():
    q, k, v = make_qkv()

    def run(seed):
        return performer_attention(q, k, v, num_features=32, generator=torch.Generator().manual_seed(seed))

    assert torch.equal(run(5), run(5))
    assert not torch.allclose(run(5), run(6))
    # the op with a generator equals the op with the projection that generator draws
    w = projection(32, 8, seed=5)
    torch.testing.assert_close(run(5), performer_attention(q, k, v, features=w), rtol=1e-13, atol=1e-13)


# (c) stabilisers ---------------------------------------------------------------------------------


@pytest.mark.parametrize("norm", [1.0, 4.0, 10.0])
@pytest.mark.parametrize("masked", [False, True])
def test_stabilised_equals_unstabilised_reference(norm, masked):
    """With eps=0 the max subtractions cancel exactly. At norm 10 the raw key features reach
    1e-200 (still finite in float64) and the outputs still agree."""
    q, k, v = make_qkv(norm=norm, dv=5)
    w = projection(64, 8)
    mask = MASK if masked else None
    ref = performer_attention_reference(q, k, v, w, mask)
    assert torch.isfinite(ref).all()
    out = performer_attention(q, k, v, features=w, eps=0.0, key_padding_mask=mask)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_stabilised_cross_attention_and_scale():
    q, k, v = make_qkv(n=7, m=29, norm=3.0)
    w = projection(48, 8)
    out = performer_attention(q, k, v, features=w, eps=0.0, key_padding_mask=MASK, scale=0.2)
    ref = performer_attention_reference(q, k, v, w, MASK, scale=0.2)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_stabilised_gradients_equal_reference(causal):
    """The stabilisers are detached constants that cancel, so gradients agree too."""
    q, k, v = (t.requires_grad_() for t in make_qkv(n=17, norm=2.0))
    w = projection(32, 8)
    out = performer_attention(q, k, v, features=w, eps=0.0, causal=causal, chunk_size=5)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref = performer_attention_reference(q, k, v, w, causal=causal)
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("track", [False, True])
@pytest.mark.parametrize("eps", [0.0, 1e-3])
def test_streamed_blocks_equal_reference(monkeypatch, track, eps):
    """Several key and query blocks (the online key stabiliser rescales the sums, a sample's
    first two key blocks are all padding), with autograd (new tensors) and without (output
    written in place): values and gradients equal the one-block computation and, at eps=0,
    the reference."""
    q, k, v = make_qkv(n=150, m=170, norm=2.0, dv=5)
    q, k, v = (t.requires_grad_(track) for t in (q, k, v))
    w = projection(32, 8)
    mask = torch.zeros(2, 170, dtype=torch.bool)
    mask[0, 160:] = True
    mask[1, :130] = True
    one_block = performer_attention(q, k, v, features=w, eps=eps, key_padding_mask=mask)
    monkeypatch.setattr(performer_module, "_BLOCK_ELEMENTS", 1)  # 64-row blocks
    out = performer_attention(q, k, v, features=w, eps=eps, key_padding_mask=mask)
    torch.testing.assert_close(out, one_block, rtol=1e-12, atol=1e-12)
    if eps == 0.0:
        ref = performer_attention_reference(q, k, v, w, mask)
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
        if track:
            grads = torch.autograd.grad(out.square().sum(), (q, k, v))
            ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
            for g, r in zip(grads, ref_grads):
                torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("track", [False, True])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("eps", [0.0, 1e-3])
def test_batched_heads_path_equals_per_head_path(track, masked, eps):
    """The path taken off CPU (all heads as one batched block) computes what the CPU's per-head
    path computes, and at eps=0 the reference."""
    q, k, v = make_qkv(n=31, m=40, norm=2.0, dv=5)
    w = projection(32, 8)
    mask = torch.zeros(2, 40, dtype=torch.bool)
    mask[1, 3:17] = True
    mask = mask if masked else None
    scale = 8**-0.5
    wt = w.t() * (math.sqrt(scale) * performer_module._LOG2E)
    pad = None if mask is None else mask[:, None, :, None].expand(2, 2, 40, 1).reshape(4, 40, 1)
    flat = [t.reshape(4, *t.shape[2:]) for t in (q, k, v)]
    out = None if track else q.new_empty(4, 31, 5)
    res = performer_module._favor_group(*flat, wt, scale, pad, eps, 40, out, None).view(2, 2, 31, 5)
    per_head = performer_attention(q, k, v, features=w, eps=eps, key_padding_mask=mask)
    torch.testing.assert_close(res, per_head, rtol=1e-12, atol=1e-12)
    if eps == 0.0:
        ref = performer_attention_reference(q, k, v, w, mask)
        torch.testing.assert_close(res, ref, rtol=1e-12, atol=1e-12)


# (d) causal ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_size", [1, 4, 7, 29, 64])
@pytest.mark.parametrize("masked", [False, True])
def test_causal_equals_masked_quadratic_form(chunk_size, masked):
    q, k, v = make_qkv(norm=2.0, dv=3)
    w = projection(40, 8)
    mask = MASK if masked else None
    out = performer_attention(q, k, v, features=w, eps=0.0, causal=True, chunk_size=chunk_size,
                              key_padding_mask=mask)
    ref = performer_attention_reference(q, k, v, w, mask, causal=True)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    if masked:  # the first 5 queries of sample 1 see only padding
        assert torch.equal(out[1, :, :5], torch.zeros_like(out[1, :, :5]))


@pytest.mark.parametrize("chunk_size", [1, 8, 64])
def test_causal_last_position_equals_non_causal(chunk_size):
    q, k, v = make_qkv()
    w = projection(32, 8)
    causal = performer_attention(q, k, v, features=w, eps=0.0, causal=True, chunk_size=chunk_size)
    full = performer_attention(q, k, v, features=w, eps=0.0)
    torch.testing.assert_close(causal[:, :, -1], full[:, :, -1], rtol=1e-12, atol=1e-12)


def test_default_eps_is_a_small_perturbation_when_causal():
    """The default eps moves the output of the exact estimator (eps=0, same features) by under 1%:
    non-causal, eps is relative to the largest key feature; causal, no eps is added."""
    q, k, v = make_qkv(b=1, h=2, n=64, d=32)
    w = projection(256, 32)

    def relative_change(causal):
        exact = performer_attention(q, k, v, features=w, causal=causal, eps=0.0)
        default = performer_attention(q, k, v, features=w, causal=causal)
        return float((default - exact).norm() / exact.norm())

    assert relative_change(causal=False) < 1e-2
    assert relative_change(causal=True) < 1e-2


def test_causal_output_ignores_future_keys():
    """The causal key stabiliser does not depend on the data, so a large future key changes no
    past output (with the default eps)."""
    q, k, v = make_qkv()
    w = projection(32, 8)
    out = performer_attention(q, k, v, features=w, causal=True, chunk_size=8)
    k2 = k.clone()
    k2[:, :, 20:] = k2[:, :, 20:] * 5 + 2
    out2 = performer_attention(q, k2, v, features=w, causal=True, chunk_size=8)
    torch.testing.assert_close(out[:, :, :20], out2[:, :, :20], rtol=0, atol=1e-14)


# (e) convergence -----------------------------------------------------------------------------------


def test_error_to_softmax_falls_with_num_features():
    """Mean absolute error to exact attention, averaged over 4 seeds (L=64, d=16), falls with m
    roughly like m^{-1/2}."""
    sizes = [16, 64, 256, 1024]
    errors = []
    for m in sizes:
        per_seed = []
        for seed in range(4):
            q, k, v = make_qkv(b=1, h=2, n=64, d=16, seed=seed, norm=0.5)
            out = performer_attention(q, k, v, num_features=m, generator=torch.Generator().manual_seed(100 + seed))
            per_seed.append(float((out - softmax_attention_reference(q, k, v)).abs().mean()))
        errors.append(sum(per_seed) / len(per_seed))
    assert all(a > b for a, b in itertools.pairwise(errors)), errors
    assert errors[-1] < 0.015, errors
    assert errors[0] / errors[-1] > 3, errors


# (f) key padding ----------------------------------------------------------------------------------


@pytest.mark.parametrize("eps", [0.0, 1e-6, 1e-3])
def test_padded_keys_excluded_from_numerator_and_normaliser(eps):
    """The padded op equals the op on each sample with its padded keys removed."""
    q, k, v = make_qkv(n=13, m=29, norm=2.0)
    w = projection(32, 8)
    out = performer_attention(q, k, v, features=w, key_padding_mask=MASK, eps=eps)
    for b in range(2):
        real = ~MASK[b]
        alone = performer_attention(q[b : b + 1], k[b : b + 1, :, real], v[b : b + 1, :, real], features=w, eps=eps)
        torch.testing.assert_close(out[b : b + 1], alone, rtol=1e-12, atol=1e-12)
        if eps == 0.0:
            ref = performer_attention_reference(q[b : b + 1], k[b : b + 1, :, real], v[b : b + 1, :, real], w)
            torch.testing.assert_close(out[b : b + 1], ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("track", [False, True], ids=["no_grad", "autograd"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_non_finite_padded_keys_and_values_change_nothing(track, bad):
    """Whatever a padded key or value holds (even nan or inf), the output equals the one with
    it zeroed, on both the per-head and the batched path."""
    q, k, v = make_qkv(n=7, m=9, dv=5)
    w = projection(16, 8)
    mask = torch.zeros(2, 9, dtype=torch.bool)
    mask[0, 6:] = True
    expected = performer_attention(q, k.masked_fill(mask[:, None, :, None], 0.0),
                                   v.masked_fill(mask[:, None, :, None], 0.0), features=w, key_padding_mask=mask)
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[0, :, 6:] = bad
    v_bad[0, :, 6:] = bad
    out = performer_attention(q.requires_grad_(track), k_bad, v_bad, features=w, key_padding_mask=mask)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


def test_all_padded_sample_outputs_zero():
    q, k, v = (t.requires_grad_() for t in make_qkv())
    mask = torch.zeros(2, 29, dtype=torch.bool)
    mask[0] = True
    out = performer_attention(q, k, v, num_features=16, key_padding_mask=mask,
                              generator=torch.Generator().manual_seed(0))
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    out.square().sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


# (g) user mistakes ---------------------------------------------------------------------------------


def test_features_of_wrong_dim_raise():
    q, k, v = make_qkv()
    with pytest.raises(ValueError, match="features"):
        performer_attention(q, k, v, features=projection(16, 6))
    with pytest.raises(ValueError, match="features"):
        performer_attention(q, k, v, features=torch.randn(16))
    with pytest.raises(TypeError, match="generator"):
        performer_attention(q, k, v, generator=0)
