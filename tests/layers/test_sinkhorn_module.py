"""``MultiheadAttention(method="sinkhorn")``: the sort networks (paper's per-head MLP and the
length-agnostic one), Gumbel noise in training only, gradients reaching the sort network,
causality and padding through the module, the Sinkhorn Mixture and the LRA compatibility mode."""

from __future__ import annotations

import pytest
import torch

import subquad
from subquad.layers.sinkhorn import SinkhornCore, SortNet
from subquad.ops.sinkhorn import sinkhorn_attention
from subquad.ops.sinkhorn.naive import lra_sinkhorn_attention_reference
from subquad.ops.softmax import softmax_attention

F64 = torch.float64


def seeded(*shape, seed=0, dtype=F64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def module(seed=0, **options):
    """A float64 ``MultiheadAttention(16, 2, method="sinkhorn", batch_first=True)``, blocks of 4."""
    torch.manual_seed(seed)
    options.setdefault("block_size", 4)
    return subquad.MultiheadAttention(16, 2, method="sinkhorn", batch_first=True, dtype=F64, **options)


def heads(b=2, h=2, n=14, d=8, seed=0):
    return seeded(b, h, n, d, seed=seed), seeded(b, h, n, d, seed=seed + 1), seeded(b, h, n, d, seed=seed + 2)


def test_core_and_shapes():
    """The sinkhorn core is used; (B, N, E) -> (B, N, E) for batch_first, (N, B, E) otherwise,
    and unbatched (N, E)."""
    m = module(sort_net="mlp")
    assert isinstance(m.core, SinkhornCore) and isinstance(m.core.sort_net, SortNet)
    x = seeded(3, 13, 16)
    assert m(x, x, x)[0].shape == (3, 13, 16)
    assert m(x[0], x[0], x[0])[0].shape == (13, 16)
    m2 = subquad.MultiheadAttention(16, 2, method="sinkhorn", dtype=F64, block_size=4)
    xt = x.transpose(0, 1)
    assert m2(xt, xt, xt)[0].shape == (13, 3, 16)


@pytest.mark.parametrize("sort_net", ["attention", "mlp"])
def test_noise_in_training_only(sort_net):
    """eval: deterministic; train: Gumbel noise, a fresh draw per call, reproducible from the
    generator's seed."""
    gen = torch.Generator().manual_seed(0)
    m = module(sort_net=sort_net, generator=gen)
    x = seeded(2, 16, 16)
    m.eval()
    assert torch.equal(m(x, x, x)[0], m(x, x, x)[0])
    m.train()
    gen.manual_seed(5)
    a = m(x, x, x)[0]
    b = m(x, x, x)[0]
    gen.manual_seed(5)
    c = m(x, x, x)[0]
    assert not torch.allclose(a, b, atol=1e-6)
    assert torch.equal(a, c)


def test_attention_sort_net_is_the_op_default():
    """sort_net='attention' (default) adds no parameters: the core equals the op with its
    default logits <mean q_i, mean k_j> / sqrt(d)."""
    m = module()
    assert m.core.sort_net is None and not list(m.core.parameters())
    m.eval()
    q, k, v = heads()
    mask = torch.zeros(2, 14, dtype=torch.bool)
    mask[1, 9:] = True
    out = m.core(q, k, v, mask, False)
    torch.testing.assert_close(out, sinkhorn_attention(q, k, v, key_padding_mask=mask, block_size=4),
                               rtol=0, atol=0)


@pytest.mark.parametrize("causal", [False, True])
def test_mlp_sort_net_receives_gradients(causal):
    """Every parameter of the paper's sort network gets a non-zero gradient, and so does the
    input projection (the sorted keys and the logits both depend on it)."""
    m = module(sort_net="mlp")
    x = seeded(2, 16, 16, seed=3)
    out, _ = m(x, x, x, is_causal=causal)
    (out * seeded(*out.shape, seed=4)).sum().backward()
    for name in ("w1", "b1", "w2", "b2"):
        grad = getattr(m.core.sort_net, name).grad
        assert grad is not None and grad.norm() > 0, name
    assert m.in_proj_weight.grad.norm() > 0


def test_mlp_sort_net_logits_depend_on_each_block_only():
    """Row i of the MLP logits comes from block i's summary: changing block 2 changes row 2
    only; block means are masked means (padding content is ignored)."""
    net = SortNet(2, 8, max_blocks=6, dtype=F64)
    q, k, _ = heads(n=16)
    r = net(q, k, None, False, 4)
    assert r.shape == (2, 2, 4, 4)
    q2 = q.clone()
    q2[:, :, 8:12] += 1.0
    r2 = net(q2, k, None, False, 4)
    changed = (r2 - r).abs().amax((0, 1, 3)) > 0
    assert changed.tolist() == [False, False, True, False]
    mask = torch.zeros(2, 16, dtype=torch.bool)
    mask[:, 13:] = True
    k3 = k.clone()
    k3[:, :, 13:] = 100.0
    torch.testing.assert_close(net(q, k3, mask, False, 4), net(q, k, mask, False, 4), rtol=0, atol=0)


def test_mlp_sort_net_refuses_too_many_blocks():
    m = module(sort_net="mlp", max_blocks=3)
    x = seeded(1, 16, 16)
    with pytest.raises(ValueError, match="max_blocks"):
        m(x, x, x)
    assert m(x[:, :12], x[:, :12], x[:, :12])[0].shape == (1, 12, 16)


@pytest.mark.parametrize("sort_net", ["attention", "mlp"])
@pytest.mark.parametrize("training", [False, True])
def test_module_causal_no_leak(sort_net, training):
    """Through the module (projections, sort network, Gumbel noise from a re-seeded generator):
    for every t, new input after t leaves outputs 0..t unchanged and gives them zero gradient."""
    n = 14
    gen = torch.Generator()
    m = module(sort_net=sort_net, generator=gen, top_blocks=2)
    m.train(training)
    x = seeded(2, n, 16).requires_grad_(True)
    gen.manual_seed(0)
    out, _ = m(x, x, x, is_causal=True)
    for t in range(n):
        x2 = x.detach().clone()
        x2[:, t + 1:] = seeded(2, n - t - 1, 16, seed=100 + t)
        gen.manual_seed(0)
        out2, _ = m(x2, x2, x2, is_causal=True)
        assert torch.equal(out2[:, :t + 1], out[:, :t + 1]), f"t={t}"
        (g,) = torch.autograd.grad(out[:, :t + 1].sum(), x, retain_graph=True)
        assert torch.equal(g[:, t + 1:], torch.zeros_like(g[:, t + 1:])), f"gradient leak at t={t}"


@pytest.mark.parametrize("sort_net", ["attention", "mlp"])
def test_module_padding_invariance(sort_net):
    """New input at padded positions leaves every real output unchanged."""
    m = module(sort_net=sort_net, top_blocks=2)
    m.eval()
    x = seeded(2, 15, 16)
    mask = torch.zeros(2, 15, dtype=torch.bool)
    mask[0, [3, 4]] = True
    mask[1, 7:] = True
    out, _ = m(x, x, x, key_padding_mask=mask)
    x2 = torch.where(mask[..., None], seeded(2, 15, 16, seed=9) * 4, x)
    out2, _ = m(x2, x2, x2, key_padding_mask=mask)
    torch.testing.assert_close(out2[~mask], out[~mask], rtol=0, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_mixture_adds_exact_attention(causal):
    """mixture=True: Sinkhorn attention plus exact softmax attention on the same q, k, v."""
    m = module(sort_net="mlp", mixture=True)
    m.eval()
    q, k, v = heads()
    mask = torch.zeros(2, 14, dtype=torch.bool)
    mask[0, 12:] = True
    out = m.core(q, k, v, mask, causal)
    logits = m.core.sort_net(q, k, mask, causal, 4)
    expected = sinkhorn_attention(q, k, v, key_padding_mask=mask, causal=causal, block_size=4, sort_logits=logits)
    expected = expected + softmax_attention(q, k, v, key_padding_mask=mask, causal=causal)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)


def test_lra_compat_reproduces_the_reference_computation():
    """lra_compat=True equals the LRA contraction written out literally (strided blocks, summed
    blocks, separate softmaxes), with the permutation of the LRA sort network."""
    m = module(lra_compat=True, block_size=3, max_blocks=25)
    q, k, v = heads(n=14)
    mask = torch.zeros(2, 14, dtype=torch.bool)
    mask[1, 10:] = True
    perm = m.core.sort_net(k, mask, 3)
    assert perm.shape == (2, 2, 5, 5)
    out = m.core(q, k, v, mask, False)
    ref = lra_sinkhorn_attention_reference(q, k, v, perm, mask, block_size=3)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)


def test_lra_compat_sort_network_gets_no_gradient():
    """The LRA quirk this mode reproduces: its sort network does not reach the output, so its
    gradient is zero up to rounding, while the paper's sort network gets a real gradient."""
    x = seeded(2, 18, 16)
    grads = {}
    for kind, opts in (("lra", {"lra_compat": True, "block_size": 3}), ("mlp", {"sort_net": "mlp", "block_size": 3})):
        m = module(**opts)
        out, _ = m(x, x, x)
        (out * seeded(*out.shape, seed=2)).sum().backward()
        params = list(m.core.sort_net.parameters())
        grads[kind] = sum(p.grad.norm() for p in params).item()
    assert grads["lra"] < 1e-10
    assert grads["mlp"] > 1e-3


def test_option_errors():
    with pytest.raises(ValueError, match="sort_logits"):
        module(sort_logits=torch.zeros(1, 1, 4, 4))
    with pytest.raises(ValueError, match="training"):
        module(training=True)
    with pytest.raises(ValueError, match="sort_net"):
        module(sort_net="bitonic")
    with pytest.raises(ValueError, match="max_blocks"):
        module(sort_net="mlp", max_blocks=0)
    with pytest.raises(TypeError, match="mixture"):
        module(mixture=1)
    with pytest.raises(ValueError, match="lra_compat"):
        module(lra_compat=True, tau=0.5)
    with pytest.raises(ValueError, match="tau"):
        module(tau=-1.0)
    m = module(lra_compat=True)
    x = seeded(1, 8, 16)
    with pytest.raises(NotImplementedError, match="causal"):
        m(x, x, x, is_causal=True)
    with pytest.raises(ValueError, match="self-attention only"):
        module(sort_net="mlp")(x, seeded(1, 9, 16), seeded(1, 9, 16))
