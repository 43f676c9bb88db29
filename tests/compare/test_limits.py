"""``subquad compare --limits`` (``subquad.compare.limits``): the rank-r, block-local and uniform
reference rows and the sharpness, against the full matrices written out."""

import pytest
import torch

from subquad.compare import limits
from subquad.compare.fidelity import attention_sharpness, exact_reference, head_errors, relative_error


def _qkv(n=48, heads=2, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, heads, n, dim, generator=g, dtype=torch.float64) * s for s in (1.5, 1.5, 1.0))


def _full_weights(q, k, scale, causal):
    logits = (q @ k.transpose(-1, -2)) * scale
    if causal:
        logits = logits.masked_fill(torch.ones(logits.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(logits, dim=-1)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block", [1, 7, 16, 48])
def test_block_local_is_softmax_inside_the_querys_own_block(causal, block):
    q, k, v = _qkv(n=45)
    i = torch.arange(45)
    allowed = (i[:, None] // block) == (i[None, :] // block)
    if causal:
        allowed &= i[None, :] <= i[:, None]
    logits = (q @ k.transpose(-1, -2)) * 0.3
    want = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1) @ v
    torch.testing.assert_close(limits.block_local(q, k, v, 0.3, causal, block), want)


@pytest.mark.parametrize("causal", [False, True])
def test_rank_limit_is_the_best_rank_r_attention_matrix_times_v(causal):
    q, k, v = _qkv()
    a = _full_weights(q, k, 0.4, causal)
    exact = exact_reference(q, k, v, 0.4, causal=causal)
    out = limits.rank_limit(q, k, exact, 0.4, causal, [1, 5, 48])
    u, s, vh = torch.linalg.svd(a)
    for r in (1, 5):
        a_r = (u[..., :r] * s[..., None, :r]) @ vh[..., :r, :]  # Eckart-Young: the best rank-r matrix
        torch.testing.assert_close(out[r], a_r @ v)
    torch.testing.assert_close(out[48], exact)  # full rank: exact


def test_the_randomized_svd_above_full_svd_matches_the_full_one(monkeypatch):
    q, k, v = _qkv(n=300, heads=1)
    exact = exact_reference(q, k, v, causal=True)
    full = limits.rank_limit(q, k, exact, 8 ** -0.5, True, [4, 16])
    monkeypatch.setattr(limits, "FULL_SVD", 100)
    sketched = limits.rank_limit(q, k, exact, 8 ** -0.5, True, [4, 16])
    for r in (4, 16):
        assert relative_error(sketched[r], exact) == pytest.approx(relative_error(full[r], exact), rel=1e-2)


def test_limit_rows_label_each_share_and_fall_with_the_rank():
    inputs = [_qkv(seed=s) for s in range(2)]
    refs = [exact_reference(*x, causal=True) for x in inputs]
    rows = limits.limit_rows(inputs, refs, [0.125, 0.5, 1.0], causal=True)
    assert list(rows) == [limits.UNIFORM, "rank-r limit @ 12.5%", "block-local @ 12.5%", "rank-r limit @ 50%",
                          "block-local @ 50%", "rank-r limit @ 100%", "block-local @ 100%"]
    for row in rows.values():
        assert row["limit"] and row["failure"] is None and len(row["per_layer"]) == 2
        assert len(row["per_head"][0][0]) == 2 and row["mean"] == pytest.approx(sum(row["per_layer"]) / 2)
    assert rows["rank-r limit @ 12.5%"]["mean"] > rows["rank-r limit @ 50%"]["mean"] > 1e-3
    assert rows["rank-r limit @ 100%"]["mean"] < 1e-10 and rows["block-local @ 100%"]["mean"] < 1e-12
    q, k, v = inputs[0]
    running_mean = v.cumsum(2) / torch.arange(1, 49, dtype=v.dtype)[:, None]  # causal uniform attention
    assert rows[limits.UNIFORM]["per_layer"][0] == pytest.approx(relative_error(running_mean, refs[0]))


def test_sharpness_rows_are_the_per_layer_sharpness_and_its_mean():
    inputs = [_qkv(seed=s) for s in range(3)]
    rows = limits.sharpness_rows(inputs, scale=0.5, causal=True)
    per_layer = [attention_sharpness(q, k, 0.5, causal=True, top=limits.TOP_KEYS) for q, k, _ in inputs]
    assert rows["per_layer"] == per_layer and rows["top"] == limits.TOP_KEYS
    assert rows["entropy"] == pytest.approx(sum(s["entropy"] for s in per_layer) / 3)
    headers, body = limits.sharpness_table([("A", rows), ("B", rows)])
    assert headers[1:] == ["A", "B"] and body[0][0] == "entropy (nats)" and body[0][1] == f"{rows['entropy']:.3f}"


def test_head_errors_split_the_relative_error_by_head():
    q, k, v = _qkv()
    exact = exact_reference(q, k, v)
    out = exact + 0.1 * torch.randn_like(exact) * torch.tensor([1.0, 3.0], dtype=exact.dtype)[None, :, None, None]
    total, heads = head_errors(out, exact)
    assert total == pytest.approx(relative_error(out, exact))
    for h in range(2):
        assert heads[0][h] == pytest.approx(relative_error(out[:, h], exact[:, h]))
    assert heads[0][1] > 2 * heads[0][0]
