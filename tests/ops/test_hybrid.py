"""hybrid against its naive reference (naive.py), its two forms against each other, and
what is special to it: causal selection from earlier queries only, ties, the FlexAttention form."""

import pytest
import torch

from conftest import qkv
from subquad.ops.hybrid import hybrid_attention, select_blocks
from subquad.ops.hybrid.naive import hybrid_attention_reference, selected_blocks
from subquad.ops.softmax.naive import softmax_attention_reference

SETTINGS = [
    dict(query_block=4, key_block=2, num_blocks=2, sinks=1, local=1),
    dict(query_block=2, key_block=8, num_blocks=1, sinks=0, local=0),
    dict(query_block=8, key_block=4, num_blocks=3, sinks=2, local=2),
    dict(query_block=4, key_block=2, num_blocks=4, sinks=1, local=0, top_p=0.5),
    dict(query_block=2, key_block=2, num_blocks=6, sinks=0, local=1, top_p=0.8),
]


def _mask(b, m):
    mask = torch.zeros(b, m, dtype=torch.bool)
    mask[0, -2:] = True
    mask[1, m // 3: m // 2 + 1] = True
    return mask


SCORES = ["mass", "mean", "mean_query", "sampled"]


@pytest.mark.parametrize("score", SCORES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [1, 7, 37, 64])
def test_matches_naive(n, causal, score):
    for m in (n,) if causal else (n, n + 5):
        q, k, v = qkv(2, 2, n, 8, m=m)
        mask = _mask(2, m)
        for options in SETTINGS:
            out = hybrid_attention(q, k, v, key_padding_mask=mask, causal=causal, score=score, stride=2, **options)
            ref = hybrid_attention_reference(q, k, v, mask, causal, score=score, stride=2, **options)
            torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("score", SCORES)
def test_selection_equals_the_naive_sets(score):
    q, k, _ = qkv(1, 2, 61, 8)
    for causal in (False, True):
        for options in SETTINGS:
            sel = select_blocks(q, k, causal, 8 ** -0.5, score=score, **options)
            sets = selected_blocks(q, k, causal, score=score, **options)
            for h in range(2):
                for i, want in enumerate(sets[0][h]):
                    got = set(sel.index[0, h, i][sel.valid[0, h, i]].tolist())
                    assert got == want


def test_everything_selected_is_softmax():
    q, k, v = qkv(1, 2, 50, 8)
    for causal in (False, True):
        out = hybrid_attention(q, k, v, causal=causal, query_block=4, key_block=4, num_blocks=16)
        torch.testing.assert_close(out, softmax_attention_reference(q, k, v, causal=causal))


def test_a_selection_of_every_block_runs_exact_attention(monkeypatch):
    """Not causal, the forced blocks (own, local, sink) plus the chosen ones can hold every key
    block although ``num_blocks`` alone does not: then the op is exact attention, no gathering."""
    import subquad.ops.hybrid as hybrid

    def fail(*args):
        raise AssertionError("gathered")

    q, k, v = qkv(1, 2, 50, 8)
    options = dict(query_block=16, key_block=4, num_blocks=10, sinks=1, local=1)  # 13 key blocks, at least 3 forced
    monkeypatch.setattr(hybrid, "attend_gathered", fail)
    torch.testing.assert_close(hybrid_attention(q, k, v, **options), softmax_attention_reference(q, k, v))
    with pytest.raises(AssertionError, match="gathered"):  # one block fewer: the gathered form
        hybrid_attention(q, k, v, **{**options, "num_blocks": 9})


@pytest.mark.parametrize("score", SCORES)
def test_causal_block_is_scored_by_the_queries_before_it(score):
    """Changing the queries of block i changes the key choice of block i + 1, never of block i;
    changing the keys from block i's first position on changes no choice of blocks 0 .. i."""
    q, k, v = qkv(1, 4, 64, 8)
    options = dict(query_block=8, key_block=4, num_blocks=1, sinks=0, local=0, score=score, stride=4)
    base = select_blocks(q, k, True, 1.0, **options)
    q2 = q.clone()
    q2[:, :, 24:32] = 10 * torch.randn(1, 4, 8, 8, dtype=q.dtype)  # block 3's queries
    moved = select_blocks(q2, k, True, 1.0, **options)
    assert torch.equal(base.index[..., :4, :], moved.index[..., :4, :])  # blocks 0 .. 3 keep their keys
    assert not torch.equal(base.index[..., 4:, :], moved.index[..., 4:, :])
    k2 = k.clone()
    k2[:, :, 32:] = 10 * torch.randn(1, 4, 32, 8, dtype=k.dtype)
    moved = select_blocks(q, k2, True, 1.0, **options)
    assert torch.equal(base.index[..., :5, :], moved.index[..., :5, :])


@pytest.mark.slow
@pytest.mark.parametrize("causal", [False, True])
def test_flex_form_equals_gathered_form(causal):
    """The FlexAttention form (compiled; float32 CPU inference) computes what the gathered form
    computes, with padding, a length off the bucket, and rows of different lengths (top_p)."""
    n = 2500
    q, k, v = qkv(2, 2, n, 64, dtype=torch.float32)
    mask = torch.zeros(2, n, dtype=torch.bool)
    mask[1, -300:] = True
    mask[1, 100:140] = True
    for m, top_p in ((None, 1.0), (mask, 1.0), (mask, 0.5)):
        a = hybrid_attention(q, k, v, causal=causal, key_padding_mask=m, backend="flex", top_p=top_p)
        b = hybrid_attention(q, k, v, causal=causal, key_padding_mask=m, backend="gather", top_p=top_p)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_flex_refuses_autograd_on_cpu():
    q, k, v = qkv(1, 1, 16, 8, dtype=torch.float32, requires_grad=True)
    with pytest.raises(ValueError, match="backend='gather'"):
        hybrid_attention(q, k, v, backend="flex", query_block=2, key_block=2, num_blocks=1)


def test_a_padded_item_computes_what_it_computes_alone():
    q, k, v = qkv(1, 2, 40, 8)
    options = dict(query_block=4, key_block=2, num_blocks=2)
    for causal in (False, True):
        alone = hybrid_attention(q, k, v, causal=causal, **options)
        pad = torch.zeros(1, 2, 5, 8, dtype=q.dtype)
        mask = torch.zeros(1, 45, dtype=torch.bool)
        mask[0, :5] = True  # left padding, as a batched decoder has
        batch = hybrid_attention(*(torch.cat([pad, t], 2) for t in (q, k, v)), key_padding_mask=mask,
                                       causal=causal, **options)
        torch.testing.assert_close(batch[:, :, 5:], alone)
        assert (batch[:, :, :5] == (0 if causal else alone[:, :, :1])).all()  # padded positions: defined


@pytest.mark.parametrize("n,options", [(37, SETTINGS[0]), (200, SETTINGS[2]),
                                       (64, dict(query_block=8, key_block=8, num_blocks=2, sinks=0, local=1))])
def test_causal_kernel_form_equals_gathered_form_with_gradients(n, options):
    """Causal self-attention on the CPU runs torch's fused kernel per block (backend 'sdpa', the
    default there): the same outputs and gradients as the gathered form, value width != key width."""
    q, k, v = qkv(2, 3, n, 8, dv=5, requires_grad=True)
    w = torch.randn(2, 3, n, 5, dtype=q.dtype)
    grads = []
    for backend in ("sdpa", "gather"):
        out = hybrid_attention(q, k, v, causal=True, backend=backend, **options)
        grads.append((out, *torch.autograd.grad((out * w).sum(), (q, k, v))))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_causal_kernel_form_in_bfloat16():
    q, k, v = qkv(1, 2, 130, 16, dtype=torch.bfloat16)
    options = dict(query_block=8, key_block=4, num_blocks=3)
    a = hybrid_attention(q, k, v, causal=True, backend="sdpa", **options)
    b = hybrid_attention(q.double(), k.double(), v.double(), causal=True, backend="gather", **options)
    torch.testing.assert_close(a.double(), b, rtol=2e-2, atol=2e-2)


def test_sdpa_backend_refuses_what_it_cannot_run():
    q, k, v = qkv(1, 1, 16, 8)
    with pytest.raises(ValueError, match="backend='sdpa' runs causal self-attention"):
        hybrid_attention(q, k, v, causal=False, backend="sdpa", query_block=2, key_block=2, num_blocks=1)


def test_flex_tables_are_flex_attentions_own_and_contiguous():
    """The BlockMask's tables, the key tiles' included (which the CUDA backward walks and reads as
    contiguous memory), equal what ``BlockMask.from_kv_blocks`` derives from the query tiles'."""
    from torch.nn.attention.flex_attention import BlockMask

    from subquad.ops.hybrid.parallel import _tables

    g = torch.Generator().manual_seed(0)
    visit = torch.rand(2, 3, 8, 16, generator=g) < 0.4
    full = visit & (torch.rand(2, 3, 8, 16, generator=g) < 0.5)
    tables = _tables(visit, full)
    ref = BlockMask.from_kv_blocks(*tables[:4], BLOCK_SIZE=(128, 128))
    names = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
             "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")
    for name, table in zip(names, tables):
        assert table.is_contiguous() and table.dtype == torch.int32, name
        assert torch.equal(table, getattr(ref, name)), name


def test_flex_call_raises_dynamos_graph_limit(monkeypatch):
    """One graph per padded length, mask form and grad mode soon passes dynamo's default limit
    (8), past which FlexAttention runs unfused: the compiled call raises the limit for itself."""
    from subquad.ops.hybrid import parallel

    seen = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: lambda *a, **k: seen.append(
        torch._dynamo.config.recompile_limit))
    with torch._dynamo.config.patch(recompile_limit=2):
        parallel._compiled.__wrapped__("cpu")()
        assert seen == [parallel.GRAPHS] and torch._dynamo.config.recompile_limit == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_block_counts_and_cached_candidates(dtype):
    """Block sizes are exact in every dtype (bfloat16 cannot hold 65408), and the cached candidate
    rows equal freshly built ones, usable under autograd after a first call in inference mode."""
    from subquad.ops.hybrid.select import _candidates, _counts, candidates

    counts = _counts(65536 + 5, 128, torch.empty(0, dtype=dtype))
    assert counts.dtype == dtype and counts.shape == (513,)
    assert counts[:-1].eq(128).all() and counts[-1] == 5
    args = dict(query_block=8, key_block=4, sinks=1, local=1, device=torch.device("cpu"))
    with torch.inference_mode():
        cached = candidates(50, 50, True, **args)
    fresh = _candidates(50, 50, True, 8, 4, 1, 1, torch.device("cpu"))
    assert all(torch.equal(a, b) and not a.is_inference() for a, b in zip(cached, fresh))
    assert candidates(50, 50, True, **args)[2] is cached[2]
    q, k, v = (t.requires_grad_() for t in qkv(1, 2, 50, 8))
    out = hybrid_attention(q, k, v, causal=True, query_block=8, key_block=4, num_blocks=2)
    out.sum().backward()
    assert q.grad is not None


@pytest.mark.parametrize("score", SCORES)
@pytest.mark.parametrize("causal", [False, True])
def test_top_p_prunes_the_chosen_blocks_as_the_naive_rule(score, causal):
    """With top_p each query block keeps the naive rule's blocks: a subset of what top_p=1 chooses
    (forced and diagonal blocks included), fewer as top_p falls."""
    q, k, _ = qkv(2, 3, 96, 8)
    opts = dict(query_block=8, key_block=4, num_blocks=6, sinks=1, local=1, score=score)
    everything = selected_blocks(q, k, causal, **opts)
    sizes = [int(select_blocks(q, k, causal, 8 ** -0.5, **opts).valid.sum())]
    for p in (0.5, 0.3):
        sel = select_blocks(q, k, causal, 8 ** -0.5, **opts, top_p=p)
        ref = selected_blocks(q, k, causal, **opts, top_p=p)
        for b in range(2):
            for h in range(3):
                for i, blocks in enumerate(ref[b][h]):
                    assert set(sel.index[b, h, i][sel.valid[b, h, i]].tolist()) == blocks, (b, h, i)
                    assert blocks <= everything[b][h][i]
        sizes.append(int(sel.valid.sum()))
    assert sizes[0] > sizes[1] >= sizes[2]


@pytest.mark.parametrize("top_p", [1.0, 0.4])
@pytest.mark.parametrize("causal", [False, True])
def test_expected_keys_counts_the_naive_selection(causal, top_p):
    """The registry's keys per query: each query's selected blocks' keys (causal: at or before it),
    counted from the naive selection; exact attention's counts when every block is selected."""
    from subquad.ops.hybrid import HybridOptions, expected_keys

    q, k, _ = qkv(1, 2, 45, 8)
    opts = dict(query_block=8, key_block=4, num_blocks=3, sinks=1, local=1)
    got = expected_keys(q, k, causal, HybridOptions(**opts, top_p=top_p))
    sel = selected_blocks(q, k, causal, **opts, top_p=top_p)
    for h in range(2):
        for p in range(45):
            keys = {t for j in sel[0][h][p // 8] for t in range(j * 4, min(45, j * 4 + 4)) if not causal or t <= p}
            assert got[0, h, p] == len(keys), (h, p)
    every = expected_keys(q, k, causal, HybridOptions(num_blocks=20))[0, 0]
    exact = torch.arange(1, 46.0) if causal else torch.full((45,), 45.0)
    assert torch.equal(every, exact.double())
