"""Hamburger blocks: the (B, C, H, W) module, its ham, and the registered 1-D token mixer."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import subquad
from subquad.layers import Hamburger, HamburgerMixer
from subquad.layers.hamburger import HamburgerOptions, MatrixDecomposition
from subquad.ops import decomposition as dec

HAMS = ["nmf", "vq", "cd"]
VERSIONS = ["v1", "v2", "light"]


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------
# the (B, C, H, W) module


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("ham", HAMS)
@pytest.mark.parametrize("groups", [1, 2, 4])
def test_shapes_any_size(version, ham, groups):
    torch.manual_seed(0)
    m = Hamburger(8, 16, version=version, ham=ham, groups=groups, rank=3)
    for batch, h, w in [(1, 7, 5), (3, 7, 5), (2, 4, 9)]:  # one module, any H and W
        z = torch.randn(batch, 8, h, w)
        y = m(z)
        assert y.shape == z.shape and torch.isfinite(y).all() and (y >= 0).all()


def test_construction_errors():
    with pytest.raises(ValueError, match="divisible by groups"):
        Hamburger(12, groups=5)
    with pytest.raises(ValueError, match="version"):
        Hamburger(8, version="v3")
    with pytest.raises(ValueError, match="ham"):
        Hamburger(8, ham="svd")
    with pytest.raises(ValueError, match="grad"):
        Hamburger(8, grad="exact")
    with pytest.raises(ValueError, match="channels"):
        Hamburger(0)
    with pytest.raises(ValueError, match="eta"):
        Hamburger(8, rand_init=False, eta=1.5)
    with pytest.raises(ValueError, match=r"\(B, 8, H, W\)"):
        Hamburger(8)(torch.randn(1, 4, 3, 3))


@pytest.mark.parametrize("ham", HAMS)
def test_ham_has_no_parameters(ham):
    m = Hamburger(8, ham=ham, rank=3)
    assert list(m.ham.parameters()) == [] and list(m.ham.buffers()) == []
    names = {n.split(".")[0] for n, _ in m.named_parameters()}
    assert names == {"lower_bread", "upper_bread", "norm"}
    persistent = Hamburger(8, ham=ham, groups=2, rank=3, rand_init=False)
    assert list(persistent.ham.parameters()) == []
    assert [n for n, _ in persistent.ham.named_buffers()] == ["bases"]
    assert persistent.ham.bases.shape == (2, 4, 3)


def test_structure_of_the_variants():
    v1, v2, light = (Hamburger(32, version=v, rank=4) for v in VERSIONS)
    assert isinstance(v1.norm, nn.BatchNorm2d) and v1.cheese is None and v1.upper_bread.bias is None
    assert v2.norm is None and [type(m) for m in v2.cheese] == [nn.Conv2d, nn.BatchNorm2d, nn.ReLU]
    assert v2.cheese[0].bias is None and v2.upper_bread.bias is None
    assert isinstance(light.norm, nn.GroupNorm) and light.norm.num_groups == 32
    assert all(m.lower_bread.bias is not None for m in (v1, v2, light))


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("ham", HAMS)
def test_forward_is_the_composition_of_its_parts(version, ham):
    """Output = ReLU(Z + ...) with the documented order; the first conv after the ham, applied
    to the factors, equals the conv of the reconstruction."""
    torch.manual_seed(0)
    m = Hamburger(8, 12, version=version, ham=ham, groups=2, rank=3).double()
    z = torch.randn(2, 8, 5, 3, dtype=torch.float64)
    y = m(z, generator=_gen())
    x = m.lower_bread(z)
    if ham == "nmf":
        x = F.relu(x)
    recon = m.ham(x.flatten(2), generator=_gen()).view_as(x)
    if version == "v2":
        expected = m.upper_bread(m.cheese(recon))
    else:
        expected = m.norm(m.upper_bread(recon))
    torch.testing.assert_close(y, F.relu(z + expected), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("ham", HAMS)
def test_relu_before_the_ham_exactly_for_nmf(ham):
    torch.manual_seed(0)
    m = Hamburger(8, ham=ham, rank=3)
    seen = []
    m.ham.register_forward_pre_hook(lambda mod, args: seen.append(args[0].detach()))
    m(torch.randn(2, 8, 6, 6))
    assert (seen[0].min() >= 0).item() == (ham == "nmf")


@pytest.mark.parametrize("ham", HAMS)
def test_groups_are_independent_in_the_ham(ham):
    ham_module = MatrixDecomposition(8, ham=ham, groups=2, rank=3)
    x = torch.randn(2, 8, 20, dtype=torch.float64)
    if ham == "nmf":
        x = x.abs()
    x2 = x.clone()
    x2[:, :4] = x2[:, :4] * 3 + 1  # group 0 only
    out = ham_module(x, generator=_gen())
    out2 = ham_module(x2, generator=_gen())
    torch.testing.assert_close(out2[:, 4:], out[:, 4:], rtol=0, atol=0)
    assert not torch.allclose(out2[:, :4], out[:, :4])


@pytest.mark.parametrize("ham", HAMS)
def test_samples_are_independent_with_a_fixed_dictionary(ham):
    m = Hamburger(8, ham=ham, rank=3, rand_init=False).double().eval()
    z = torch.randn(3, 8, 4, 5, dtype=torch.float64)
    full = m(z)
    for i in range(3):
        torch.testing.assert_close(m(z[i:i + 1]), full[i:i + 1], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("ham", HAMS)
def test_train_and_eval_step_counts(ham, monkeypatch):
    calls = []
    name = f"_{ham}_step"
    original = getattr(dec, name)

    def counting(*args):
        calls.append(1)
        return original(*args)

    monkeypatch.setattr(dec, name, counting)
    m = Hamburger(8, ham=ham, rank=3, train_steps=4, eval_steps=9)
    z = torch.randn(2, 8, 3, 3)
    m.train()(z)
    assert len(calls) == 4
    calls.clear()
    m.eval()(z)
    assert len(calls) == 9
    calls.clear()
    Hamburger(8, ham=ham, rank=3).train()(z)
    assert len(calls) == 6  # defaults: 6 in training, 7 in eval
    calls.clear()
    Hamburger(8, ham=ham, rank=3).eval()(z)
    assert len(calls) == 7


@pytest.mark.parametrize("ham", HAMS)
@pytest.mark.parametrize("grad", ["one_step", "bptt"])
def test_gradients_reach_the_breads(ham, grad):
    torch.manual_seed(0)
    m = Hamburger(8, ham=ham, rank=3, grad=grad)
    z = torch.randn(2, 8, 5, 5, requires_grad=True)
    (m(z) * torch.randn(2, 8, 5, 5)).sum().backward()
    for p in (m.lower_bread.weight, m.upper_bread.weight, z):
        assert torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ham", HAMS)
def test_module_under_autocast_is_finite(dtype, ham):
    torch.manual_seed(0)
    m = Hamburger(64, ham=ham, rank=8)
    z = 4 + torch.rand(1, 64, 16, 16)  # activations near 4
    with torch.autocast("cpu", dtype=dtype):
        y = m(z)
        y.float().sum().backward()
    assert y.dtype == torch.float32 and torch.isfinite(y).all()
    assert torch.isfinite(m.lower_bread.weight.grad).all()


# ---------------------------------------------------------------------------------------------
# the persistent dictionary


@pytest.mark.parametrize("ham", HAMS)
def test_online_update_moves_the_dictionary_by_eta(ham):
    ham_module = MatrixDecomposition(8, ham=ham, groups=2, rank=3, rand_init=False, eta=0.7).double()
    x = torch.randn(5, 8, 12, dtype=torch.float64).abs()
    old = ham_module.bases.clone()
    bases, _ = ham_module.train()(x, return_factors=True)
    target = bases.view(5, 2, 4, 3).mean(0)
    expected = F.normalize(old + 0.7 * (target - old), dim=1)
    torch.testing.assert_close(ham_module.bases, expected)
    torch.testing.assert_close(ham_module.bases.norm(dim=1), torch.ones(2, 3, dtype=torch.float64))
    if ham == "nmf":
        assert (ham_module.bases >= 0).all()
    frozen = ham_module.bases.clone()
    ham_module.eval()(x)  # eval never updates
    assert torch.equal(ham_module.bases, frozen)
    ham_module.update_dictionary = False
    ham_module.train()(x)
    assert torch.equal(ham_module.bases, frozen)


def test_persistent_dictionary_survives_state_dict_round_trip():
    torch.manual_seed(0)
    m = Hamburger(8, ham="cd", rank=3, rand_init=False)
    m.train()(torch.randn(4, 8, 5, 5))  # update the dictionary once
    state = m.state_dict()
    assert "ham.bases" in state
    torch.manual_seed(1)
    other = Hamburger(8, ham="cd", rank=3, rand_init=False)
    assert not torch.equal(other.ham.bases, m.ham.bases)
    other.load_state_dict(state)
    assert torch.equal(other.ham.bases, m.ham.bases)
    z = torch.randn(2, 8, 4, 4)
    m.eval(), other.eval()
    torch.testing.assert_close(other(z), m(z), rtol=0, atol=0)  # eval is deterministic
    assert "ham.bases" not in Hamburger(8, rank=3).state_dict()


# ---------------------------------------------------------------------------------------------
# the registered 1-D token mixer


def test_registered_as_a_mixer():
    info = {m.name: m for m in subquad.list_methods()}["hamburger"]
    assert info.kind == "mixer" and info.module is HamburgerMixer and info.op is None
    assert (info.causal, info.key_padding, info.cross_attention) == (False, True, False)
    assert info.complexity == "linear" and info.stochastic and info.learned_parameters
    mixer = info.module(32, 4, **info.option_defaults())
    assert mixer(torch.randn(2, 5, 32)).shape == (2, 5, 32)
    signature = inspect.signature(HamburgerMixer.__init__).parameters
    for f in dataclasses.fields(HamburgerOptions):
        assert signature[f.name].default == f.default, f.name
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="token mixer"):
        subquad.attention(q, q, q, method="hamburger")
    with pytest.raises(ValueError, match="token mixer"):
        subquad.MultiheadAttention(32, 4, method="hamburger")


def test_mixer_options_are_validated():
    with pytest.raises(ValueError, match="ham"):
        HamburgerMixer(16, 2, ham="pca")
    with pytest.raises(ValueError, match="rank"):
        HamburgerMixer(16, 2, rank=0)
    with pytest.raises(ValueError, match="divisible"):
        HamburgerMixer(16, 3)
    with pytest.raises(TypeError):
        HamburgerMixer(16, 2, num_landmarks=4)
    with pytest.raises(ValueError, match="unknown option"):
        subquad.get_method("hamburger").make_options(num_landmarks=4)
    m = HamburgerMixer(16, 2)
    with pytest.raises(ValueError, match=r"\(B, N, 16\)"):
        m(torch.randn(2, 5, 8))
    with pytest.raises(ValueError, match="key_padding_mask"):
        m(torch.randn(2, 5, 16), torch.zeros(2, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="bool or float"):
        m(torch.randn(2, 5, 16), torch.zeros(2, 5, dtype=torch.long))
    assert HamburgerMixer(512, 8).ham.rank == 8 and HamburgerMixer(512, 1).ham.rank == 64


@pytest.mark.parametrize("ham", HAMS)
@pytest.mark.parametrize("heads", [1, 2, 4])
def test_mixer_shapes(ham, heads):
    m = HamburgerMixer(32, heads, ham=ham)
    for n in (1, 11):
        x = torch.randn(3, n, 32)
        y = m(x)
        assert y.shape == x.shape and torch.isfinite(y).all()


@pytest.mark.parametrize("ham", HAMS)
def test_mixer_padding_invariance(ham):
    torch.manual_seed(0)
    m = HamburgerMixer(16, 2, ham=ham, rank=3).double()
    lengths = torch.tensor([9, 4, 0])
    mask = torch.arange(9)[None, :] >= lengths[:, None]
    x = torch.randn(3, 9, 16, dtype=torch.float64)
    noisy = torch.where(mask[:, :, None], 100 * torch.randn_like(x), x)
    y = m(x, mask, generator=_gen())
    y_noisy = m(noisy, mask, generator=_gen())
    torch.testing.assert_close(y_noisy, y, rtol=0, atol=0)
    assert torch.isfinite(y).all() and (y[mask] == 0).all()  # padded (and fully padded) rows
    float_mask = torch.zeros(3, 9, dtype=torch.float64).masked_fill(mask, float("-inf"))
    torch.testing.assert_close(m(x, float_mask, generator=_gen()), y, rtol=0, atol=0)
    # with a fixed dictionary in eval, a padded sample equals its unpadded prefix alone
    fixed = HamburgerMixer(16, 2, ham=ham, rank=3, rand_init=False).double().eval()
    y_fixed = fixed(x, mask)
    torch.testing.assert_close(fixed(x[1:2, :4]), y_fixed[1:2, :4], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("ham", HAMS)
def test_mixer_gradients_skip_padding(ham):
    torch.manual_seed(0)
    m = HamburgerMixer(16, 2, ham=ham, rank=3)
    x = torch.randn(2, 7, 16, requires_grad=True)
    mask = torch.zeros(2, 7, dtype=torch.bool)
    mask[1, 5:] = True
    (m(x, mask) * torch.randn(2, 7, 16)).sum().backward()
    assert torch.isfinite(x.grad).all() and (x.grad[mask] == 0).all() and x.grad[~mask].abs().sum() > 0
    for p in m.parameters():
        assert torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0


@pytest.mark.parametrize("ham", HAMS)
def test_mixer_bf16_autocast_is_finite(ham):
    m = HamburgerMixer(32, 2, ham=ham)
    x = 4 * torch.randn(2, 50, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x)
    assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()


@pytest.mark.slow
def test_mixer_long_sequence_forward_backward():
    """N = 131072: nothing of size N x N (64 GiB in float32) may be formed."""
    m = HamburgerMixer(32, 1)
    x = torch.randn(1, 131072, 32, requires_grad=True)
    y = m(x)
    y.sum().backward()
    assert y.shape == x.shape and torch.isfinite(y).all() and torch.isfinite(x.grad).all()
