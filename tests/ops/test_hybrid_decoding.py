"""hybrid's decoding state (subquad.ops.hybrid.decoding): each decoded token gets the
output its row gets in the causal op, after any prefill, with padding, batches of different
lengths, beam reordering and every score."""

from __future__ import annotations

import pytest
import torch

import subquad
from subquad.ops.hybrid import HybridDecodeState, HybridOptions

SMALL = dict(query_block=8, key_block=4, num_blocks=3, sinks=1, local=1)


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _qkv(B, H, N, D=8, Dv=6, seed=0):
    return _randn(B, H, N, D, seed=seed), _randn(B, H, N, D, seed=seed + 1), _randn(B, H, N, Dv, seed=seed + 2)


def _op(q, k, v, **options):
    return subquad.attention(q, k, v, method="hybrid", causal=True, scale=0.4, **options)


def _decode(state, q, k, v, cuts, mask=None):
    """Feed positions in pieces ending at ``cuts`` (the first piece a prefill when longer than one)."""
    outs, a = [], 0
    for b in cuts:
        m = None if mask is None else mask[:, a:b]
        outs.append(state.attend(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], m, scale=0.4))
        a = b
    return torch.cat(outs, 2)


@pytest.mark.parametrize("top_p", [1.0, 0.4])
@pytest.mark.parametrize("score", ["mass", "mean", "mean_query", "sampled"])
@pytest.mark.parametrize("prefill", [0, 1, 7, 8, 33, 64])
def test_decoded_tokens_get_their_rows_of_the_causal_op(score, prefill, top_p):
    N = 90  # key blocks past num_blocks + sinks + local: a real choice from query block 3 on
    q, k, v = _qkv(2, 3, N)
    want = _op(q, k, v, score=score, top_p=top_p, **SMALL)
    state = HybridDecodeState(HybridOptions(score=score, top_p=top_p, **SMALL))
    cuts = ([prefill] if prefill else []) + list(range(prefill + 1, N + 1))
    got = _decode(state, q, k, v, cuts)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert state.seen == N


def test_the_choice_is_made_and_differs_from_exact():
    """The check above is not vacuous: at this length the decoded outputs are not exact attention's."""
    q, k, v = _qkv(1, 2, 90)
    state = HybridDecodeState(HybridOptions(**SMALL))
    got = _decode(state, q, k, v, [20] + list(range(21, 91)))
    exact = subquad.attention(q, k, v, method="softmax", causal=True, scale=0.4)
    assert (got[:, :, 40:] - exact[:, :, 40:]).abs().amax() > 1e-3
    assert state.rows[0].past is not None and state.rows[0].past[0].shape[1] == 5 * 4  # sinks, local, 3 chosen


def test_top_p_prunes_blocks_per_head_while_decoding():
    """With top_p the heads of a row keep different numbers of blocks (the pruned ones masked),
    and the outputs differ from top_p=1's."""
    q, k, v = _qkv(1, 4, 90)
    state = HybridDecodeState(HybridOptions(top_p=0.15, **SMALL))
    got = _decode(state, q, k, v, [89, 90])
    keys, _, bias = state.rows[0].past
    kept = (bias == 0).sum(1)
    assert keys.shape[1] == kept.max() and len(set(kept.tolist())) > 1
    assert (got - _op(q, k, v, **SMALL)).abs().amax() > 1e-3


def test_default_options_exact_below_the_selection_and_multi_token_steps():
    """Default blocks (128): short rows select every key; several tokens after a prefill step one by one."""
    q, k, v = _qkv(1, 2, 300, D=16, Dv=16, seed=4)
    state = HybridDecodeState()
    got = _decode(state, q, k, v, [100, 101, 160, 300])
    want = subquad.attention(q, k, v, method="softmax", causal=True, scale=0.4)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_padding_and_rows_of_different_lengths():
    """A padded token joins nothing and outputs zeros; each row counts its own real tokens, as the
    op does for each item alone."""
    B, N = 2, 70
    q, k, v = _qkv(B, 2, N, seed=7)
    mask = torch.zeros(B, N, dtype=torch.bool)
    mask[0, :9] = True  # left padding in the prefill
    mask[1, 40:43] = True  # padding while decoding
    state = HybridDecodeState(HybridOptions(**SMALL))
    got = _decode(state, q, k, v, [30] + list(range(31, N + 1)), mask)
    for b in range(B):
        keep = (~mask[b]).nonzero()[:, 0]
        want = _op(*(t[b: b + 1].index_select(2, keep) for t in (q, k, v)), **SMALL)
        torch.testing.assert_close(got[b: b + 1].index_select(2, keep), want, rtol=1e-10, atol=1e-10)
        assert bool((got[b][:, mask[b]] == 0).all())
    assert [r.count for r in state.rows] == [N - 9, N - 3]


def test_select_reorders_rows_and_copies_them():
    q, k, v = _qkv(2, 2, 60, seed=3)
    state = HybridDecodeState(HybridOptions(**SMALL))
    state.attend(q[:, :, :50], k[:, :, :50], v[:, :, :50], scale=0.4)
    state.select(torch.tensor([1, 1]))
    out = state.attend(q[1:, :, 50:51].expand(2, -1, -1, -1), k[1:, :, 50:51].expand(2, -1, -1, -1),
                       v[1:, :, 50:51].expand(2, -1, -1, -1), scale=0.4)
    want = _op(q[1:, :, :51], k[1:, :, :51], v[1:, :, :51], **SMALL)[:, :, 50]
    torch.testing.assert_close(out[:, :, 0], want.expand(2, -1, -1), rtol=1e-10, atol=1e-10)
    assert state.rows[0].k is not state.rows[1].k
    with pytest.raises(ValueError, match="holds 2 batch rows"):
        state.attend(q[:1, :, :1], k[:1, :, :1], v[:1, :, :1])
    assert state.nbytes() > 0
