"""Helpers of the RA and LARA op tests (``test_ra.py``, ``test_lara.py``): seeded inputs, and the
estimator invariants both must keep (:func:`check_invariants`: outputs are convex
combinations of the real values, padded positions never change real outputs, low-precision
inputs)."""

from __future__ import annotations

import torch

from conftest import qkv, right_padding

F64 = torch.float64


def make_qkv(b=2, h=2, n=7, m=None, d=6, dv=None, seed=0, qk_scale=1.0):
    """Seeded float64 q ``(b, h, n, d)``, k ``(b, h, m, d)``, v ``(b, h, m, dv)``."""
    q, k, v = qkv(b, h, n, d, m=m, dv=dv, seed=seed)
    return qk_scale * q, qk_scale * k, v


def gen(seed=1):
    return torch.Generator().manual_seed(seed)


def mean_abs_error(out, exact):
    return (out - exact).abs().mean().item()


def assert_unbiased_convergence(errors, final_bound):
    """``errors`` at 16x more samples each: an unbiased estimator's error goes like S^{-1/2}, so
    every step should cut it by about 4x (at least 2x here), down to ``final_bound``."""
    assert errors[1] < 0.5 * errors[0] and errors[2] < 0.5 * errors[1], errors
    assert errors[2] < final_bound, errors


def assert_convex_combinations_of_values(op, opts):
    """Every output row lies in the box of the real value rows."""
    q, k, v = make_qkv(n=9, m=11, qk_scale=1.5)
    mask = right_padding(2, 11, [0, 4])
    out = op(q, k, v, key_padding_mask=mask, generator=gen(), **opts)
    real_v = v.masked_fill(mask[:, None, :, None], float("nan"))
    lo = real_v.nan_to_num(float("inf")).amin(-2, keepdim=True)
    hi = real_v.nan_to_num(float("-inf")).amax(-2, keepdim=True)
    assert torch.all(out >= lo - 1e-12) and torch.all(out <= hi + 1e-12)


def assert_padded_positions_never_change_real_outputs(op, opts, n, m):
    """New content at padded positions (keys, values and, in self-attention, queries) leaves every
    real output as it was; a batch row without a real key outputs 0."""
    q, k, v = make_qkv(b=3, n=n, m=m)
    mask = right_padding(3, m, [0, 3, m])  # the last batch row has no real key
    out = op(q, k, v, key_padding_mask=mask, generator=gen(), **opts)
    pad = mask[:, None, :, None]
    k2 = torch.where(pad, 7.0 * torch.randn_like(k), k)
    v2 = torch.where(pad, 7.0 * torch.randn_like(v), v)
    q2 = torch.where(pad, 7.0 * torch.randn_like(q), q) if n == m else q
    out2 = op(q2, k2, v2, key_padding_mask=mask, generator=gen(), **opts)
    real_q = ~mask if n == m else torch.ones(3, n, dtype=torch.bool)
    sel = real_q[:, None, :, None].expand_as(out)
    torch.testing.assert_close(out[sel], out2[sel], rtol=0, atol=1e-12)
    assert torch.isfinite(out).all()
    assert torch.all(out[2] == 0)  # no real key: output 0


def assert_low_precision_inputs(op, opts, deterministic):
    """bf16 in, bf16 out, finite (math in float32); a ``deterministic`` mode agrees with float64."""
    q, k, v = make_qkv(n=8)
    out = op(q.bfloat16(), k.bfloat16(), v.bfloat16(), generator=gen(), **opts)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = op(q.float(), k.float(), v.float(), generator=gen(), **opts)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    if deterministic:
        ref = op(q, k, v, **opts)
        torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-5)


def check_invariants(op, opts, *, deterministic):
    """All of the above for ``op`` with ``opts``: self- and cross-attention padding, and the
    float64 agreement of low-precision inputs when the mode is ``deterministic``."""
    assert_convex_combinations_of_values(op, opts)
    for n, m in [(8, 8), (6, 10)]:
        assert_padded_positions_never_change_real_outputs(op, opts, n, m)
    assert_low_precision_inputs(op, opts, deterministic)
