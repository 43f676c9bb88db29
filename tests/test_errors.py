"""User mistakes get a clear ValueError/TypeError that names the argument and the method.

Input checks run in the registry's wrapper, so they are swept over every attention method;
option ranges are checked per built-in method."""

from __future__ import annotations

import pytest
import torch

import subquad
from conftest import ATTENTION_METHODS, CAUSAL_METHODS, method_options, qkv


def call(name, q, k, v, **kwargs):
    """``name``'s op with the generic test options plus ``kwargs``. Any ValueError/TypeError it
    raises must name the method (the test then matches the rest of the message)."""
    opts = method_options(name, q.shape[-1], q.dtype)
    opts.update(kwargs)
    try:
        return subquad.attention(q, k, v, method=name, **opts)
    except (ValueError, TypeError, NotImplementedError) as err:
        assert name in str(err), f"the error does not name the method {name!r}: {err}"
        raise


@pytest.fixture(params=ATTENTION_METHODS)
def name(request):
    return request.param


# --------------------------------------------------------------------------- tensors


@pytest.mark.parametrize("arg", ["q", "k", "v"])
def test_wrong_ndim(name, arg):
    t = dict(zip("qkv", qkv(2, 2, 6, 8)))
    t[arg] = t[arg][0]
    with pytest.raises(ValueError, match=rf"{arg} must have 4 dimensions .*got shape \(2, 6, 8\)"):
        call(name, t["q"], t["k"], t["v"])


def test_not_a_tensor(name):
    q, k, v = qkv(1, 2, 6, 8)
    with pytest.raises(TypeError, match="k must be a torch.Tensor, got list"):
        call(name, q, k.tolist(), v)


def test_mismatched_batch(name):
    q, k, v = qkv(2, 2, 6, 8)
    with pytest.raises(ValueError, match="batch sizes differ: q 2, k 1, v 2"):
        call(name, q, k[:1], v)


def test_mismatched_heads(name):
    q, k, v = qkv(2, 2, 6, 8)
    with pytest.raises(ValueError, match="head counts differ: q 2, k 2, v 1"):
        call(name, q, k, v[:, :1])


def test_mismatched_head_dim(name):
    q, k, v = qkv(2, 2, 6, 8)
    with pytest.raises(ValueError, match="q and k must share the head dim, got 8 and 7"):
        call(name, q, k[..., :7], v)


def test_mismatched_key_value_lengths(name):
    q, k, v = qkv(2, 2, 6, 8)
    with pytest.raises(ValueError, match="k and v must have the same length, got 6 and 5"):
        call(name, q, k, v[:, :, :5])


def test_empty_sequence(name):
    q, k, v = qkv(2, 2, 6, 8)
    with pytest.raises(ValueError, match="sequence lengths must be at least 1"):
        call(name, q[:, :, :0], k[:, :, :0], v[:, :, :0])


@pytest.mark.parametrize("arg", ["q", "k", "v"])
def test_non_float_tensor(name, arg):
    t = dict(zip("qkv", qkv(1, 2, 6, 8)))
    t[arg] = t[arg].long()
    with pytest.raises(TypeError, match=rf"{arg} must be a floating-point tensor, got torch.int64"):
        call(name, t["q"], t["k"], t["v"])


def test_mixed_dtypes(name):
    q, k, v = qkv(1, 2, 6, 8)
    with pytest.raises(TypeError, match="q, k, v must share one dtype"):
        call(name, q, k.float(), v)


# --------------------------------------------------------------------------- mask


def test_mask_wrong_shape(name):
    q, k, v = qkv(2, 2, 6, 8)
    for bad in (torch.zeros(2, 5, dtype=torch.bool), torch.zeros(1, 6, dtype=torch.bool),
                torch.zeros(2, 1, 6, dtype=torch.bool)):
        with pytest.raises(ValueError, match=r"key_padding_mask must have shape \(B, M\) = \(2, 6\)"):
            call(name, q, k, v, key_padding_mask=bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.uint8])
def test_mask_wrong_dtype(name, dtype):
    """Only bool masks (True = padding): a float additive mask is a TypeError, never read as
    weights or as a bool with the opposite meaning."""
    q, k, v = qkv(2, 2, 6, 8)
    with pytest.raises(TypeError, match=rf"key_padding_mask must have dtype torch.bool.*got {dtype}"):
        call(name, q, k, v, key_padding_mask=torch.zeros(2, 6, dtype=dtype))


def test_mask_not_a_tensor(name):
    q, k, v = qkv(2, 2, 6, 8)
    with pytest.raises(TypeError, match="key_padding_mask must be a bool tensor, got list"):
        call(name, q, k, v, key_padding_mask=[[False] * 6] * 2)


# --------------------------------------------------------------------------- scale and causal


@pytest.mark.parametrize("scale", [0.0, -1.0, float("inf"), float("-inf"), float("nan"), "0.5", True, [0.5]])
def test_bad_scale(name, scale):
    """A logit scale must be a positive finite real: inf or nan would turn finite inputs into NaN."""
    q, k, v = qkv(1, 2, 6, 8)
    with pytest.raises(ValueError, match=r"scale must be a positive finite number, got"):
        call(name, q, k, v, scale=scale)


@pytest.mark.parametrize("which", ["qk", "v"])
def test_zero_head_dim(name, which):
    """Head dim 0 (of q and k, or of v) is a ValueError naming the dims, not a ZeroDivisionError."""
    q, k, v = qkv(2, 2, 6, 8)
    if which == "qk":
        q, k = q[..., :0], k[..., :0]
    else:
        v = v[..., :0]
    with pytest.raises(ValueError, match=r"head dims must be at least 1, got D=\d+ \(q, k\) and Dv=\d+"):
        call(name, q, k, v)


@pytest.mark.parametrize("causal", [1, "yes", None, torch.tensor(True)], ids=["int", "str", "none", "tensor"])
def test_causal_must_be_bool(name, causal):
    q, k, v = qkv(1, 2, 6, 8)
    with pytest.raises(TypeError, match="causal must be a bool"):
        call(name, q, k, v, causal=causal)


@pytest.mark.parametrize("method", ["linear", "efficient"])
def test_scale_refused_without_logit_scale(method):
    q, k, v = qkv(1, 2, 6, 8)
    with pytest.raises(ValueError, match=f"{method}: this method has no logit scale; pass scale=None"):
        subquad.attention(q, k, v, method=method, scale=0.5)


@pytest.mark.parametrize("method", CAUSAL_METHODS)
def test_causal_needs_equal_lengths(method):
    q, k, v = qkv(1, 2, 6, 8, m=9)
    if not subquad.get_method(method).cross_attention:
        match = "self-attention only"
    else:
        match = "causal=True needs equal query and key lengths, got N=6, M=9"
    with pytest.raises(ValueError, match=match):
        call(method, q, k, v, causal=True)


# --------------------------------------------------------------------------- options


def _bad(method, options, error, message, *, at_construction=True):
    return pytest.param(
        method, options, error, message, at_construction, id=f"{method}-{'-'.join(options)}"
    )


BAD_OPTIONS = [
    _bad("softmax", {"dropout_p": 1.0}, ValueError, r"softmax: dropout_p must be < 1, got 1.0"),
    _bad("softmax", {"dropout_p": -0.1}, ValueError, r"softmax: dropout_p must be >= 0.0, got -0.1"),
    _bad("softmax", {"dropout_p": "0.1"}, TypeError, r"softmax: dropout_p must be a number"),
    _bad("linear", {"chunk_size": 0}, ValueError, r"linear: chunk_size must be >= 1, got 0"),
    _bad("linear", {"chunk_size": 2.5}, TypeError, r"linear: chunk_size must be an int"),
    _bad("efficient", {"chunk_size": 4}, ValueError, r"efficient.*unknown option.*valid options are none"),
    _bad("performer", {"num_features": 0}, ValueError, r"performer: num_features must be >= 1, got 0"),
    _bad("performer", {"num_features": True}, TypeError, r"performer: num_features must be an int"),
    _bad("performer", {"chunk_size": 0}, ValueError, r"performer: chunk_size must be >= 1, got 0"),
    _bad("performer", {"eps": -1e-6}, ValueError, r"performer: eps must be >= 0.0"),
    _bad("performer", {"orthogonal": 1}, TypeError, r"performer: orthogonal must be a bool"),
    _bad("performer", {"generator": 0}, TypeError, r"performer: generator must be a torch.Generator, got int"),
    _bad("performer", {"features": torch.randn(16)}, ValueError, r"performer: features must be a floating \(m, D\)"),
    _bad("performer", {"features": torch.ones(16, 8, dtype=torch.long)}, ValueError,
         r"performer: features must be a floating \(m, D\)"),
    # the head dim is known only at call time
    _bad("performer", {"features": torch.randn(16, 7)}, ValueError,
         r"performer: features must have shape \(m, 8\), got \(16, 7\)", at_construction=False),
    _bad("nystrom", {"num_landmarks": 0}, ValueError, r"nystrom: num_landmarks must be >= 1, got 0"),
    _bad("nystrom", {"num_landmarks": 4.0}, TypeError, r"nystrom: num_landmarks must be an int"),
    _bad("nystrom", {"pinv_iterations": -1}, ValueError, r"nystrom: pinv_iterations must be >= 0, got -1"),
    _bad("nystrom", {"pinv_init": "x"}, ValueError,
         r"nystrom: pinv_init must be one of \['per_matrix', 'global'\], got 'x'"),
    # non-finite numbers have no meaning as options: refused, never turned into NaN outputs
    _bad("softmax", {"dropout_p": float("nan")}, ValueError, r"softmax: dropout_p must be a finite number, got nan"),
    _bad("performer", {"eps": float("inf")}, ValueError, r"performer: eps must be a finite number, got inf"),
    _bad("lara", {"alpha_coeff": float("inf")}, ValueError, r"lara: alpha_coeff must be a finite number, got inf"),
    _bad("lara", {"alpha_coeff": float("nan")}, ValueError, r"lara: alpha_coeff must be a finite number, got nan"),
    _bad("sinkhorn", {"tau": float("inf")}, ValueError, r"sinkhorn: tau must be a finite number, got inf"),
    _bad("sinkhorn", {"tau": float("nan")}, ValueError, r"sinkhorn: tau must be a finite number, got nan"),
    _bad("sinkhorn", {"tau": 0.0}, ValueError, r"sinkhorn: tau must be > 0.0, got 0.0"),
    _bad("sinkhorn", {"block_size": 0}, ValueError, r"sinkhorn: block_size must be >= 1, got 0"),
    _bad("sinkhorn", {"sinkhorn_iters": 0}, ValueError, r"sinkhorn: sinkhorn_iters must be >= 1, got 0"),
    _bad("ra", {"num_samples": 0}, ValueError, r"ra: num_samples must be >= 1, got 0"),
    _bad("ra", {"estimator": "mean"}, ValueError, r"ra: estimator must be one of \['sample', 'mixture_mean'\]"),
    _bad("lara", {"num_landmarks": -1}, ValueError, r"lara: num_landmarks must be >= 1, got -1"),
    _bad("lara", {"mis": "x"}, ValueError, r"lara: mis must be one of \['opt', 'bh'\], got 'x'"),
]


@pytest.mark.parametrize("method, options, error, message, at_construction", BAD_OPTIONS)
def test_option_out_of_range(method, options, error, message, at_construction):
    q, k, v = qkv(1, 2, 12, 8)
    with pytest.raises(error, match=message):
        subquad.attention(q, k, v, method=method, **options)
    if at_construction:  # the options dataclass refuses it when built (modules validate at __init__)
        with pytest.raises(error, match=message):
            subquad.get_method(method).make_options(**options)
