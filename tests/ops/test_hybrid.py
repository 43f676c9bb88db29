"""Hybrid attention: the fast op against its plain definition (``naive.py``) in values and
gradients, over groupings, scorings, causal and cross lengths, padding, query groups and the
two-stage selection; masks, causality, the budget rule and exactness at full budget."""

from __future__ import annotations

import pytest
import torch

import subquad
import subquad.ops.hybrid as hybrid
from conftest import qkv
from subquad.ops.hybrid import HybridOptions, hybrid_attention, plan
from subquad.ops.hybrid.naive import hybrid_attention_naive
from subquad.ops.softmax.naive import softmax_attention_reference

SMALL = dict(budget=12, block_size=2, window=3, num_selected=2, num_summaries=2)

CASES = [
    # (N, M, causal, grouping, scoring, query_group, candidates)
    (13, 13, False, "tree", "second_order", 1, 256),
    (13, 13, False, "contiguous", "bounds", 1, 256),
    (13, 17, False, "tree", "mean", 1, 256),
    (16, 16, True, "contiguous", "second_order", 1, 256),
    (11, 11, True, "contiguous", "mean", 1, 256),
    (13, 13, False, "tree", "second_order", 3, 256),
    (9, 23, False, "contiguous", "second_order", 2, 256),
    # two stages: more leaves than candidates
    (29, 29, False, "tree", "second_order", 1, 3),
    (30, 30, True, "contiguous", "second_order", 1, 3),
    (29, 37, False, "contiguous", "bounds", 1, 4),
    (21, 40, False, "tree", "mean", 2, 2),
    (33, 33, True, "contiguous", "bounds", 1, 2),
    # two stages, several candidate nodes per block (16 candidates, nodes of 8 leaves)
    (40, 40, False, "tree", "second_order", 1, 16),
    (40, 40, True, "contiguous", "second_order", 1, 16),
    (37, 45, False, "contiguous", "bounds", 1, 16),
    (30, 41, False, "tree", "mean", 2, 16),
]


def _mask(m):
    mask = torch.zeros(2, m, dtype=torch.bool)
    mask[0, -3:] = True
    mask[1, 1:4] = True
    return mask


@pytest.fixture(params=[64, 4], ids=["block64", "block4"])
def query_block(request, monkeypatch):
    """Queries sharing candidates in two-stage selection: the default, and small enough that
    the tiny test lengths hold several blocks."""
    monkeypatch.setattr(hybrid, "QUERY_BLOCK", request.param)
    return request.param


def _assert_matches_naive(case, masked: bool):
    n, m, causal, grouping, scoring, group, candidates = case
    q, k, v = qkv(2, 2, n, 8, m=m, dv=5, seed=n + m)
    mask = _mask(m) if masked else None
    opts = dict(SMALL, grouping=grouping, scoring=scoring, query_group=group, candidates=candidates)
    out = hybrid_attention(q, k, v, key_padding_mask=mask, causal=causal, **opts)
    ref = hybrid_attention_naive(q, k, v, mask, causal, None, **opts)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("masked", [False, True])
def test_matches_naive(case, masked, query_block):
    _assert_matches_naive(case, masked)


@pytest.mark.parametrize("case", CASES[7:], ids=lambda c: "-".join(map(str, c)))
def test_chunked_first_stage_and_runs_match_naive(case, monkeypatch):
    """CHUNK_BYTES of 1: the first stage scores the nodes one query block at a time and every
    run holds one block, as at long N (where all queries at once would take O(N^1.5) memory)."""
    monkeypatch.setattr(hybrid, "QUERY_BLOCK", 4)
    monkeypatch.setattr(hybrid, "CHUNK_BYTES", 1)
    _assert_matches_naive(case, masked=True)


@pytest.mark.parametrize("case", [CASES[i] for i in (0, 3, 7, 8, 12)], ids=lambda c: "-".join(map(str, c)))
def test_torch_selection_path_matches_naive(case, monkeypatch):
    """The top-k and the tree's median splits without numpy (what runs on other devices, under
    torch.compile and under dispatch modes): the same estimator as the numpy path on CPU."""
    monkeypatch.setattr(hybrid, "QUERY_BLOCK", 4)
    monkeypatch.setattr(hybrid, "_numpy_path", lambda x: False)
    _assert_matches_naive(case, masked=True)


def test_largest_and_halves_agree_with_torch():
    """numpy's argpartition picks the same sets as torch.topk and a stable argsort's halves
    (ties at -inf/+inf aside, which are never real picks)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 40, generator=g)
    x[0, 0, :30] = -torch.inf
    for k in (0, 1, 7, 40):
        val, idx = hybrid._largest(x, k)
        ref = x.topk(k, dim=-1).values
        torch.testing.assert_close(val.sort(-1).values, ref.sort(-1).values)
        torch.testing.assert_close(x.gather(-1, idx), val)
    proj = torch.randn(4, 6, 16, generator=g)
    proj[1, 2, 5:] = torch.inf  # invalid slots
    halves = hybrid._halves(proj)
    assert torch.equal(halves.sort(-1).values, torch.arange(16).expand(4, 6, 16))
    lower = proj.gather(-1, halves[..., :8])
    upper = proj.gather(-1, halves[..., 8:])
    assert (lower.amax(-1) <= upper.amin(-1)).all()
    assert torch.equal(lower.sort(-1).values, proj.sort(-1).values[..., :8])


@pytest.mark.parametrize("candidates", [256, 4])
def test_large_leaves_match_naive(candidates, query_block):
    """Leaves of more than EXACT_VARIANCE keys: a leaf scores with its keys' exact logit
    variance, a first-stage node with the rank-2 part."""
    q, k, v = qkv(2, 2, 41, 8, m=45, dv=5, seed=7)
    opts = dict(budget=20, block_size=5, window=3, num_selected=2, num_summaries=2, candidates=candidates)
    out = hybrid_attention(q, k, v, key_padding_mask=_mask(45), **opts)
    torch.testing.assert_close(out, hybrid_attention_naive(q, k, v, _mask(45), False, None, **opts),
                               rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("case", [CASES[i] for i in (0, 3, 7, 9, 12, 13)], ids=lambda c: "-".join(map(str, c)))
def test_gradients_match_naive(case):
    n, m, causal, grouping, scoring, group, candidates = case
    q, k, v = qkv(1, 2, n, 8, m=m, dv=5, seed=3, requires_grad=True)
    mask = _mask(m)[:1]
    opts = dict(SMALL, grouping=grouping, scoring=scoring, query_group=group, candidates=candidates)
    w = torch.randn(1, 2, n, 5, dtype=torch.float64)
    fast = torch.autograd.grad((hybrid_attention(q, k, v, key_padding_mask=mask, causal=causal, **opts) * w).sum(),
                               (q, k, v))
    slow = torch.autograd.grad((hybrid_attention_naive(q, k, v, mask, causal, None, **opts) * w).sum(), (q, k, v))
    for a, b in zip(fast, slow):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


def test_gradcheck():
    q, k, v = qkv(1, 1, 9, 4, dv=3, seed=5, requires_grad=True)
    opts = dict(SMALL, grouping="tree")
    assert torch.autograd.gradcheck(lambda a, b, c: hybrid_attention(a, b, c, **opts), (q, k, v))


@pytest.mark.parametrize("causal", [False, True])
def test_full_budget_is_exact(causal):
    q, k, v = qkv(2, 2, 11, 8, seed=1)
    mask = _mask(11)
    out = hybrid_attention(q, k, v, key_padding_mask=mask, causal=causal, budget=11)
    torch.testing.assert_close(out, softmax_attention_reference(q, k, v, mask, causal=causal), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_no_summary_and_everything_selected_is_exact(causal):
    # every key in the window or a selected group: the estimator is exact attention
    q, k, v = qkv(1, 2, 12, 8, seed=2)
    out = hybrid_attention(q, k, v, causal=causal, budget=11, window=12, num_selected=0, num_summaries=1,
                           grouping="contiguous", block_size=4)
    torch.testing.assert_close(out, softmax_attention_reference(q, k, v, causal=causal), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("grouping", ["tree", "contiguous"])
def test_padded_keys_have_no_influence(grouping):
    q, k, v = qkv(2, 2, 15, 8, seed=4)
    mask = _mask(15)
    out = hybrid_attention(q, k, v, key_padding_mask=mask, grouping=grouping, **{**SMALL, "num_summaries": 2})
    k2, v2 = k.clone(), v.clone()
    k2[mask[:, None, :, None].expand_as(k)] = 1e3
    v2[mask[:, None, :, None].expand_as(v)] = -1e3
    out2 = hybrid_attention(q, k2, v2, key_padding_mask=mask, grouping=grouping, **SMALL)
    torch.testing.assert_close(out, out2, rtol=1e-12, atol=1e-12)


def test_fully_padded_row_is_zero():
    q, k, v = qkv(2, 1, 10, 8, seed=6)
    mask = torch.zeros(2, 10, dtype=torch.bool)
    mask[1] = True
    out = hybrid_attention(q, k, v, key_padding_mask=mask, **SMALL)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert out[0].abs().sum() > 0


@pytest.mark.parametrize("candidates", [256, 2])
def test_causal_reads_nothing_later(candidates, monkeypatch):
    monkeypatch.setattr(hybrid, "QUERY_BLOCK", 4)
    n, t = 40, 23
    q, k, v = qkv(1, 2, n, 8, seed=7)
    opts = dict(SMALL, candidates=candidates)
    out = hybrid_attention(q, k, v, causal=True, **opts)
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    for x in (q2, k2, v2):
        x[:, :, t + 1 :] = torch.randn_like(x[:, :, t + 1 :]) * 5
    out2 = hybrid_attention(q2, k2, v2, causal=True, **opts)
    torch.testing.assert_close(out[:, :, : t + 1], out2[:, :, : t + 1], rtol=0, atol=0)


def test_single_query_and_single_key():
    q, k, v = qkv(1, 1, 1, 8, m=1, seed=8)
    torch.testing.assert_close(hybrid_attention(q, k, v, budget=1), v)
    q, k, v = qkv(1, 1, 1, 8, m=9, seed=8)
    out = hybrid_attention(q, k, v, **SMALL)
    torch.testing.assert_close(out, hybrid_attention_naive(q, k, v, **SMALL))


def test_bf16_autocast_computes_in_float32():
    q, k, v = (t.float() for t in qkv(1, 2, 40, 16, seed=9))
    ref = hybrid_attention(q, k, v, budget=16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = hybrid_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), budget=16)
    assert out.dtype == torch.bfloat16
    assert (out.float() - ref).norm() / ref.norm() < 0.05


def test_budget_rule():
    p = plan(HybridOptions(), 512, causal=False)
    assert (p.window, p.num_selected, p.num_summaries, p.block_size, p.grouping) == (8, 12, 8, 4, "tree")
    p = plan(HybridOptions(budget=128), 512, causal=True)
    assert (p.window, p.num_selected, p.num_summaries, p.grouping) == (16, 24, 16, "contiguous")
    p = plan(HybridOptions(budget=32, window=2, num_selected=1), 512, causal=False)
    assert (p.window, p.num_selected, p.num_summaries) == (2, 1, 4)


def test_bad_combinations_raise():
    q, k, v = qkv(1, 1, 20, 8, seed=0)
    with pytest.raises(ValueError, match="grouping='contiguous'"):
        hybrid_attention(q, k, v, causal=True, grouping="tree")
    with pytest.raises(ValueError, match="query_group=1"):
        hybrid_attention(q, k, v, causal=True, query_group=2)
    with pytest.raises(ValueError, match="power of two"):
        hybrid_attention(q, k, v, num_summaries=3, budget=12)
    with pytest.raises(ValueError, match="scoring"):
        hybrid_attention(q, k, v, scoring="oracle")
    with pytest.raises(TypeError, match="budget"):
        hybrid_attention(q, k, v, budget=1.5)


def test_tree_groups_similar_keys():
    # two well separated clusters of keys, interleaved in position: the first split separates them
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(2, 8, generator=g, dtype=torch.float64) * 10
    labels = torch.arange(32) % 2
    k = (centres[labels] + 0.1 * torch.randn(32, 8, generator=g, dtype=torch.float64))[None, None]
    p = plan(HybridOptions(budget=8, block_size=4, num_summaries=2), 32, causal=False)
    order, slot_valid, coarse = hybrid.build_groups(k, torch.ones(1, 32, dtype=torch.bool), p)
    halves = labels[order[0, 0]].view(2, 16)
    assert coarse == 16 and slot_valid.all()
    assert {tuple(h.unique().tolist()) for h in halves} == {(0,), (1,)}


@pytest.mark.parametrize("opts", [
    dict(budget=16, block_size=2, scoring="bounds", grouping="contiguous"),
    dict(budget=16, block_size=8, scoring="second_order", query_group=3),
    dict(budget=16, block_size=2, candidates=4, scoring="second_order"),
    dict(budget=16, block_size=4, candidates=8, scoring="mean", grouping="contiguous"),
], ids=["bounds-contiguous", "blocks8-grouped", "two-stage", "two-stage-mean"])
def test_flop_formula_matches_counted(opts):
    from subquad.bench.flops import counted_flops, forward_flops
    from subquad.bench.workload import full_options

    q, k, v = qkv(1, 2, 70, 16, dv=8, seed=11, dtype=torch.float32)
    counted = counted_flops(lambda: hybrid_attention(q, k, v, **opts))
    info = subquad.get_method("hybrid")
    assert forward_flops("hybrid", 1, 2, 70, 70, 16, 8, full_options(info, opts)) == counted
