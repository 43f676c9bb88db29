"""Hybrid attention: the fast op against its plain definition (``naive.py``) in values and
gradients, over groupings, scorings, causal and cross lengths, padding and the beam descent;
padding invariance, causality, the budget rule and exactness at full budget."""

from __future__ import annotations

import pytest
import torch

import subquad
import subquad.ops.hybrid as hybrid
import subquad.ops.hybrid.index as hybrid_index
import subquad.ops.hybrid.options as hybrid_options
from conftest import qkv
from subquad.ops.hybrid import HybridOptions, hybrid_attention, plan
from subquad.ops.hybrid.index import build_index, halves, largest
from subquad.ops.hybrid.naive import hybrid_attention_naive
from subquad.ops.softmax.naive import softmax_attention_reference

SMALL = dict(budget=12, block_size=2, window=3, num_selected=2, num_summaries=2)

CASES = [
    # (N, M, causal, grouping, scoring, candidates, beam, chunk_size)
    (13, 13, False, "tree", "mass", 256, 32, 128),
    (13, 13, False, "contiguous", "mean", 256, 32, 128),
    (13, 17, False, "tree", "mean", 256, 32, 128),
    (16, 16, True, "contiguous", "mass", 256, 32, 128),
    (11, 11, True, "tree", "mean", 8, 4, 4),
    (9, 23, False, "contiguous", "mass", 256, 32, 128),
    # the beam descent: more leaves than candidates
    (29, 29, False, "tree", "mass", 4, 2, 8),
    (30, 30, True, "tree", "mass", 4, 2, 8),
    (29, 37, False, "contiguous", "mass", 4, 4, 8),
    (21, 40, False, "tree", "mean", 2, 2, 4),
    (33, 33, True, "contiguous", "mean", 2, 1, 4),
    (40, 40, False, "tree", "mass", 8, 2, 8),
    (60, 60, True, "tree", "mass", 8, 4, 4),
    (37, 45, False, "contiguous", "mass", 8, 2, 8),
    (45, 45, True, "tree", "mean", 8, 4, 8),
    (50, 50, True, "tree", "mass", 16, 2, 4),  # final nodes larger than a chunk
]


def _opts(case) -> dict:
    grouping, scoring, candidates, beam, chunk = case[3:]
    return dict(SMALL, grouping=grouping, scoring=scoring, candidates=candidates, beam=beam, chunk_size=chunk)


def _mask(m):
    mask = torch.zeros(2, m, dtype=torch.bool)
    mask[0, -3:] = True
    mask[1, 1:4] = True
    return mask


@pytest.fixture(params=[64, 4], ids=["block64", "block4"])
def query_block(request, monkeypatch):
    """Queries sharing one descent: the default, and small enough that the tiny test lengths
    hold several blocks."""
    monkeypatch.setattr(hybrid_options, "QUERY_BLOCK", request.param)
    return request.param


@pytest.fixture(params=["kernel", "torch"])
def path(request, monkeypatch):
    """Which forward computes a CPU call without autograd: the compiled kernel (the default) or
    the torch path (what runs on other devices, with gradients and under torch.compile)."""
    if request.param == "torch":
        monkeypatch.setattr(hybrid, "_kernel", lambda: None)
    return request.param


def _assert_matches_naive(case, masked: bool):
    n, m, causal = case[:3]
    q, k, v = qkv(2, 2, n, 8, m=m, dv=5, seed=n + m)
    mask = _mask(m) if masked else None
    out = hybrid_attention(q, k, v, key_padding_mask=mask, causal=causal, **_opts(case))
    ref = hybrid_attention_naive(q, k, v, mask, causal, None, **_opts(case))
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("masked", [False, True])
def test_matches_naive(case, masked, query_block, path):
    _assert_matches_naive(case, masked)


@pytest.mark.parametrize("case", CASES[6:], ids=lambda c: "-".join(map(str, c)))
def test_chunked_descent_and_runs_match_naive(case, monkeypatch, path):
    """CHUNK_BYTES of 1: the descent scores one query block at a time and every run holds one
    block, as at long N."""
    monkeypatch.setattr(hybrid_options, "QUERY_BLOCK", 4)
    monkeypatch.setattr(hybrid_options, "CHUNK_BYTES", 1)
    _assert_matches_naive(case, masked=True)


@pytest.mark.parametrize("case", [CASES[i] for i in (0, 3, 6, 7, 12)], ids=lambda c: "-".join(map(str, c)))
def test_torch_selection_path_matches_naive(case, monkeypatch):
    """The top-k and the tree's median splits without numpy (what runs on other devices, under
    torch.compile and under dispatch modes): the same estimator as the numpy path on CPU."""
    monkeypatch.setattr(hybrid_options, "QUERY_BLOCK", 4)
    monkeypatch.setattr(hybrid_index, "numpy_path", lambda x: False)
    monkeypatch.setattr(hybrid, "_kernel", lambda: None)
    _assert_matches_naive(case, masked=True)


def test_largest_and_halves_agree_with_torch():
    """numpy's argpartition picks the same sets as torch.topk and a stable argsort's halves
    (ties at -inf/+inf aside, which are never real picks)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 40, generator=g)
    x[0, 0, :30] = -torch.inf
    for k in (0, 1, 7, 40):
        val, idx = largest(x, k)
        ref = x.topk(k, dim=-1).values
        torch.testing.assert_close(val.sort(-1).values, ref.sort(-1).values)
        torch.testing.assert_close(x.gather(-1, idx), val)
    proj = torch.randn(4, 6, 16, generator=g)
    proj[1, 2, 5:] = torch.inf  # invalid slots
    split = halves(proj)
    assert torch.equal(split.sort(-1).values, torch.arange(16).expand(4, 6, 16))
    lower = proj.gather(-1, split[..., :8])
    upper = proj.gather(-1, split[..., 8:])
    assert (lower.amax(-1) <= upper.amin(-1)).all()
    assert torch.equal(lower.sort(-1).values, proj.sort(-1).values[..., :8])


@pytest.mark.parametrize("candidates", [256, 4])
def test_large_leaves_match_naive(candidates, query_block, path):
    """Leaves of more keys: a leaf scores with its keys' exact logit variance."""
    opts = dict(budget=20, block_size=4, window=3, num_selected=2, num_summaries=2, candidates=candidates, beam=2,
                chunk_size=8)
    for causal in (False, True):
        q, k, v = qkv(2, 2, 45 if causal else 41, 8, m=45, dv=5, seed=7)
        out = hybrid_attention(q, k, v, key_padding_mask=_mask(45), causal=causal, **opts)
        torch.testing.assert_close(out, hybrid_attention_naive(q, k, v, _mask(45), causal, None, **opts),
                                   rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("case", [CASES[i] for i in (0, 3, 6, 7, 9, 12)], ids=lambda c: "-".join(map(str, c)))
def test_gradients_match_naive(case):
    _assert_gradients_match_naive(case)


@pytest.mark.parametrize("case", [CASES[i] for i in (6, 7, 12, 15)], ids=lambda c: "-".join(map(str, c)))
def test_gradients_over_many_runs_match_naive(case, monkeypatch):
    """Every query block a run of its own, as at long N: the runs' gathers (and, causal, each
    query's own leaves) share one backward that sums their gradients."""
    monkeypatch.setattr(hybrid_options, "QUERY_BLOCK", 4)
    monkeypatch.setattr(hybrid_options, "CHUNK_BYTES", 1)
    _assert_gradients_match_naive(case)


def _assert_gradients_match_naive(case):
    n, m, causal = case[:3]
    q, k, v = qkv(1, 2, n, 8, m=m, dv=5, seed=3, requires_grad=True)
    mask = _mask(m)[:1]
    w = torch.randn(1, 2, n, 5, dtype=torch.float64)
    fast = torch.autograd.grad(
        (hybrid_attention(q, k, v, key_padding_mask=mask, causal=causal, **_opts(case)) * w).sum(), (q, k, v))
    slow = torch.autograd.grad((hybrid_attention_naive(q, k, v, mask, causal, None, **_opts(case)) * w).sum(),
                               (q, k, v))
    for a, b in zip(fast, slow):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


@pytest.mark.slow
@pytest.mark.parametrize("causal", [False, True])
def test_gradgradcheck_over_many_runs(causal, monkeypatch):
    """Second derivatives through the runs' shared gather, every block a run of its own."""
    monkeypatch.setattr(hybrid_options, "QUERY_BLOCK", 4)
    monkeypatch.setattr(hybrid_options, "CHUNK_BYTES", 1)
    q, k, v = qkv(2, 1, 13, 2, dv=2, seed=5, requires_grad=True)  # more keys than the budget: no exact fallback
    opts = dict(SMALL, candidates=2, beam=1, chunk_size=2, query_beam=2)
    assert torch.autograd.gradgradcheck(lambda a, b, c: hybrid_attention(a, b, c, causal=causal, **opts), (q, k, v))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("query_beam", [0, 2])
def test_gradcheck(causal, query_beam):
    q, k, v = qkv(1, 1, 13, 2, dv=2, seed=5, requires_grad=True)  # more keys than the budget: no exact fallback
    opts = dict(SMALL, candidates=2, beam=1, chunk_size=2, query_beam=query_beam)
    assert torch.autograd.gradcheck(lambda a, b, c: hybrid_attention(a, b, c, causal=causal, **opts), (q, k, v))


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


@pytest.mark.parametrize("grouping", ["tree", "contiguous"])
@pytest.mark.parametrize("candidates", [256, 2])
@pytest.mark.parametrize("query_beam", [0, 2])
def test_causal_reads_nothing_later(grouping, candidates, query_beam, monkeypatch):
    monkeypatch.setattr(hybrid_options, "QUERY_BLOCK", 4)
    n = 40
    q, k, v = qkv(1, 2, n, 8, seed=7)
    opts = dict(SMALL, grouping=grouping, candidates=candidates, beam=2 if candidates == 2 else 32, chunk_size=4,
                query_beam=query_beam)
    out = hybrid_attention(q, k, v, causal=True, **opts)
    for t in (0, 9, 23, 38):
        q2, k2, v2 = q.clone(), k.clone(), v.clone()
        for x in (q2, k2, v2):
            x[:, :, t + 1:] = torch.randn_like(x[:, :, t + 1:]) * 5
        out2 = hybrid_attention(q2, k2, v2, causal=True, **opts)
        torch.testing.assert_close(out[:, :, : t + 1], out2[:, :, : t + 1], rtol=0, atol=0)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("side", ["right", "left", "middle"])
@pytest.mark.parametrize("query_beam", [0, 2])
def test_padding_changes_nothing(causal, side, query_beam, monkeypatch):
    """A padded batch computes, for every item, exactly what the item computes alone (selection
    included): keys, and in self-attention queries, are counted by rank among the real ones;
    padded queries output zeros. Left padding is what batched generation uses."""
    monkeypatch.setattr(hybrid_options, "QUERY_BLOCK", 8)
    opts = dict(SMALL, candidates=4, beam=2, chunk_size=8, query_beam=query_beam)
    n, pad = 45, 19
    q, k, v = qkv(1, 2, n, 8, seed=12)
    alone = hybrid_attention(q, k, v, causal=causal, **opts)
    where = {"right": slice(n, n + pad), "left": slice(0, pad), "middle": slice(20, 20 + pad)}[side]
    real = torch.ones(n + pad, dtype=torch.bool)
    real[where] = False
    big = [torch.randn(1, 2, n + pad, 8, dtype=torch.float64) * 3 for _ in range(3)]
    for x, small in zip(big, (q, k, v)):
        x[:, :, real] = small
    out = hybrid_attention(*big, key_padding_mask=~real[None], causal=causal, **opts)
    torch.testing.assert_close(out[:, :, real], alone, rtol=1e-12, atol=1e-12)
    assert torch.equal(out[:, :, ~real], torch.zeros_like(out[:, :, ~real]))


def test_every_leaf_a_candidate_is_one_stage():
    """candidates >= leaves: no descent, every leaf scored (the reference the descent is measured
    against), as the naive reference scores them; fewer candidates than leaves descend."""
    q, k, v = qkv(1, 2, 70, 8, seed=13)
    assert plan(HybridOptions(budget=16, candidates=1024), 70, causal=False).one_stage
    assert not plan(HybridOptions(budget=16, candidates=8, beam=2), 70, causal=False).one_stage
    for causal in (False, True):
        out = hybrid_attention(q, k, v, causal=causal, budget=16, candidates=1024)
        ref = hybrid_attention_naive(q, k, v, None, causal, None, budget=16, candidates=1024)
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


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
    assert (p.window, p.num_selected, p.num_summaries, p.block_size) == (8, 12, 8, 4)
    assert (p.depth, p.chunk_level, p.start_level, p.final_level) == (7, 0, 0, 0)  # 128 leaves: one stage
    p = plan(HybridOptions(budget=128), 512, causal=True)
    assert (p.window, p.num_selected, p.num_summaries) == (16, 24, 16)
    assert p.chunk_level == 7 - 5  # sealed chunks of 128 keys = 32 leaves
    p = plan(HybridOptions(budget=32, window=2, num_selected=1), 512, causal=False)
    assert (p.window, p.num_selected, p.num_summaries) == (2, 1, 4)
    p = plan(HybridOptions(), 16384, causal=False)  # 4096 leaves: descend from 32 nodes to nodes of 4 leaves
    assert (p.depth, p.start_level, p.final_level, p.beam) == (12, 5, 10, 32)
    p = plan(HybridOptions(budget=128), 16384, causal=False)  # 24 selected leaves: 256 candidates, beam 64
    assert (p.start_level, p.final_level, p.beam) == (6, 10, 64)
    assert plan(HybridOptions(grouping="contiguous"), 16384, causal=False).chunk_level == 12


def test_bad_combinations_raise():
    q, k, v = qkv(1, 1, 20, 8, seed=0)
    with pytest.raises(ValueError, match="power of two"):
        hybrid_attention(q, k, v, num_summaries=3, budget=12)
    with pytest.raises(ValueError, match="power of two"):
        hybrid_attention(q, k, v, candidates=100)
    with pytest.raises(ValueError, match="beam"):
        hybrid_attention(q, k, v, candidates=16, beam=32)
    with pytest.raises(ValueError, match="chunk_size"):
        hybrid_attention(q, k, v, chunk_size=0)
    with pytest.raises(ValueError, match="scoring"):
        hybrid_attention(q, k, v, scoring="oracle")
    with pytest.raises(ValueError, match="grouping"):
        hybrid_attention(q, k, v, grouping="random")
    with pytest.raises(TypeError, match="budget"):
        hybrid_attention(q, k, v, budget=1.5)


def test_tree_groups_similar_keys():
    # two well separated clusters of keys, interleaved in position: the first split separates them
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(2, 8, generator=g, dtype=torch.float64) * 10
    labels = torch.arange(32) % 2
    k = (centres[labels] + 0.1 * torch.randn(32, 8, generator=g, dtype=torch.float64))[None, None]
    index = build_index(k, plan(HybridOptions(budget=8, block_size=4, num_summaries=2), 32, causal=False))
    assert index.slot_valid.all()
    assert {tuple(h.unique().tolist()) for h in labels[index.order[0, 0]].view(2, 16)} == {(0,), (1,)}


def test_causal_tree_never_mixes_chunks():
    """Causal: the tree splits by position down to the sealed chunks, by similarity inside them."""
    k = torch.randn(1, 1, 64, 8, dtype=torch.float64)
    index = build_index(k, plan(HybridOptions(budget=8, block_size=2, chunk_size=16, candidates=8, beam=4), 64,
                                causal=True))
    chunks = index.order[0, 0].view(4, 16) // 16
    assert torch.equal(chunks, torch.arange(4)[:, None].expand(4, 16))
    assert not torch.equal(index.order[0, 0], torch.arange(64))


@pytest.mark.parametrize("opts", [
    dict(budget=16, block_size=2, scoring="mean", grouping="contiguous"),
    dict(budget=16, block_size=8, scoring="mass"),
    dict(budget=16, block_size=2, candidates=4, beam=2, scoring="mass"),
    dict(budget=16, block_size=4, candidates=8, beam=2, scoring="mean", grouping="contiguous"),
    dict(budget=16, block_size=2, candidates=4, beam=2, scoring="mass", query_beam=2),
    dict(budget=16, block_size=2, candidates=8, beam=4, scoring="mean", query_beam=1),
], ids=["mean-contiguous", "blocks8", "descent", "descent-mean", "query-beam", "query-beam-narrow"])
def test_flop_formula_matches_counted(opts):
    from subquad.compare.flops import counted_flops, forward_flops
    from subquad.compare.workload import full_options

    q, k, v = qkv(1, 2, 70, 16, dv=8, seed=11, dtype=torch.float32)
    counted = counted_flops(lambda: hybrid_attention(q, k, v, **opts))
    info = subquad.get_method("hybrid")
    assert forward_flops("hybrid", 1, 2, 70, 70, 16, 8, full_options(info, opts)) == counted


@pytest.mark.parametrize("causal", [False, True])
def test_window_zero_matches_naive(causal, path):
    """No window: the last causal query summarises every key, its last coarse group whole."""
    q, k, v = qkv(1, 2, 20, 8, dv=5, seed=8)
    opts = dict(budget=5, window=0, block_size=2, num_selected=1, num_summaries=2)
    torch.testing.assert_close(hybrid_attention(q, k, v, causal=causal, **opts),
                               hybrid_attention_naive(q, k, v, None, causal, None, **opts), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("case", CASES[6:], ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("query_beam", [1, 2])
def test_query_beam_matches_naive(case, masked, query_block, query_beam):
    """query_beam: each query's own descent adds the leaves its block did not find."""
    n, m, causal = case[:3]
    q, k, v = qkv(2, 2, n, 8, m=m, dv=5, seed=n + m)
    mask = _mask(m) if masked else None
    opts = dict(_opts(case), query_beam=query_beam)
    out = hybrid_attention(q, k, v, key_padding_mask=mask, causal=causal, **opts)
    ref = hybrid_attention_naive(q, k, v, mask, causal, None, **opts)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("causal", [False, True])
def test_query_beam_changes_what_is_selected(causal, monkeypatch):
    """With blocks of 8 queries and a 2-node beam, queries find leaves their block's descent did
    not; the default is an own descent of 4 when causal and none otherwise."""
    monkeypatch.setattr(hybrid_options, "QUERY_BLOCK", 8)
    q, k, v = qkv(1, 2, 96, 8, seed=5)
    opts = dict(SMALL, candidates=4, beam=2, chunk_size=8)
    plain = hybrid_attention(q, k, v, causal=causal, query_beam=0, **opts)
    own = hybrid_attention(q, k, v, causal=causal, query_beam=2, **opts)
    assert (own - plain).abs().amax(-1).gt(1e-6).float().mean() > 0.1
    default = hybrid_attention(q, k, v, causal=causal, **opts)
    torch.testing.assert_close(default, hybrid_attention(q, k, v, causal=causal, query_beam=4 if causal else 0, **opts),
                               rtol=0, atol=0)
