"""The Hamburger hams (NMF, soft VQ, concept decomposition) as ops on (B*S, D, N) matrices."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from subquad.ops import decomposition as dec
from subquad.ops.decomposition import cd, factorize, nmf, random_bases, vq
from subquad.ops.decomposition.naive import cd_reference, nmf_reference, vq_reference

HAMS = ["nmf", "vq", "cd"]
OPS = {"nmf": nmf, "vq": vq, "cd": cd}
REFERENCES = {"nmf": nmf_reference, "vq": vq_reference, "cd": cd_reference}
DISTRIBUTION = {"nmf": "uniform", "vq": "normal", "cd": "normal"}


def _x(ham, shape, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=dtype)
    return torch.relu(x) if ham == "nmf" else x


def _bases(ham, batch, dim, rank, seed=1, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return random_bases(batch, dim, rank, distribution=DISTRIBUTION[ham], generator=g, dtype=dtype)


def _rel_err(x, y):
    return ((x - y).norm() / x.norm()).item()


def _low_rank(d=512, n=4096, k=16, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(d, k, generator=g, dtype=dtype)
    h = torch.rand(k, n, generator=g, dtype=dtype)
    return (w @ h)[None]  # entries around k / 4 = 4


# ---------------------------------------------------------------------------------------------
# against the references, shapes, validation


@pytest.mark.parametrize("ham", HAMS)
@pytest.mark.parametrize("steps", [0, 1, 3])
def test_matches_reference(ham, steps):
    x = _x(ham, (3, 12, 17))
    b0 = _bases(ham, 3, 12, 5)
    out, bases, coef = OPS[ham](x, bases=b0, steps=steps, return_factors=True)
    ref_out, ref_bases, _ = REFERENCES[ham](x, b0, steps)
    torch.testing.assert_close(out, ref_out, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(bases, ref_bases, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(out, bases @ coef.transpose(1, 2), rtol=1e-12, atol=1e-12)
    assert out.shape == x.shape and bases.shape == (3, 12, 5) and coef.shape == (3, 17, 5)


@pytest.mark.parametrize("ham", HAMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_output_dtype_and_compute_dtype(ham, dtype):
    x = _x(ham, (2, 8, 10), dtype=torch.float32).to(dtype)
    out, bases, coef = OPS[ham](x, 3, return_factors=True)
    assert out.dtype == dtype and out.shape == x.shape
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    assert bases.dtype == compute and coef.dtype == compute


def test_input_validation():
    x = torch.rand(2, 8, 10)
    with pytest.raises(ValueError, match="3 dimensions"):
        nmf(x[0])
    with pytest.raises(TypeError, match="floating"):
        nmf(torch.ones(2, 8, 10, dtype=torch.long))
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        nmf([[1.0]])
    with pytest.raises(ValueError, match="bases must have shape"):
        nmf(x, bases=torch.rand(2, 7, 3))
    with pytest.raises(ValueError, match="rank=4"):
        nmf(x, 4, bases=torch.rand(2, 8, 3))
    with pytest.raises(ValueError, match="steps"):
        vq(x, steps=-1)
    with pytest.raises(TypeError, match="steps"):
        vq(x, steps=2.0)
    with pytest.raises(ValueError, match="grad"):
        cd(x, grad="full")
    with pytest.raises(ValueError, match="rank"):
        nmf(x, 0)
    with pytest.raises(ValueError, match="beta"):
        cd(x, beta=0.0)
    with pytest.raises(ValueError, match="inv_t"):
        vq(x, inv_t=-1.0)
    with pytest.raises(TypeError, match="key_padding_mask"):
        nmf(x, key_padding_mask=torch.zeros(2, 10))
    with pytest.raises(ValueError, match="key_padding_mask"):
        nmf(x, key_padding_mask=torch.zeros(1, 10, dtype=torch.bool))
    with pytest.raises(ValueError, match="ham"):
        factorize(x, "svd")
    # the rank comes from injected bases when not given
    assert nmf(x, bases=torch.rand(2, 8, 3), return_factors=True)[2].shape == (2, 10, 3)


@pytest.mark.parametrize("ham", HAMS)
def test_slices_are_independent(ham):
    """Samples and groups are separate slices: a slice's output depends on its own x and bases only."""
    x = _x(ham, (4, 10, 15))
    b0 = _bases(ham, 4, 10, 4)
    out = OPS[ham](x, bases=b0)
    x2 = x.clone()
    x2[2] = _x(ham, (10, 15), seed=5)
    out2 = OPS[ham](x2, bases=b0)
    keep = [0, 1, 3]
    torch.testing.assert_close(out2[keep], out[keep], rtol=0, atol=0)
    assert not torch.allclose(out2[2], out[2])
    torch.testing.assert_close(OPS[ham](x[1:3], bases=b0[1:3]), out[1:3], rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# NMF


def test_nmf_initial_coef_rows_sum_to_one():
    x = _x("nmf", (2, 16, 20))
    b0 = _bases("nmf", 2, 16, 6)
    _, _, coef = nmf_reference(x, b0, 0)
    torch.testing.assert_close(coef.sum(-1), torch.ones(2, 20, dtype=torch.float64))


def test_nmf_nonnegative_and_error_non_increasing_each_half_step():
    x = _x("nmf", (2, 40, 60))
    bases = _bases("nmf", 2, 40, 8)
    coef = torch.softmax(x.transpose(1, 2) @ bases, dim=-1)
    eps = 1e-6

    def err():
        return (x - bases @ coef.transpose(1, 2)).norm(dim=(1, 2))

    errors = [err()]
    with torch.no_grad():
        for _ in range(10):
            coef = dec._nmf_update_coef(x, bases, coef, eps)
            errors.append(err())
            bases = dec._nmf_update_bases(x, bases, coef, eps)
            errors.append(err())
            assert (coef >= 0).all() and (bases >= 0).all()
        coef = dec._nmf_update_coef(x, bases, coef, eps)  # the final, gradient-carrying step
        errors.append(err())
    errors = torch.stack(errors)  # (steps, slices)
    increase = errors[1:] - errors[:-1]
    assert (increase <= 1e-9 * errors[:-1]).all(), increase.max()
    assert (errors[-1] < 0.9 * errors[0]).all()
    out = nmf(x, bases=_bases("nmf", 2, 40, 8), steps=10)
    assert (out >= 0).all()


def test_nmf_recovers_low_rank_matrix():
    x = _low_rank()
    g = torch.Generator().manual_seed(3)
    err6 = _rel_err(x, nmf(x, 64, steps=6, generator=g))
    g = torch.Generator().manual_seed(3)
    err30 = _rel_err(x, nmf(x, 64, steps=30, generator=g))
    assert err6 < 0.1, err6
    assert err30 <= err6 + 1e-4, (err6, err30)


def test_nmf_zeros_stay_zero():
    x = _x("nmf", (1, 12, 20))
    x[0, :, 7] = 0.0  # an all-zero column of x
    b0 = _bases("nmf", 1, 12, 4)
    b0[0, 3, 1] = 0.0  # an exact zero in the bases
    out, bases, coef = nmf(x, bases=b0, steps=5, return_factors=True)
    assert bases[0, 3, 1] == 0.0
    assert (coef[0, 7] == 0).all() and (out[0, :, 7] == 0).all()
    _, bases_k, coef_k = nmf_reference(x, b0, 5)
    assert bases_k[0, 3, 1] == 0.0 and (coef_k[0, 7] == 0).all()


@pytest.mark.parametrize("ham", HAMS)
@pytest.mark.parametrize("grad", ["one_step", "bptt"])
def test_zero_input_gives_zero_output(ham, grad):
    x = torch.zeros(2, 8, 10, requires_grad=True)
    out = OPS[ham](x, 4, grad=grad)
    assert torch.isfinite(out).all() and (out == 0).all()
    out.sum().backward()
    assert torch.isfinite(x.grad).all()


# ---------------------------------------------------------------------------------------------
# VQ and CD


def test_vq_local_step_column_sums_and_convex_bases():
    x = _x("vq", (2, 16, 30))
    b0 = _bases("vq", 2, 16, 5)
    bases, coef = dec._vq_step(x, F.normalize(x, dim=1), b0, None, None, 100.0, 1e-6)
    assert (coef >= 0).all()
    torch.testing.assert_close(coef.sum(1), torch.ones(2, 5, dtype=torch.float64), rtol=0, atol=1e-5)
    torch.testing.assert_close(bases, x @ coef)  # weighted means of the raw columns
    _, coef_final = factorize(x, "vq", bases=b0, steps=3)
    torch.testing.assert_close(coef_final.sum(-1), torch.ones(2, 30, dtype=torch.float64))


def test_vq_assignments_approach_one_hot():
    x = _x("vq", (1, 32, 200))
    b0 = _bases("vq", 1, 32, 8)
    row_max = [factorize(x, "vq", bases=b0, inv_t=t)[1].amax(-1).mean().item() for t in (1.0, 10.0, 100.0, 1000.0)]
    assert row_max == sorted(row_max) and row_max[0] < 0.5 and row_max[-1] > 0.99, row_max


def test_cd_bases_unit_norm_after_every_step_and_ridge_equations():
    x = _x("cd", (2, 24, 40), dtype=torch.float32)
    b0 = _bases("cd", 2, 24, 6, dtype=torch.float32)
    for steps in range(1, 5):
        bases, coef = factorize(x, "cd", bases=b0, steps=steps, beta=0.1)
        torch.testing.assert_close(bases.norm(dim=1), torch.ones(2, 6), rtol=0, atol=1e-5)
        eye = torch.eye(6)
        lhs = x.transpose(1, 2) @ bases
        rhs = coef @ (bases.transpose(1, 2) @ bases + 0.1 * eye)
        assert ((lhs - rhs).norm() / lhs.norm()).item() < 1e-4


# ---------------------------------------------------------------------------------------------
# gradients


def _explicit_one_step(ham, x, bases, coef, inv_t, beta=0.1, eps=1e-6):
    """The gradient-carrying step of spec section 7 with detached factors."""
    if ham == "nmf":
        step = coef * (x.transpose(1, 2) @ bases) / (coef @ (bases.transpose(1, 2) @ bases) + eps)
        return bases @ step.transpose(1, 2)
    if ham == "vq":
        x_unit = x / (eps + x.norm(dim=1, keepdim=True).detach())
        step = torch.softmax(inv_t * x_unit.transpose(1, 2) @ F.normalize(bases, dim=1, eps=1e-6), dim=-1)
        return bases @ step.transpose(1, 2)
    eye = torch.eye(bases.shape[-1], dtype=x.dtype)
    return bases @ torch.linalg.inv(bases.transpose(1, 2) @ bases + beta * eye) @ bases.transpose(1, 2) @ x


@pytest.mark.parametrize("ham", HAMS)
def test_one_step_gradient_is_the_explicit_formula(ham):
    inv_t = 1.0 if ham == "nmf" else 10.0
    x = _x(ham, (2, 10, 14))
    b0 = _bases(ham, 2, 10, 4)
    upstream = torch.randn(2, 10, 14, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    _, bases_k, coef_k = REFERENCES[ham](x, b0, 4, inv_t=inv_t)

    xa = x.clone().requires_grad_(True)
    (OPS[ham](xa, bases=b0, steps=4, inv_t=inv_t) * upstream).sum().backward()
    xb = x.clone().requires_grad_(True)
    coef_k = None if coef_k is None else coef_k.detach()
    (_explicit_one_step(ham, xb, bases_k.detach(), coef_k, inv_t) * upstream).sum().backward()
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-8, atol=1e-10)

    xc = x.clone().requires_grad_(True)
    (OPS[ham](xc, bases=b0, steps=4, inv_t=inv_t, grad="bptt") * upstream).sum().backward()
    assert not torch.allclose(xc.grad, xa.grad, rtol=1e-3, atol=1e-6)  # bptt is a different gradient


def _saved_by_backward(ham, steps, grad):
    """Number and bytes of tensors autograd saves for backward, and the graph's node count."""
    count, nbytes = 0, 0

    def pack(t):
        nonlocal count, nbytes
        count += 1
        nbytes += t.numel() * t.element_size()
        return t

    x = _x(ham, (2, 16, 64), dtype=torch.float32).requires_grad_(True)
    b0 = _bases(ham, 2, 16, 4, dtype=torch.float32)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = OPS[ham](x, bases=b0, steps=steps, grad=grad)
    nodes, stack, seen = 0, [out.grad_fn], set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        nodes += 1
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    out.sum().backward()
    return count, nbytes, nodes


@pytest.mark.parametrize("ham", HAMS)
def test_backward_memory_does_not_grow_with_steps(ham):
    one = _saved_by_backward(ham, 1, "one_step")
    thirty = _saved_by_backward(ham, 30, "one_step")
    assert one == thirty, (one, thirty)
    bptt_one = _saved_by_backward(ham, 1, "bptt")
    bptt_thirty = _saved_by_backward(ham, 30, "bptt")
    assert bptt_thirty[1] > 10 * bptt_one[1] and bptt_thirty[2] > 10 * bptt_one[2]


@pytest.mark.parametrize("ham", HAMS)
def test_factors_carry_no_gradient_of_their_own(ham):
    x = _x(ham, (2, 8, 12), dtype=torch.float32).requires_grad_(True)
    bases, coef = factorize(x, ham, 3)
    assert not bases.requires_grad and coef.requires_grad
    bases_bptt, _ = factorize(x, ham, 3, grad="bptt")
    assert bases_bptt.requires_grad  # only through x: the initial bases are constants


# ---------------------------------------------------------------------------------------------
# randomness, padding, precision


@pytest.mark.parametrize("ham", HAMS)
def test_generator_makes_it_reproducible(ham):
    x = _x(ham, (2, 12, 20), dtype=torch.float32)
    a = OPS[ham](x, 4, generator=torch.Generator().manual_seed(0))
    b = OPS[ham](x, 4, generator=torch.Generator().manual_seed(0))
    c = OPS[ham](x, 4, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_different_seeds_both_recover_low_rank():
    x = _low_rank(d=128, n=512, k=4)
    outs = [nmf(x, 16, steps=30, generator=torch.Generator().manual_seed(s)) for s in (0, 1)]
    assert not torch.allclose(outs[0], outs[1])
    errors = [_rel_err(x, out) for out in outs]
    assert max(errors) < 0.1, errors


@pytest.mark.parametrize("ham", HAMS)
def test_padded_columns_do_not_influence_real_columns(ham):
    lengths = [15, 9, 1]
    x = _x(ham, (3, 10, 15))
    b0 = _bases(ham, 3, 10, 4)
    mask = torch.arange(15)[None, :] >= torch.tensor(lengths)[:, None]
    out = OPS[ham](x, bases=b0, key_padding_mask=mask)
    noisy = torch.where(mask[:, None, :], 1e3 * _x(ham, (3, 10, 15), seed=4).abs(), x)
    out_noisy = OPS[ham](noisy, bases=b0, key_padding_mask=mask)
    torch.testing.assert_close(out_noisy, out, rtol=0, atol=0)
    assert (out.masked_select(mask[:, None, :]) == 0).all()
    for i, n in enumerate(lengths):  # same as the decomposition of the real columns alone
        alone = OPS[ham](x[i:i + 1, :, :n], bases=b0[i:i + 1])
        torch.testing.assert_close(out[i:i + 1, :, :n], alone, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_autocast_stays_finite(dtype):
    """A 512 x 64 x 64 map with activations near 4: the coef carries the scale, and its Gram
    matrix would overflow float16; the ham computes in float32."""
    x32 = _low_rank(d=512, n=64 * 64, k=16)
    gen = torch.Generator().manual_seed(0)
    with torch.autocast("cpu", dtype=dtype):
        out, bases, coef = nmf(x32.to(dtype), 64, generator=gen, return_factors=True)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert bases.dtype == torch.float32
    gram = coef.transpose(1, 2) @ coef
    assert gram.max() > torch.finfo(torch.float16).max  # float16 iterations would overflow
    assert _rel_err(x32, out.float()) < 0.1


def test_float64_stays_float64():
    x = _x("cd", (1, 6, 9))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, bases, _ = cd(x, 3, return_factors=True)
    assert out.dtype == torch.float64 and bases.dtype == torch.float64
