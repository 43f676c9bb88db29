"""Properties every registered attention method must have, swept over the registry.

Capability flags (``causal``, ``cross_attention``, ``key_padding``, ``complexity``,
``stochastic``) select which tests apply; a method registered later is picked up with no change
here. Options come from :func:`conftest.method_options`.
"""

from __future__ import annotations

import pytest
import torch

import subquad
from subquad.ops.linear.state import KernelState
from conftest import (
    ATTENTION_METHODS,
    CAUSAL_METHODS,
    CROSS_METHODS,
    LINEAR_METHODS,
    NON_CAUSAL_METHODS,
    PADDING_METHODS,
    SELF_ONLY_METHODS,
    STOCHASTIC_METHODS,
    generic_options,
    long_options,
    method_options,
    qkv,
    run_method,
    sampling_options,
)

# Extra options for gradcheck only. Performer's feature stabilisers (the per-query and per-key
# maxima subtracted before exp) are detached: they cancel exactly in the normalised output only
# when eps = 0, so with the default eps = 1e-6 the analytic gradient is off by O(eps), which
# the non-causal path shows at this test's tolerance. MagicPIG holds its sampling probabilities u
# (a function of the angle between query and key) constant under autograd, so finite differences
# of q and k agree with its gradient only where u is 1: min_matches = 0 (tests/ops/test_magicpig.py
# checks its gradients on the sampling path against the reference's).
GRADCHECK_OPTIONS = {"performer": {"eps": 0.0}, "magicpig": {"min_matches": 0}}


def _info(name: str):
    return subquad.get_method(name)


def _skip_unless(name: str, *, causal: bool = False, cross: bool = False, padding: bool = False) -> None:
    info = _info(name)
    if causal and not info.causal:
        pytest.skip(f"{name} is not causal by construction")
    if cross and not info.cross_attention:
        pytest.skip(f"{name} is self-attention only")
    if padding and not info.key_padding:
        pytest.skip(f"{name} does not support key_padding_mask")


def _perturb(x: torch.Tensor, where: torch.Tensor, seed: int) -> torch.Tensor:
    """``x`` ``(B, H, L, d)`` with new random content at positions where ``where`` ``(B, L)``
    (or ``(L,)``) is True."""
    g = torch.Generator().manual_seed(seed)
    noise = 3.0 * torch.randn(x.shape, generator=g, dtype=x.dtype) + 1.0
    where = where if where.ndim == 2 else where.expand(x.shape[0], -1)
    return torch.where(where[:, None, :, None], noise, x)


def _rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative Frobenius error of ``a`` against ``b``, in float64."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _self_mask(n: int = 12) -> torch.Tensor:
    """Bool (4, n), True = padding: no padding; padding at the end; padding in the middle
    (enough to empty a whole segment of 3); fully padded."""
    mask = torch.zeros(4, n, dtype=torch.bool)
    mask[1, n - 3 :] = True
    mask[2, 3:7] = True
    mask[3] = True
    return mask


# --------------------------------------------------------------------------- shapes and dtypes


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("n", [1, 37, 64])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_output_shape_and_dtype(method, n, dtype, causal):
    """(B, H, N, D) x (B, H, N, Dv) -> (B, H, N, Dv) in the input dtype, finite, for Dv != D."""
    if causal:
        _skip_unless(method, causal=True)
    q, k, v = qkv(2, 3, n, 8, dv=5, dtype=dtype)
    out = run_method(method, q, k, v, causal=causal)
    assert out.shape == (2, 3, n, 5)
    assert out.dtype == dtype
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("n, m", [(1, 37), (37, 1), (7, 64), (64, 7)])
def test_cross_attention_shape(method, n, m):
    """Queries and keys of different lengths: (B, H, N, D), (B, H, M, D), (B, H, M, Dv)."""
    _skip_unless(method, cross=True)
    q, k, v = qkv(2, 3, n, 8, m=m, dv=5)
    out = run_method(method, q, k, v)
    assert out.shape == (2, 3, n, 5)
    assert out.dtype == q.dtype
    assert torch.isfinite(out).all()


def test_self_only_refuses_other_lengths(method):
    """A self-attention-only method refuses N != M with a ValueError."""
    if _info(method).cross_attention:
        pytest.skip(f"{method} supports cross-attention")
    q, k, v = qkv(1, 2, 7, 8, m=9)
    with pytest.raises(ValueError, match="self-attention only"):
        run_method(method, q, k, v)


# --------------------------------------------------------------------------- key padding


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_padding_invariance_self(method, causal):
    """Self-attention with a key padding mask (padding at the end, in the middle, a fully padded
    row): new q/k/v content at padded positions leaves every output at a real position
    unchanged; all outputs are finite; the fully padded row outputs zeros."""
    _skip_unless(method, padding=True, causal=causal)
    n = 12
    mask = _self_mask(n)
    q, k, v = qkv(4, 2, n, 8, dv=6)
    out = run_method(method, q, k, v, key_padding_mask=mask, causal=causal)
    assert torch.isfinite(out).all()
    assert torch.equal(out[3], torch.zeros_like(out[3]))

    q2, k2, v2 = _perturb(q, mask, 1), _perturb(k, mask, 2), _perturb(v, mask, 3)
    out2 = run_method(method, q2, k2, v2, key_padding_mask=mask, causal=causal)
    assert torch.isfinite(out2).all()
    real = ~mask[:, None, :, None].expand_as(out)
    torch.testing.assert_close(out2[real], out[real], rtol=0, atol=1e-12)
    assert torch.equal(out2[3], torch.zeros_like(out2[3]))


def test_padding_invariance_cross(method):
    """Cross-attention (M != N) with a key padding mask: new k/v content at padded keys leaves
    every output unchanged; a batch row whose keys are all padding outputs zeros."""
    _skip_unless(method, padding=True, cross=True)
    n, m = 7, 12
    mask = _self_mask(m)
    q, k, v = qkv(4, 2, n, 8, m=m, dv=6)
    out = run_method(method, q, k, v, key_padding_mask=mask)
    assert torch.isfinite(out).all()
    assert torch.equal(out[3], torch.zeros_like(out[3]))

    out2 = run_method(method, q, _perturb(k, mask, 2), _perturb(v, mask, 3), key_padding_mask=mask)
    torch.testing.assert_close(out2, out, rtol=0, atol=1e-12)


def _poison(x: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """``x`` ``(B, H, L, d)`` with NaN, +inf and -inf in turn at the positions where ``where``
    ``(B, L)`` is True (whole vectors and single entries)."""
    x = x.clone()
    rows, cols = where.nonzero(as_tuple=True)
    for i, (b, t) in enumerate(zip(rows.tolist(), cols.tolist())):
        value = (float("nan"), float("inf"), float("-inf"))[i % 3]
        if i % 2:
            x[b, :, t, i % x.shape[-1]] = value
        else:
            x[b, :, t] = value
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("length", [12, 300])
@pytest.mark.parametrize("shape", ["self", "causal", "cross"])
def test_padding_nonfinite_never_reaches_an_output(method, shape, length, dtype):
    """NaN and +-inf at padded key and value positions (padding at the end, in the middle, a whole
    row): every output at a real query is finite and what the clean inputs give, and the fully
    padded row outputs zeros. Padded content must be dropped (``torch.where``), not multiplied by 0
    (NaN * 0 = NaN). Two lengths: methods that fall back to exact attention on short inputs run
    their own path on the longer one."""
    causal, cross = shape == "causal", shape == "cross"
    _skip_unless(method, padding=True, causal=causal, cross=cross)
    n, m = (length * 7 // 12, length) if cross else (length, length)
    mask = _self_mask(m)
    q, k, v = qkv(4, 2, n, 8, m=m, dv=6, dtype=dtype)
    out = run_method(method, q, k, v, key_padding_mask=mask, causal=causal)
    bad = run_method(method, q, _poison(k, mask), _poison(v, mask), key_padding_mask=mask, causal=causal)
    real = slice(None) if cross else ~mask[:, None, :, None].expand_as(out)
    assert torch.isfinite(bad[real]).all()
    torch.testing.assert_close(bad[real], out[real], rtol=0, atol=1e-12 if dtype == torch.float64 else 1e-6)
    assert torch.equal(bad[3], torch.zeros_like(bad[3]))


def test_causal_queries_without_real_key_output_zero(method):
    """Causal attention with leading padding: a query whose visible keys (0..t) are all
    padding outputs exactly 0; every query that sees a real key outputs something non-zero."""
    _skip_unless(method, padding=True, causal=True)
    n = 10
    mask = torch.zeros(2, n, dtype=torch.bool)
    mask[0, :3] = True
    mask[1, [0, 4, 5]] = True
    q, k, v = qkv(2, 2, n, 8, dv=6)
    out = run_method(method, q, k, v, key_padding_mask=mask, causal=True)
    assert torch.isfinite(out).all()
    assert torch.equal(out[0, :, :3], torch.zeros_like(out[0, :, :3]))
    assert torch.equal(out[1, :, :1], torch.zeros_like(out[1, :, :1]))
    assert (out[0, :, 3:].abs().sum(-1) > 0).all()
    assert (out[1, :, 1:].abs().sum(-1) > 0).all()


def test_mask_refused_without_key_padding_support(method):
    """A method without key padding support refuses a mask instead of ignoring it."""
    if _info(method).key_padding:
        pytest.skip(f"{method} supports key_padding_mask")
    q, k, v = qkv(1, 2, 6, 8)
    with pytest.raises(NotImplementedError, match="key_padding_mask"):
        run_method(method, q, k, v, key_padding_mask=torch.zeros(1, 6, dtype=torch.bool))


# --------------------------------------------------------------------------- causality


def _causal_test_mask(n: int) -> torch.Tensor:
    """Bool (2, n), True = padding: scattered padded keys in row 0, leading ones in row 1 (whose
    first queries then see no real key)."""
    mask = torch.zeros(2, n, dtype=torch.bool)
    mask[0, [2, 3, 9]] = True
    mask[1, :2] = True
    return mask


@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
def test_causal_no_future_leak_outputs(method, masked):
    """For every t: new content at positions > t leaves outputs 0..t bit-for-bit unchanged
    (also with a key padding mask)."""
    _skip_unless(method, causal=True, padding=masked)
    n = 13
    q, k, v = qkv(2, 2, n, 8, dv=6)
    mask = _causal_test_mask(n) if masked else None
    out = run_method(method, q, k, v, key_padding_mask=mask, causal=True)
    for t in range(n):
        future = torch.arange(n) > t
        q2, k2, v2 = _perturb(q, future, 10 + t), _perturb(k, future, 100 + t), _perturb(v, future, 200 + t)
        out2 = run_method(method, q2, k2, v2, key_padding_mask=mask, causal=True)
        assert torch.equal(out2[:, :, : t + 1], out[:, :, : t + 1]), f"outputs up to t={t} changed"


@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
def test_causal_no_future_leak_gradients(method, masked):
    """For every t: the gradient of outputs 0..t w.r.t. q, k, v at positions > t is exactly 0."""
    _skip_unless(method, causal=True, padding=masked)
    n = 13
    q, k, v = qkv(2, 2, n, 8, dv=6, requires_grad=True)
    mask = _causal_test_mask(n) if masked else None
    out = run_method(method, q, k, v, key_padding_mask=mask, causal=True)
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=out.dtype)
    for t in range(n):
        loss = (out[:, :, : t + 1] * cotangent[:, :, : t + 1]).sum()
        grads = torch.autograd.grad(loss, (q, k, v), retain_graph=True, allow_unused=True)
        for arg, g in zip("qkv", grads):
            if g is None:
                continue
            assert torch.equal(g[:, :, t + 1 :], torch.zeros_like(g[:, :, t + 1 :])), (
                f"d outputs[:{t + 1}] / d {arg}[{t + 1}:] is not zero"
            )


def test_non_causal_methods_refuse_causal(method):
    """causal=True on a method that is not causal by construction raises NotImplementedError
    naming the methods that are."""
    if _info(method).causal:
        pytest.skip(f"{method} is causal")
    q, k, v = qkv(1, 2, 6, 8)
    with pytest.raises(NotImplementedError) as err:
        run_method(method, q, k, v, causal=True)
    message = str(err.value)
    assert method in message
    for name in CAUSAL_METHODS:
        assert repr(name) in message


# --------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("n", [5, 9])
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gradcheck(method, n, masked, causal):
    """float64 gradcheck on tiny shapes (B=1, H=2, D=4). The mask pads a middle key and the
    last key, so every query (causal or not) keeps at least one real key: at rows with none
    the output is a constant 0 and the check would be trivial."""
    _skip_unless(method, causal=causal, padding=masked)
    q, k, v = qkv(1, 2, n, 4, requires_grad=True)
    mask = None
    if masked:
        mask = torch.zeros(1, n, dtype=torch.bool)
        mask[0, [2, n - 1]] = True
    extra = GRADCHECK_OPTIONS.get(method, {})

    def fn(q, k, v):
        return run_method(method, q, k, v, key_padding_mask=mask, causal=causal, **extra)

    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-7, rtol=1e-5)


# --------------------------------------------------------------------------- low precision


MASK_KINDS = ["none", "padding", "causal", "causal-padding"]


def _mask_kind(method: str, kind: str, batch: int, n: int) -> dict:
    """``key_padding_mask`` and ``causal`` for a mask kind (skips what the method lacks). The
    padding empties part of the first sequence and the tail of the second."""
    causal = kind.startswith("causal")
    padded = kind.endswith("padding")
    _skip_unless(method, causal=causal, padding=padded)
    mask = None
    if padded:
        mask = torch.zeros(batch, n, dtype=torch.bool)
        mask[0, 10:15] = True
        mask[1 % batch, n - 7 :] = True
    return {"key_padding_mask": mask, "causal": causal}


@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=["f32", "f64", "bf16"])
def test_autocast(method, dtype, kind):
    """Under bf16 CPU autocast, for every input dtype and mask kind: no error, finite, the
    output dtype is the input's (float32 inputs may come back in bf16), and the result matches
    the same op without autocast on the same values in its compute dtype: float64 stays float64
    (autocast never touches it, 1e-10), float32 and bf16 within 2e-2 relative Frobenius error."""
    n = 37
    kw = _mask_kind(method, kind, 2, n)
    q, k, v = qkv(2, 2, n, 16, dtype=dtype)
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    reference = run_method(method, q.to(compute), k.to(compute), v.to(compute), **kw)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = run_method(method, q, k, v, **kw)
    if dtype == torch.float32:
        assert out.dtype in (torch.float32, torch.bfloat16)
    else:
        assert out.dtype == dtype
    assert out.shape == q.shape
    assert torch.isfinite(out).all()
    assert _rel_error(out, reference) < (1e-10 if dtype == torch.float64 else 2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=["f32", "f64", "bf16"])
def test_module_autocast(method, dtype):
    """``MultiheadAttention`` in every dtype under bf16 autocast with a key padding mask (eval,
    so stochastic methods use their eval mode): finite, in the module dtype or bf16. For
    sinkhorn also with ``mixture=True`` (exact attention added on the same inputs)."""
    variants = [{}] + ([{"mixture": True}] if method == "sinkhorn" else [])
    x = torch.randn(2, 37, 16, generator=torch.Generator().manual_seed(0)).to(dtype)
    pad = torch.zeros(2, 37, dtype=torch.bool)
    pad[1, 30:] = True
    for extra in variants:
        mha = subquad.MultiheadAttention(16, 2, method=method, batch_first=True, dtype=dtype,
                                         **_module_options(method), **extra).eval()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, _ = mha(x, x, x, key_padding_mask=pad, need_weights=False)
        assert out.dtype in (dtype, torch.bfloat16)
        assert out.shape == x.shape
        assert torch.isfinite(out).all()


# --------------------------------------------------------------------------- empty batches


def _module_options(method: str) -> dict:
    """The generic op options that a module takes too (no generator: modules draw their own)."""
    return generic_options(method)


@pytest.mark.parametrize("m", [7, 9], ids=["self", "cross"])
@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("batch, heads", [(0, 3), (2, 0)], ids=["B0", "H0"])
def test_empty_batch(method, batch, heads, kind, m):
    """B = 0 (or H = 0): the op returns the empty ``(B, H, N, Dv)`` output in the input dtype,
    and its backward gives empty gradients, with every mask kind."""
    if m != 7:
        _skip_unless(method, cross=True)
    if kind.startswith("causal") and m != 7:
        pytest.skip("causal needs equal lengths")
    kw = _mask_kind(method, kind, max(batch, 1), m)
    if kw["key_padding_mask"] is not None:
        kw["key_padding_mask"] = kw["key_padding_mask"][:batch]
    q, k, v = qkv(batch, heads, 7, 8, m=m, dv=5, requires_grad=True)
    out = run_method(method, q, k, v, **kw)
    assert out.shape == (batch, heads, 7, 5)
    assert out.dtype == q.dtype
    grads = torch.autograd.grad(out.sum(), (q, k, v), allow_unused=True)
    for t, g in zip((q, k, v), grads):
        assert g is None or g.shape == t.shape


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_module_empty_batch(method, training, batch_first):
    """``MultiheadAttention`` on an empty batch, in train and eval mode, with and without a
    key padding mask: the empty output of the right shape, and a backward that leaves every
    parameter with a zero gradient."""
    mha = subquad.MultiheadAttention(16, 2, method=method, batch_first=batch_first, **_module_options(method))
    mha.train(training)
    shape = (0, 9, 16) if batch_first else (9, 0, 16)
    for pad in (None, torch.zeros(0, 9, dtype=torch.bool)):
        x = torch.randn(shape, requires_grad=True)
        out, _ = mha(x, x, x, key_padding_mask=pad, need_weights=False)
        assert out.shape == shape
        mha.zero_grad()
        out.sum().backward()
        assert x.grad.shape == shape
        for name, p in mha.named_parameters():
            assert p.grad is None or not p.grad.any(), name


# --------------------------------------------------------------------------- grad modes


@pytest.fixture
def two_threads():
    """Two torch threads (the suite runs on one), so CPU paths that spread heads over worker
    threads (``subquad.ops._common.over_threads``) use them."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("masked", [False, True], ids=["plain", "masked"])
def test_two_threads_and_inference_mode(method, masked, two_threads):
    """With two threads the output matches the one-thread output; under
    ``torch.inference_mode()`` (thread-local, like grad mode: worker threads must run in the
    caller's mode) it equals the ``no_grad`` one and is an inference tensor."""
    q, k, v = qkv(4, 3, 37, 8, dtype=torch.float32)
    mask = None
    if masked:
        _skip_unless(method, padding=True)
        mask = _self_mask(37)  # (4, 37): none, at the end, in the middle, all padding
    with torch.no_grad():
        ref = run_method(method, q, k, v, key_padding_mask=mask)
        torch.set_num_threads(1)
        one = run_method(method, q, k, v, key_padding_mask=mask)
        torch.set_num_threads(2)
    with torch.inference_mode():
        out = run_method(method, q, k, v, key_padding_mask=mask)
    assert out.is_inference()
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(ref, one)


# --------------------------------------------------------------------------- randomness


def test_repeatable(method):
    """Two calls with the same options (and generator seed) give identical outputs."""
    q, k, v = qkv(2, 2, 11, 8)
    torch.testing.assert_close(run_method(method, q, k, v), run_method(method, q, k, v), rtol=0, atol=0)


@pytest.mark.parametrize("name", STOCHASTIC_METHODS)
def test_stochastic_generator(name):
    """A stochastic method takes ``generator``: same seed, same output; another seed, another
    output (under the entry's ``sampling_options``, for methods that sample only in some mode)."""
    assert "generator" in _info(name).option_defaults()
    q, k, v = qkv(2, 2, 11, 8)
    extra = sampling_options(name)
    a = run_method(name, q, k, v, seed=0, **extra)
    b = run_method(name, q, k, v, seed=0, **extra)
    c = run_method(name, q, k, v, seed=1, **extra)
    assert torch.equal(a, b)
    assert not torch.allclose(a, c, rtol=1e-3, atol=1e-6)


# --------------------------------------------------------------------------- complexity


@pytest.mark.slow
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", LINEAR_METHODS)
def test_long_sequence_linear_memory(name, causal):
    """Linear-complexity methods never form an N x M matrix: N = 131072 (B=1, H=1, D=32)
    forward and backward in float32, where one N x N matrix would be 64 GiB. Finite outputs
    and gradients."""
    _skip_unless(name, causal=causal)
    n = 131072
    q, k, v = qkv(1, 1, n, 32, dtype=torch.float32, requires_grad=True)
    out = subquad.attention(q, k, v, method=name, causal=causal, **long_options(name))
    assert out.shape == (1, 1, n, 32)
    assert torch.isfinite(out).all()
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad(out, (q, k, v), cotangent, allow_unused=True)
    del out, cotangent
    for arg, g in zip("qkv", grads):
        assert g is not None, f"no gradient for {arg}"
        assert torch.isfinite(g).all(), f"non-finite gradient for {arg}"


SEED_METHODS = {"softmax", "linear", "efficient", "performer", "nystrom", "ra", "lara", "sinkhorn", "hybrid"}


def test_method_lists_are_consistent():
    """The sweep covers every method of the seed papers (a method that stops registering, or
    registers under another kind, drops out of every generic test), the capability lists split
    it without overlap, and method_options builds valid options for each method."""
    assert SEED_METHODS <= set(ATTENTION_METHODS), SEED_METHODS - set(ATTENTION_METHODS)
    assert sorted(CAUSAL_METHODS + NON_CAUSAL_METHODS) == sorted(ATTENTION_METHODS)
    assert sorted(CROSS_METHODS + SELF_ONLY_METHODS) == sorted(ATTENTION_METHODS)
    assert "softmax" in CAUSAL_METHODS and "softmax" in CROSS_METHODS and "softmax" in PADDING_METHODS
    for name in ATTENTION_METHODS:
        _info(name).make_options(**method_options(name, 8, torch.float64))


@pytest.mark.parametrize("where", ["q", "k"])
def test_nan_input_gives_nan_output_not_an_error(method, where):
    """A NaN in the inputs reaches the output as NaN (as exact attention's does) and raises
    nothing: no method hides it, none fails inside a sampler on it."""
    q, k, v = qkv(1, 2, 37, 8, dtype=torch.float32)
    (q if where == "q" else k)[0, 1, 5, 3] = float("nan")
    out = run_method(method, q, k, v)
    assert out[0, 1].isnan().any()
    assert not out[0, 0].isnan().any()  # the other head is untouched


def test_registry_logit_scale_is_what_the_op_does(method):
    """``logit_scale=False`` in the entry exactly when the op refuses an explicit scale; ``exact``
    exactly when it is softmax attention to rounding."""
    info = subquad.get_method(method)
    q, k, v = qkv(1, 2, 37, 8)  # longer than the test options' budgets: no method falls back to exact
    if info.logit_scale:
        run_method(method, q, k, v, scale=0.5)
    else:
        with pytest.raises(ValueError, match="no logit scale"):
            run_method(method, q, k, v, scale=0.5)
    out = run_method(method, q, k, v)
    exact = subquad.attention(q, k, v, method="softmax")
    assert info.exact == bool(torch.allclose(out, exact, rtol=1e-9, atol=1e-9))


def test_registry_query_local_is_what_the_op_does(method):
    """``query_local``: a causal query's output does not move when the other queries change (what
    lets a decoder compute new queries alone against its cache)."""
    info = subquad.get_method(method)
    if not (info.causal and info.query_local):
        pytest.skip(f"{method} does not declare query_local")
    q, k, v = qkv(1, 2, 37, 8)
    other = q.clone()
    other[:, :, :30] = torch.randn_like(other[:, :, :30])
    a, b = run_method(method, q, k, v, causal=True), run_method(method, other, k, v, causal=True)
    torch.testing.assert_close(a[:, :, 30:], b[:, :, 30:], rtol=1e-10, atol=1e-10)


def test_registry_fixed_draw_makes_the_op_deterministic(method):
    """``fixed_draw``: with what it drew passed as options, two calls with different generators agree."""
    info = subquad.get_method(method)
    if info.fixed_draw is None:
        pytest.skip(f"{method} has no fixed_draw")
    q, k, v = qkv(1, 2, 37, 8)
    opts = generic_options(method, 8, q.dtype)
    drawn = info.fixed_draw(info.make_options(**opts), 8, torch.Generator().manual_seed(3))
    assert set(drawn) <= set(info.option_names)
    outs = [subquad.attention(q, k, v, method=method, generator=torch.Generator().manual_seed(s), **opts, **drawn)
            for s in (0, 1)]
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


def test_registry_kernel_features_decode_like_the_causal_op(method):
    """``kernel_features``: a :class:`KernelState` fed the features a few tokens at a time (a
    prefill, single tokens, a run of several; a padded batch row) gives the causal op's output;
    its memory does not grow with the tokens it has seen."""
    info = subquad.get_method(method)
    if info.kernel_features is None:
        pytest.skip(f"{method} has no kernel_features")
    q, k, v = qkv(2, 2, 37, 8)
    pad = torch.zeros(2, 37, dtype=torch.bool)
    pad[1, :5] = True
    opts = generic_options(method, 8, q.dtype)
    if info.fixed_draw is not None:
        opts.update(info.fixed_draw(info.make_options(**opts), 8, torch.Generator().manual_seed(3)))
    if info.learned_init is not None:  # learned tensors away from their initial values
        gen = torch.Generator().manual_seed(4)
        opts.update({name: t.double() + 0.3 * torch.randn(t.shape, generator=gen, dtype=torch.float64)
                     for name, t in info.learned_init(info.make_options(**opts), 2, 8).items()})
    o = info.make_options(**opts)
    want = subquad.attention(q, k, v, method=method, causal=True, key_padding_mask=pad, **opts)
    features = info.kernel_features(o)
    assert features is not None, f"{method}: no kernel form for its test options"
    state, got, sizes = KernelState(getattr(o, "chunk_size", 64)), [], []
    for a, b in [(0, 20), (20, 21), (21, 22), (22, 30), (30, 37)]:
        phi_q, phi_k = features(q[:, :, a:b], k[:, :, a:b], None)
        got.append(state.attend(phi_q, phi_k, v[:, :, a:b], pad[:, a:b]))
        sizes.append(state.nbytes())
    torch.testing.assert_close(torch.cat(got, 2), want, rtol=1e-10, atol=1e-10)
    assert state.seen == 37 and len(set(sizes)) == 1
