"""FLOP formulas of subquad.compare.flops against torch.utils.flop_counter on small shapes."""

import math

import pytest
import torch

import subquad
from subquad.compare.flops import bounded_matmul_rate, counted_flops, forward_flops, matmul_rate
from subquad.compare.workload import full_options

# option sets that take each method down its other code paths (defaults first)
VARIANTS = {
    "softmax": [{}],
    "linear": [{}],
    "efficient": [{}],
    "performer": [{}, {"num_features": 40}],
    "nystrom": [{}, {"num_landmarks": 8}, {"num_landmarks": 8, "pinv_iterations": 2}],
    "ra": [{}, {"num_samples": 3}, {"estimator": "mixture_mean"}],
    "lara": [{}, {"num_landmarks": 8}, {"num_landmarks": 8, "mis": "bh"},
             {"num_landmarks": 8, "training": True, "num_samples": 2, "antithetic": True}],
    "sinkhorn": [{}, {"block_size": 16}, {"block_size": 16, "top_blocks": 2},
                 {"block_size": 16, "sortcut_blocks": 2}],
    "hedgehog": [{}, {"window": 8, "sinks": 1}, {"window": 5, "feature_dim": 12}],
    "hybrid": [{}, {"query_block": 8, "key_block": 4, "num_blocks": 3},
                     {"query_block": 4, "key_block": 8, "num_blocks": 2, "score": "mean"}],
}
# (B, H, N, D, Dv): N a multiple of the block and landmark counts, and not
SHAPES = [(2, 3, 40, 8, 8), (1, 2, 96, 16, 16), (1, 2, 130, 16, 12)]



def _case_id(name, opts, shape):
    return f"{name}-{'-'.join(f'{k}={v}' for k, v in opts.items()) or 'default'}-N{shape[2]}"


CASES = [
    pytest.param(name, opts, shape, id=_case_id(name, opts, shape))
    for name in [m.name for m in subquad.list_methods() if m.flops is not None]
    for opts in VARIANTS.get(name, [{}])
    for shape in SHAPES
]


@pytest.mark.parametrize("name, options, shape", CASES)
def test_formula_matches_counted_flops(name, options, shape):
    info = subquad.get_method(name)
    B, H, N, D, Dv = shape
    if name == "sinkhorn" and Dv != D:
        Dv = D  # self-attention only; value dim as the keys'
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(B, H, N, D, generator=g) for _ in range(2))
    v = torch.randn(B, H, N, Dv, generator=g)
    call_opts = dict(options)
    if "generator" in info.option_defaults():
        call_opts["generator"] = torch.Generator().manual_seed(1)
    counted = counted_flops(lambda: info.op(q, k, v, **call_opts))
    formula = forward_flops(name, B, H, N, N, D, Dv, full_options(info, options))
    assert counted > 0
    assert formula == counted


def test_nystrom_formula_falls_back_to_exact_when_landmarks_cover_the_sequence():
    info = subquad.get_method("nystrom")
    opts = full_options(info, {"num_landmarks": 64})
    exact = forward_flops("softmax", 1, 2, 32, 32, 8, 8, {})
    assert forward_flops("nystrom", 1, 2, 32, 32, 8, 8, opts) == exact


def test_softmax_formula_is_quadratic_and_linear_formula_is_linear():
    soft = [forward_flops("softmax", 1, 8, n, n, 64, 64, {}) for n in (1024, 2048)]
    lin = [forward_flops("linear", 1, 8, n, n, 64, 64, {"chunk_size": 64}) for n in (1024, 2048)]
    assert soft[1] == 4 * soft[0]
    assert lin[1] == 2 * lin[0]


def test_unknown_method_has_no_formula():
    assert forward_flops("no-such-method", 1, 1, 8, 8, 4, 4, {}) is None


def test_counted_flops_sees_fused_attention():
    q = torch.randn(1, 2, 16, 8)
    counted = counted_flops(lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q))
    assert counted == 2 * 2 * 16 * 16 * (8 + 8)


def test_matmul_rate_is_positive():
    rate = matmul_rate("cpu", size=64, min_run_time=0.01)
    assert math.isfinite(rate) and rate > 0


def test_bounded_matmul_rate_fits_its_time():
    """The roof's product grows from 256 only while the measurement still fits: a tiny budget
    leaves it unmeasured, a small one stops below 2048, and it never runs far past its budget."""
    none = bounded_matmul_rate("cpu", torch.float32, max_seconds=1e-9, min_run_time=0.0)
    assert none.rate is None and none.size == 256 and list(none.probes) == [256]
    small = bounded_matmul_rate("cpu", torch.float16, max_seconds=0.5, min_run_time=0.01)
    assert small.size < 2048 and small.seconds < 5.0
    assert small.rate is None or (math.isfinite(small.rate) and small.rate > 0)
    top = bounded_matmul_rate("cpu", torch.float32, max_seconds=60.0, size=128, min_run_time=0.01)
    assert top.size == 128 and top.rate > 0
