"""hybrid's decoding state (subquad.ops.hybrid.decode) against dense references: the attention
implied by its choice, the exact leaf selection, the descent, exactness at a full budget, the
prefill, padding and batches of different lengths."""

from __future__ import annotations

import contextlib

import pytest
import torch

import subquad
from subquad.ops.hybrid import HybridOptions
from subquad.ops.hybrid.decode import HybridDecodeState, candidate_leaves, select_leaves

SMALL = HybridOptions(budget=24, block_size=2, window=4, num_selected=3, num_summaries=2, candidates=4, beam=2,
                      chunk_size=8)


def _randn(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _row(k, v, bs, state=None):
    row = (state or HybridDecodeState(HybridOptions(block_size=bs))).new_row()
    row.extend(k[:, :5], v[:, :5])  # in pieces: the prefix sums must not depend on how keys arrive
    for j in range(5, k.shape[1]):
        row.extend(k[:, j: j + 1], v[:, j: j + 1])
    return row


def _implied(q, k, v, w0, L, selected, bs, G, scale):
    """Dense reference: softmax over every key, where a key before the window that is not in a
    selected leaf has its logit replaced by the mean logit of the non-selected keys of its run."""
    H, T = k.shape[:2]
    logits = scale * torch.einsum("hd,htd->ht", q, k)
    out = []
    for h in range(H):
        lg = logits[h].clone()
        chosen = {int(x) for x in selected[h] if x >= 0}
        bounds = [g * L // G for g in range(G + 1)]
        for g in range(G):
            rest = [t for t in range(bounds[g] * bs, bounds[g + 1] * bs) if t // bs not in chosen]
            if rest:
                lg[rest] = lg[rest].mean()
        out.append(torch.softmax(lg, 0) @ v[h])
    return torch.stack(out)


@pytest.mark.parametrize("T", [1, 5, 9, 30, 61])
def test_step_is_the_attention_its_choice_implies(T):
    H, D = 3, 8
    k, v, q = _randn(H, T, D, seed=1), _randn(H, T, 5, seed=2), _randn(H, D, seed=3)
    state = HybridDecodeState(SMALL)
    row = _row(k, v, SMALL.block_size, state)
    w0, L, selected = state.choose(row, q, 0.4)
    assert w0 == max(0, T - 4) // 2 * 2 and L == w0 // 2
    # the row's keys: chunks of 8 behind the window are regrouped by similarity, the rest as given
    ks, vs = row.k[:, :T], row.v[:, :T]
    torch.testing.assert_close(ks.sort(1).values, k.sort(1).values, rtol=0, atol=0)
    assert torch.equal(ks[:, w0:], k[:, w0:]) and torch.equal(ks[:, :8], k[:, :8])  # the sink chunk stays
    assert row.grouped == max(1, (T - 6) // 8)
    G = min(2, L)
    want = _implied(q, ks, vs, w0, L, selected, 2, G, 0.4) if L else torch.softmax(0.4 * torch.einsum(
        "hd,htd->ht", q, k), 1).unsqueeze(1).matmul(v).squeeze(1)
    torch.testing.assert_close(state._step(row, q, 0.4), want, rtol=1e-10, atol=1e-10)


def test_selection_is_the_exact_best_leaves_when_every_leaf_is_a_candidate():
    H, D, bs = 4, 8, 2
    k, v, q = _randn(H, 40, D, seed=4), _randn(H, 40, D, seed=5), _randn(H, D, seed=6)
    row = _row(k, v, bs)
    cand = torch.arange(20).expand(H, 20)
    got = select_leaves(row, q, cand, 5, 0.5)
    lse = (0.5 * torch.einsum("hd,htd->ht", q, k)).unflatten(1, (20, bs)).logsumexp(-1)
    want = lse.topk(5, dim=1).indices
    assert torch.equal(got.sort(1).values, want.sort(1).values)


def test_descent_returns_candidates_in_range_and_finds_a_planted_leaf():
    H, D, bs, leaves = 2, 16, 4, 700
    k, v, q = _randn(H, leaves * bs, D, seed=7), _randn(H, leaves * bs, D, seed=8), _randn(H, D, seed=9)
    k[:, 4 * 517: 4 * 518] = 3.0 * q[:, None] / q.norm(dim=-1, keepdim=True)[:, None]
    row = _row(k, v, bs, HybridDecodeState(HybridOptions(block_size=bs, grouping="contiguous")))  # keys stay put
    cand = candidate_leaves(row, q, 1, leaves, 64, 16, 1.0)
    assert cand.shape == (H, 64)
    assert (((cand >= 1) & (cand < leaves)) | (cand == -1)).all()  # -1: a run past the last leaf
    assert (cand == 517).any(1).all()
    # at most `candidates` leaves: every leaf from `first` on
    assert torch.equal(candidate_leaves(row, q, 3, 40, 64, 16, 1.0)[0], torch.arange(3, 40))


def test_full_budget_decodes_exact_attention():
    H, T, D = 2, 50, 8
    q, k, v = (_randn(1, H, T, D, seed=s) for s in (10, 11, 12))
    state = HybridDecodeState(HybridOptions(budget=256, block_size=2))
    got = torch.cat([state.attend(q[:, :, j: j + 1], k[:, :, j: j + 1], v[:, :, j: j + 1]) for j in range(T)], 2)
    want = subquad.attention(q, k, v, method="softmax", causal=True)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_prefill_is_the_parallel_op_and_steps_follow():
    H, T, D = 2, 40, 8
    q, k, v = (_randn(2, H, T + 6, D, seed=s) for s in (13, 14, 15))
    state = HybridDecodeState(SMALL)
    pre = state.attend(q[:, :, :T], k[:, :, :T], v[:, :, :T])
    want = subquad.attention(q[:, :, :T], k[:, :, :T], v[:, :, :T], method="hybrid", causal=True,
                             **{f: getattr(SMALL, f) for f in SMALL.__dataclass_fields__})
    torch.testing.assert_close(pre, want, rtol=1e-12, atol=1e-12)
    assert state.seen == T
    for j in range(T, T + 6):
        out = state.attend(q[:, :, j: j + 1], k[:, :, j: j + 1], v[:, :, j: j + 1])
        for b in range(2):
            row = state.rows[b]
            torch.testing.assert_close(out[b, :, 0], state._step(row, q[b, :, j], D**-0.5), rtol=1e-12, atol=1e-12)
    assert state.seen == T + 6


def test_padded_batch_equals_each_row_alone():
    """Left padding in the prefill and a padded step: each row computes what it computes alone;
    padded tokens output zeros and join nothing."""
    H, T, D = 2, 30, 8
    q, k, v = (_randn(2, H, T + 4, D, seed=s) for s in (16, 17, 18))
    pad = torch.zeros(2, T + 4, dtype=torch.bool)
    pad[1, :7] = True  # row 1: a shorter prompt, left-padded
    pad[0, T + 2] = True  # row 0: one padded step
    batch = HybridDecodeState(SMALL)
    outs = [batch.attend(q[:, :, :T], k[:, :, :T], v[:, :, :T], pad[:, :T])]
    for j in range(T, T + 4):
        outs.append(batch.attend(q[:, :, j: j + 1], k[:, :, j: j + 1], v[:, :, j: j + 1], pad[:, j: j + 1]))
    got = torch.cat(outs, 2)
    for b in range(2):
        keep = (~pad[b]).nonzero()[:, 0]
        alone = HybridDecodeState(SMALL)
        prompt = keep[keep < T]
        parts = [alone.attend(*(t[b: b + 1][:, :, prompt] for t in (q, k, v)))]
        for j in keep[keep >= T].tolist():
            parts.append(alone.attend(*(t[b: b + 1, :, j: j + 1] for t in (q, k, v))))
        torch.testing.assert_close(got[b: b + 1][:, :, keep], torch.cat(parts, 2), rtol=1e-12, atol=1e-12)
        assert not got[b][:, pad[b]].any()
    assert [r.count for r in batch.rows] == [T + 3, T + 4 - 7]


def test_memory_grows_with_the_tokens_and_select_keeps_rows():
    H, D = 2, 8
    state = HybridDecodeState(SMALL)
    q, k, v = (_randn(3, H, 300, D, seed=s, dtype=torch.float32) for s in (19, 20, 21))
    state.attend(q[:, :, :100], k[:, :, :100], v[:, :, :100])
    small = state.nbytes()
    state.attend(q[:, :, 100:300], k[:, :, 100:300], v[:, :, 100:300])
    assert state.nbytes() > small
    state.select(torch.tensor([2, 2, 0]))
    assert len(state.rows) == 3 and state.rows[0] is not state.rows[1]
    step = [t[:1, :, :1].expand(3, -1, -1, -1) for t in (q, k, v)]  # the same token for every row
    x = state.attend(*step)
    assert torch.equal(x[0], x[1]) and not torch.equal(x[0], x[2])


def test_a_selected_row_keeps_decoding_into_its_own_buffers():
    """select() copies rows; a copy's compiled steps append to its own keys, values and sums,
    so it decodes exactly as a row that was never copied."""
    H, D = 2, 8
    q, k, v = (_randn(1, H, 80, D, seed=s, dtype=torch.float32) for s in (40, 41, 42))
    copied, kept = HybridDecodeState(SMALL), HybridDecodeState(SMALL)
    for state in (copied, kept):
        state.attend(q[:, :, :40], k[:, :, :40], v[:, :, :40])
        state.attend(q[:, :, 40:41], k[:, :, 40:41], v[:, :, 40:41])
    copied.select(torch.tensor([0]))
    for j in range(41, 80):
        outs = [state.attend(q[:, :, j: j + 1], k[:, :, j: j + 1], v[:, :, j: j + 1]) for state in (copied, kept)]
        torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    a, b = copied.rows[0], kept.rows[0]
    assert torch.equal(a.k[:, :80], b.k[:, :80]) and torch.equal(a.ps, b.ps)


def test_a_failed_step_leaves_the_row_as_it_was():
    """A step whose key cannot go to the compiled kernel (it requires grad) raises before the row
    changes: the next steps decode as if it had never been tried."""
    H, D = 2, 8
    q, k, v = (_randn(1, H, 30, D, seed=s, dtype=torch.float32) for s in (43, 44, 45))
    tried, clean = HybridDecodeState(SMALL), HybridDecodeState(SMALL)
    for state in (tried, clean):
        state.attend(q[:, :, :20], k[:, :, :20], v[:, :, :20])
    with pytest.raises(RuntimeError):
        tried.attend(q[:, :, 20:21], k[:, :, 20:21].clone().requires_grad_(), v[:, :, 20:21])
    assert tried.seen == 20
    for j in range(20, 30):
        outs = [state.attend(q[:, :, j: j + 1], k[:, :, j: j + 1], v[:, :, j: j + 1]) for state in (tried, clean)]
        torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


def test_refuses_a_different_batch():
    state = HybridDecodeState(SMALL)
    q = _randn(2, 1, 3, 4)
    state.attend(q, q, q)
    with pytest.raises(ValueError, match="batch rows"):
        state.attend(q[:1], q[:1], q[:1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_compiled_step_equals_the_torch_path(dtype):
    """On CPU a step runs the compiled kernel, which also appends the token to the row; inside
    ``hybrid.torch_path()`` the torch ops. Both give the same outputs and the same row (keys,
    values, prefix sums, pyramid), with the descent active (default options, 9000 keys: 2250
    leaves against 128 candidates, so it starts from runs of 32 leaves read from the pyramid),
    over steps that complete leaves, pyramid rows and a regrouped chunk, and leave a partial leaf."""
    from subquad.ops import hybrid

    H, T, D, steps = 2, 9000, 16, 103
    q, k, v = (_randn(2, H, T + steps, D, seed=s, dtype=dtype) for s in (22, 23, 24))
    k[:, :, 5000:5004] += 2.0 * q[:, :, -1:]  # a leaf the last query should find
    outs, rows = [], []
    for compiled in (True, False):
        state = HybridDecodeState()
        state.attend(q[:, :, :T], k[:, :, :T], v[:, :, :T])
        grouped = state.rows[0].grouped
        with contextlib.nullcontext() if compiled else hybrid.torch_path():
            outs.append(torch.cat([state.attend(q[:, :, j: j + 1], k[:, :, j: j + 1], v[:, :, j: j + 1])
                                   for j in range(T, T + steps)], 2))
        rows.append(state.rows)
    assert rows[0][0].grouped > grouped
    tol = 1e-5 if dtype == torch.float32 else 1e-10
    torch.testing.assert_close(outs[0], outs[1], rtol=tol, atol=tol)
    for a, b in zip(*rows):
        assert a.count == b.count == T + steps
        for x, y in ((a.k[:, :a.count], b.k[:, :b.count]), (a.v[:, :a.count], b.v[:, :b.count]), (a.ps, b.ps),
                     (a.pyramid, b.pyramid)):
            torch.testing.assert_close(x, y, rtol=tol, atol=tol)


def test_regrouped_chunks_hold_similar_keys():
    """A chunk behind the window is reordered so that each leaf holds keys close together: two
    well-separated clusters interleaved by position end up in separate leaves."""
    D = 4
    opts = HybridOptions(budget=24, block_size=4, window=4, num_selected=1, num_summaries=1, candidates=4, beam=1,
                         chunk_size=16, sinks=0)
    centre = torch.zeros(32, D, dtype=torch.float64)
    centre[::2, 0] = 10.0  # even positions near +10 e0, odd ones near 0
    k = (centre + 0.01 * _randn(32, D, seed=30)).unsqueeze(0)
    state = HybridDecodeState(opts)
    row = _row(k, k.clone(), 4, state)
    assert row.grouped == 1
    leaves = row.k[0, :16, 0].view(4, 4)
    assert ((leaves > 5).all(1) | (leaves < 5).all(1)).all()
    assert torch.equal(row.v[:, :16], row.k[:, :16])  # values move with their keys
    torch.testing.assert_close(row.ps[:, 1:5, :D], row.k[:, :16].unflatten(1, (4, 4)).sum(2).cumsum(1))
