"""magicpig against its naive reference (naive.py), its limits (every key kept: exact attention) and
its sampling probability."""

import math

import pytest
import torch

import subquad
from conftest import qkv
from test_topk import _mask  # the same padding pattern as the topk tests
from subquad.ops.magicpig import (collision_log_probability, draw_hyperplanes, expected_keys, magicpig_attention,
                                  simhash_codes)
from subquad.ops.magicpig.naive import magicpig_attention_reference
from subquad.ops.softmax.naive import softmax_attention_reference

OPTIONS = [dict(min_matches=2, sinks=1, local=2), dict(min_matches=1, sinks=0, local=3),
           dict(min_matches=3, sinks=2, local=0)]


def _planes(tables, bits, dim=8, seed=0):
    return draw_hyperplanes(tables, bits, dim, generator=torch.Generator().manual_seed(seed)).double()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("opts", OPTIONS, ids=["m2", "m1-nosink", "m3-nolocal"])
def test_matches_naive(causal, opts):
    q, k, v = qkv(2, 2, 13, 8, dv=5)
    mask, w = _mask(2, 13), _planes(6, 3)
    out = magicpig_attention(q, k, v, key_padding_mask=mask, causal=causal, scale=0.7, hyperplanes=w, **opts)
    ref = magicpig_attention_reference(q, k, v, mask, causal, 0.7, hyperplanes=w, **opts)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("n,m", [(7, 11), (11, 7), (1, 9), (1, 1), (9, 1)])
def test_cross_lengths_and_one_query_match_naive(n, m):
    """N != M: query i stands at key position i (past the last key: at the last)."""
    q, k, v = qkv(2, 2, n, 8, m=m, dv=5)
    mask = torch.zeros(2, m, dtype=torch.bool)
    mask[1, -(m // 3):] = m > 2
    w = _planes(6, 2)
    out = magicpig_attention(q, k, v, key_padding_mask=mask, hyperplanes=w, min_matches=2, sinks=1, local=2)
    ref = magicpig_attention_reference(q, k, v, mask, hyperplanes=w, min_matches=2, sinks=1, local=2)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    assert out.shape == (2, 2, n, 5)


def test_future_keys_change_no_past_output():
    q, k, v = qkv(1, 2, 12, 8)
    w = _planes(6, 3)
    out = magicpig_attention(q, k, v, causal=True, hyperplanes=w, sinks=1, local=2)
    for t in (0, 5, 10):
        k2, v2 = k.clone(), v.clone()
        k2[:, :, t + 1:] = 3 * torch.randn_like(k2[:, :, t + 1:])
        v2[:, :, t + 1:] = 3 * torch.randn_like(v2[:, :, t + 1:])
        out2 = magicpig_attention(q, k2, v2, causal=True, hyperplanes=w, sinks=1, local=2)
        assert torch.equal(out2[:, :, : t + 1], out[:, :, : t + 1])


@pytest.mark.parametrize("causal", [False, True])
def test_a_padded_item_keeps_what_it_keeps_unpadded(causal):
    """Sinks and local keys count real keys: an item with padding in front and in the middle gives,
    at its real positions, the outputs of the same item without the padding."""
    q, k, v = qkv(1, 2, 9, 8, dv=5)
    w = _planes(6, 2)
    real = torch.tensor([2, 3, 4, 7, 8, 9, 10, 11, 12])
    pad = torch.ones(1, 14, dtype=torch.bool)
    pad[0, real] = False
    qp, kp, vp = (torch.zeros(1, 2, 14, x.shape[-1], dtype=x.dtype).index_copy(2, real, x) for x in (q, k, v))
    opts = dict(hyperplanes=w, sinks=2, local=3, causal=causal)
    alone = magicpig_attention(q, k, v, **opts)
    padded = magicpig_attention(qp, kp, vp, key_padding_mask=pad, **opts)
    torch.testing.assert_close(padded[:, :, real], alone, rtol=1e-12, atol=1e-12)


def test_queries_without_a_visible_key_output_zeros():
    q, k, v = qkv(2, 2, 6, 8)
    mask = torch.zeros(2, 6, dtype=torch.bool)
    mask[0] = True
    mask[1, :2] = True
    for causal in (False, True):
        out = magicpig_attention(q, k, v, key_padding_mask=mask, causal=causal, hyperplanes=_planes(4, 2))
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        assert torch.isfinite(out).all()
    assert torch.equal(out[1, :, :2], torch.zeros_like(out[1, :, :2]))


def test_gradients_match_naive():
    """u is a constant under autograd in the op and in the reference: the same gradients."""
    opts = dict(min_matches=2, sinks=1, local=2, hyperplanes=_planes(6, 2, dim=4))
    mask = _mask(1, 11)
    for causal in (False, True):
        a = qkv(1, 2, 11, 4, requires_grad=True)
        b = qkv(1, 2, 11, 4, requires_grad=True)
        cot = torch.randn(1, 2, 11, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        (magicpig_attention(*a, key_padding_mask=mask, causal=causal, **opts) * cot).sum().backward()
        (magicpig_attention_reference(*b, mask, causal, **opts) * cot).sum().backward()
        for x, y in zip(a, b):
            torch.testing.assert_close(x.grad, y.grad, rtol=1e-12, atol=1e-12)


def test_gradcheck_with_fixed_hyperplanes():
    """v on the sampling path (u does not depend on v); q, k and v where u is 1 (min_matches=0:
    every key sampled, exact attention through the same code) and where every kept key is static."""
    q, k, v = qkv(1, 1, 7, 4, requires_grad=True)
    w = _planes(4, 2, dim=4)
    sampling = dict(hyperplanes=w, min_matches=1, sinks=1, local=1)
    assert torch.autograd.gradcheck(lambda v: magicpig_attention(q, k, v, causal=True, **sampling), (v,))
    # 40-bit tables: no random key collides, only the static keys are kept
    for causal, opts in ((False, dict(hyperplanes=w, min_matches=0, sinks=0, local=0)),
                         (True, dict(hyperplanes=_planes(4, 40, dim=4), min_matches=1, sinks=1, local=2))):
        assert torch.autograd.gradcheck(
            lambda q, k, v, causal=causal, opts=opts: magicpig_attention(q, k, v, causal=causal, **opts), (q, k, v))


def test_every_key_kept_is_softmax():
    """min_matches=0 (u = 1, every key sampled), every key static, and very many tables of one bit
    (every key collides in at least two, u = 1 to rounding): exact attention."""
    q, k, v = qkv(1, 2, 9, 8, dv=5)
    for causal in (False, True):
        exact = softmax_attention_reference(q, k, v, causal=causal)
        torch.testing.assert_close(magicpig_attention(q, k, v, causal=causal, min_matches=0, sinks=0, local=0),
                                   exact, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(magicpig_attention(q, k, v, causal=causal, sinks=0, local=9), exact,
                                   rtol=1e-12, atol=1e-12)
        many = magicpig_attention(q, k, v, causal=causal, sinks=0, local=0, num_bits=1, num_tables=4000,
                                  generator=torch.Generator().manual_seed(0))
        torch.testing.assert_close(many, exact, rtol=1e-10, atol=1e-10)


def test_a_table_collides_with_probability_one_minus_angle_over_pi_to_the_k():
    """Over many tables, the share that give a query and a key one code is ``(1 - theta/pi)^K``,
    and ``u`` is the binomial tail of that probability."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 8, generator=g, dtype=torch.float64)
    q, k = x[0].view(1, 1, 1, 8), x[1].view(1, 1, 1, 8)
    cos = float(x[0] @ x[1] / (x[0].norm() * x[1].norm()))
    p = 1 - math.acos(cos) / math.pi
    w = draw_hyperplanes(20000, 2, 8, generator=g).double()
    share = (simhash_codes(q, w) == simhash_codes(k, w)).double().mean().item()
    assert abs(share - p ** 2) < 4 * math.sqrt(p ** 2 * (1 - p ** 2) / 20000)
    for L, m in ((4, 2), (75, 2), (10, 5)):
        u = math.fsum(math.comb(L, j) * p ** (2 * j) * (1 - p ** 2) ** (L - j) for j in range(m, L + 1))
        got = collision_log_probability(torch.tensor(cos, dtype=torch.float64), 2, L, m).exp().item()
        assert got == pytest.approx(u, rel=1e-13)


def test_each_key_is_sampled_with_probability_u():
    """One-hot values show which keys a query kept: over many draws, key j is kept in a share u_j
    of them (so e^l / u weights are unbiased for e^l)."""
    q, k, _ = qkv(1, 1, 1, 8, m=6)
    v = torch.eye(6, dtype=q.dtype)[None, None]
    draws = 400
    g = torch.Generator().manual_seed(0)
    kept = sum((magicpig_attention(q, k, v, num_bits=2, num_tables=4, sinks=0, local=0, generator=g)[0, 0, 0] > 0)
               .double() for _ in range(draws)) / draws
    cos = (q[0, 0] / q[0, 0].norm()) @ (k[0, 0] / k[0, 0].norm(dim=-1, keepdim=True)).T
    u = collision_log_probability(cos[0], 2, 4, 2).exp()
    assert ((kept - u).abs() <= 4.5 * (u * (1 - u) / draws).sqrt() + 1e-3).all(), (kept, u)


@pytest.mark.parametrize("causal", [False, True])
def test_expected_keys_is_the_mean_count_of_keys_kept(causal):
    """The registry's ``expected_keys``: over many draws, the mean number of keys a query keeps
    (one-hot values show them), static keys included."""
    q, k, _ = qkv(1, 1, 7, 8)
    v = torch.eye(7, dtype=q.dtype)[None, None]
    opts = {"num_bits": 2, "num_tables": 4, "sinks": 1, "local": 2}
    draws = 400
    g = torch.Generator().manual_seed(0)
    kept = sum((magicpig_attention(q, k, v, causal=causal, generator=g, **opts)[0, 0] > 0).double()
               for _ in range(draws)) / draws  # (N, M): the share of draws that kept each key
    want = expected_keys(q, k, causal, subquad.get_method("magicpig").make_options(**opts))[0, 0]
    assert subquad.get_method("magicpig").expected_keys is expected_keys
    assert want.shape == (7,) and (want >= 1).all()
    spread = (kept * (1 - kept)).sum(-1).div(draws).sqrt()
    assert ((kept.sum(-1) - want).abs() <= 4.5 * spread + 1e-3).all(), (kept.sum(-1), want)


def test_bf16_autocast_runs_in_float32():
    q, k, v = qkv(2, 2, 13, 8, dtype=torch.float32)
    w = _planes(6, 2).float()
    mask = _mask(2, 13)
    ref = magicpig_attention(q, k, v, key_padding_mask=mask, causal=True, hyperplanes=w)
    for x in (torch.float32, torch.bfloat16):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = magicpig_attention(q.to(x), k.to(x), v.to(x), key_padding_mask=mask, causal=True, hyperplanes=w)
        assert out.dtype == x and torch.isfinite(out).all()
        if x == torch.float32:
            torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_options_and_the_fixed_draw():
    info = subquad.get_method("magicpig")
    drawn = info.fixed_draw(info.make_options(), 16, torch.Generator().manual_seed(0))
    assert drawn["hyperplanes"].shape == (75, 8, 16)
    q, k, v = qkv(1, 1, 5, 8)
    with pytest.raises(ValueError, match=r"magicpig: hyperplanes must have shape \(L, K, 8\)"):
        magicpig_attention(q, k, v, hyperplanes=torch.randn(4, 2, 6))
    with pytest.raises(ValueError, match="magicpig: min_matches must be at most"):
        magicpig_attention(q, k, v, hyperplanes=torch.randn(2, 2, 8), min_matches=3)
    with pytest.raises(ValueError, match="magicpig: num_bits must be at most 62"):
        magicpig_attention(q, k, v, num_bits=63)
    with pytest.raises(ValueError, match="magicpig: hyperplanes must be a floating"):
        magicpig_attention(q, k, v, hyperplanes=torch.randn(2, 8))
    # the FLOP count follows the hyperplanes' shape when they are given
    assert info.flops(1, 1, 4, 4, 8, 8, {**info.option_defaults(), "hyperplanes": torch.zeros(2, 3, 8)}) == \
        2 * (16 * 24 + 8 * 6 * 8)


@pytest.mark.parametrize("causal", [False, True])
def test_queries_in_chunks_match_naive(causal, monkeypatch):
    """Queries taken a few at a time (causal: each chunk against the keys up to its last query)."""
    import subquad.ops.magicpig as magicpig

    q, k, v = qkv(2, 2, 13, 8, dv=5)
    monkeypatch.setattr(magicpig, "_CHUNK_BYTES", 48 * 2 * 2 * 13 * 3)  # 3 queries a chunk
    mask, w = _mask(2, 13), _planes(6, 3)
    out = magicpig_attention(q, k, v, key_padding_mask=mask, causal=causal, hyperplanes=w, sinks=1, local=2)
    ref = magicpig_attention_reference(q, k, v, mask, causal, hyperplanes=w, sinks=1, local=2)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
