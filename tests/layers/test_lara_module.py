"""LARA inside MultiheadAttention: the landmark networks (adaptive-1d, pooled 2-D with and without
key mixing), their bookkeeping, train/eval behaviour, padding, and the parameter-free default."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import subquad
from subquad.layers.lara import AdaptiveLandmarks1d, LaraCore, PooledLandmarks2d
from subquad.ops.nystrom import segment_lengths

F64 = torch.float64


def heads(b=2, h=3, n=12, d=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, n, d, generator=g, dtype=F64) for _ in range(2))


def seq(b=2, n=12, e=12, seed=0):
    return torch.randn(b, n, e, generator=torch.Generator().manual_seed(seed))


def test_default_proposal_has_no_parameters_and_loads_a_softmax_state_dict():
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(12, 3, batch_first=True)
    lara = subquad.MultiheadAttention(12, 3, batch_first=True, method="lara", num_landmarks=4)
    assert isinstance(lara.core, LaraCore) and list(lara.core.parameters()) == []
    lara.load_state_dict(ref.state_dict())  # strict: the same parameters, nothing more
    # the module is the op between torch's projections
    x = seq()
    q, k, v = F.linear(x, ref.in_proj_weight, ref.in_proj_bias).split(12, dim=-1)
    q, k, v = (t.unflatten(-1, (3, 4)).transpose(1, 2) for t in (q, k, v))
    expected = ref.out_proj(subquad.attention(q, k, v, method="lara", num_landmarks=4).transpose(1, 2).flatten(2))
    out, _ = lara.eval()(x, x, x)
    torch.testing.assert_close(out, expected)


def test_core_follows_train_and_eval():
    x = seq()
    attn = subquad.MultiheadAttention(12, 3, batch_first=True, method="lara", num_landmarks=4,
                                      generator=torch.Generator().manual_seed(0))
    attn.eval()
    a, _ = attn(x, x, x)
    b, _ = attn(x, x, x)
    assert torch.equal(a, b)
    attn.train()
    c, _ = attn(x, x, x)
    d, _ = attn(x, x, x)  # the module's generator moves on: fresh noise per forward
    assert not torch.allclose(c, d) and not torch.allclose(a, c)
    torch.manual_seed(1)
    attn2 = subquad.MultiheadAttention(12, 3, batch_first=True, method="lara", num_landmarks=4)
    torch.manual_seed(2)
    e, _ = attn2(x, x, x)
    torch.manual_seed(2)
    assert torch.equal(e, attn2(x, x, x)[0])


@pytest.mark.parametrize("n,c", [(12, 4), (10, 4), (10, 64)])
def test_adaptive_1d_landmarks_are_segment_means_of_the_transformed_tokens(n, c):
    torch.manual_seed(0)
    net = AdaptiveLandmarks1d(4, c).double()
    q, k = heads(n=n)
    ql, kl = net(q, k)
    c_eff = min(c, n)
    assert ql.shape == kl.shape == (2, 3, c_eff, 4)
    q2, k2 = net.q_net(q), net.k_net(k)
    if n % c_eff == 0:
        torch.testing.assert_close(ql, q2.reshape(2, 3, c_eff, n // c_eff, 4).mean(-2))
    bounds = torch.tensor([0] + segment_lengths(n, c_eff)).cumsum(0)
    for j in range(c_eff):
        torch.testing.assert_close(kl[:, :, j], k2[:, :, bounds[j] : bounds[j + 1]].mean(2))


def test_adaptive_1d_masked_means_ignore_padded_content():
    torch.manual_seed(0)
    net = AdaptiveLandmarks1d(4, 3).double()
    q, k = heads(n=9)
    mask = torch.zeros(2, 9, dtype=torch.bool)
    mask[1, 5:] = True
    ql, kl = net(q, k, mask)
    q2 = torch.where(mask[:, None, :, None], 50.0, q)
    k2 = torch.where(mask[:, None, :, None], -50.0, k)
    ql2, kl2 = net(q2, k2, mask)
    torch.testing.assert_close(ql, ql2)
    torch.testing.assert_close(kl, kl2)
    # row 1: segments [0,3), [3,6), [6,9); the last has no real token and gives 0
    torch.testing.assert_close(kl[1, :, 1], net.k_net(k)[1, :, 3:5].mean(1))
    assert torch.all(kl[1, :, 2] == 0)


@pytest.mark.parametrize("num_landmarks,grid", [(49, 7), (50, 7), (10, 3), (1, 1)])
def test_pooled_landmark_count_is_a_square(num_landmarks, grid):
    net = PooledLandmarks2d(4, num_landmarks)
    assert net.num_landmarks == grid * grid
    q, k = heads(n=196)
    ql, kl = net.double()(q, k)
    assert ql.shape == kl.shape == (2, 3, grid * grid, 4)


def test_pooled_landmarks_are_block_means_then_linear_layernorm():
    torch.manual_seed(0)
    net = PooledLandmarks2d(4, 9).double()
    q, k = heads(n=6 * 12)  # a 6 x 12 grid pooled to 3 x 3: blocks of 2 x 4 tokens
    ql, kl = net(q, k, grid_size=(6, 12))
    blocks = q.reshape(2, 3, 3, 2, 3, 4, 4).mean((3, 5)).reshape(2, 3, 9, 4)
    torch.testing.assert_close(ql, net.q_net(blocks))
    mixed_net = PooledLandmarks2d(4, 9, mixed=True).double()
    mixed_net.load_state_dict(net.state_dict())
    _, kl_mixed = mixed_net(q, k, grid_size=(6, 12))
    expected = torch.softmax(0.5 * kl @ kl.transpose(-2, -1), dim=-1) @ kl
    torch.testing.assert_close(kl_mixed, expected)


def test_pooled_landmarks_skip_padded_tokens():
    torch.manual_seed(0)
    net = PooledLandmarks2d(4, 4).double()
    q, k = heads(n=16)
    mask = torch.zeros(2, 16, dtype=torch.bool)
    mask[0, 12:] = True  # the last row of the 4 x 4 grid
    ql, kl = net(q, k, mask)
    q2 = torch.where(mask[:, None, :, None], 9.0, q)
    ql2, kl2 = net(q2, k, mask)
    torch.testing.assert_close(ql, ql2)
    # the bottom-left cell holds tokens 8, 9 (real) and 12, 13 (padded)
    torch.testing.assert_close(ql[0, :, 2], net.q_net(q[0, :, [8, 9]].mean(1)))


@pytest.mark.parametrize("proposal", ["adaptive-1d", "pool", "pool-mixed"])
def test_landmark_networks_train_end_to_end(proposal):
    torch.manual_seed(0)
    attn = subquad.MultiheadAttention(12, 3, batch_first=True, method="lara", proposal=proposal,
                                      num_landmarks=4, generator=torch.Generator().manual_seed(0))
    x = seq(n=16)
    out, _ = attn(x, x, x)
    assert out.shape == x.shape
    out.square().sum().backward()
    grads = [p.grad for p in attn.core.landmarks.parameters()]
    assert len(grads) == 8 and all(g is not None and torch.isfinite(g).all() for g in grads)
    assert sum(g.abs().sum() for g in grads) > 0


def test_grid_input_keeps_its_shape():
    """A (B, Hg, Wg, E) grid is flattened row-major, attended, and reshaped back."""
    torch.manual_seed(0)
    attn = subquad.MultiheadAttention(12, 3, batch_first=True, method="lara", proposal="pool-mixed",
                                      num_landmarks=49, grid_size=(6, 10)).eval()
    grid = torch.randn(2, 6, 10, 12)
    x = grid.flatten(1, 2)
    out, _ = attn(x, x, x)
    assert out.unflatten(1, (6, 10)).shape == grid.shape
    assert attn.core.landmarks.num_landmarks == 49


@pytest.mark.parametrize("proposal", ["none", "adaptive-1d", "pool-mixed"])
@pytest.mark.parametrize("training", [False, True])
def test_padding_invariance_through_the_module(proposal, training):
    torch.manual_seed(0)
    kwargs = dict(batch_first=True, method="lara", proposal=proposal, num_landmarks=4)
    attn = subquad.MultiheadAttention(12, 3, **kwargs).double().train(training)
    x = seq(n=16).double()
    mask = torch.zeros(2, 16, dtype=torch.bool)
    mask[1, 11:] = True
    x2 = torch.where(mask[:, :, None], 5.0, x)
    attn.core.options["generator"] = torch.Generator().manual_seed(3)
    a, _ = attn(x, x, x, key_padding_mask=mask)
    attn.core.options["generator"] = torch.Generator().manual_seed(3)
    b, _ = attn(x2, x2, x2, key_padding_mask=mask)
    torch.testing.assert_close(a[~mask], b[~mask], rtol=0, atol=1e-12)


def test_cross_attention_with_adaptive_landmarks():
    attn = subquad.MultiheadAttention(12, 3, batch_first=True, method="lara", proposal="adaptive-1d",
                                      num_landmarks=8)
    out, _ = attn(seq(n=5), seq(n=11, seed=1), seq(n=11, seed=2))
    assert out.shape == (2, 5, 12)


def test_module_errors():
    with pytest.raises(ValueError, match="proposal"):
        subquad.MultiheadAttention(12, 3, method="lara", proposal="pool-vmixed")
    with pytest.raises(ValueError, match="training"):
        subquad.MultiheadAttention(12, 3, method="lara", training=True)
    with pytest.raises(ValueError, match="q_landmarks"):
        subquad.MultiheadAttention(12, 3, method="lara", q_landmarks=torch.zeros(1, 3, 2, 4))
    with pytest.raises(ValueError, match="grid_size"):
        subquad.MultiheadAttention(12, 3, method="lara", proposal="pool", grid_size=(3,))
    attn = subquad.MultiheadAttention(12, 3, batch_first=True, method="lara", proposal="pool")
    x = seq(n=10)
    with pytest.raises(ValueError, match="grid_size"):
        attn(x, x, x)
    with pytest.raises(ValueError, match="self-attention"):
        attn(x, seq(n=16), seq(n=16))
    with pytest.raises(NotImplementedError):
        attn(seq(n=16), seq(n=16), seq(n=16), is_causal=True)


def test_pool_of_a_grid_matches_torch_adaptive_pool_for_uneven_cells():
    torch.manual_seed(0)
    net = PooledLandmarks2d(4, 9).double()
    q, k = heads(n=5 * 7)
    ql, _ = net(q, k, grid_size=(5, 7))
    img = q.transpose(-2, -1).reshape(6, 4, 5, 7)
    pooled = F.adaptive_avg_pool2d(img, 3).reshape(2, 3, 4, 9).transpose(-2, -1)
    torch.testing.assert_close(ql, net.q_net(pooled))
