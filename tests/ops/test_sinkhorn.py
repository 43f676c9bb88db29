"""Sparse Sinkhorn attention op: the log-space Sinkhorn operator (column sums after every
iteration, row convergence, support, temperature limit, equivariance), the explicit reference
over every option combination, the P = I and hard-permutation limits, causality at every t,
padding invariance, SortCut, option checks and the long-sequence contract."""

from __future__ import annotations

import itertools

import pytest
import torch

import subquad.ops.sinkhorn as sinkhorn_ops
from conftest import qkv
from subquad.ops.sinkhorn import gumbel_noise, log_sinkhorn, sinkhorn_attention
from subquad.ops.sinkhorn.naive import sinkhorn_attention_reference
from subquad.ops.softmax.naive import softmax_attention_reference


def make_qkv(b=2, h=2, n=11, d=4, dv=None, seed=0, dtype=torch.float64, requires_grad=False):
    """Seeded q, k ``(b, h, n, d)``, v ``(b, h, n, dv)``."""
    return qkv(b, h, n, d, dv=dv, dtype=dtype, seed=seed, requires_grad=requires_grad)


def perturb_after(x, t, seed):
    """x with new random content at positions > t."""
    g = torch.Generator().manual_seed(seed)
    y = x.detach().clone()
    y[:, :, t + 1:] = 2.0 * torch.randn(y[:, :, t + 1:].shape, generator=g, dtype=x.dtype) + 1.0
    return y


def padding_mask(n, b=2):
    """Bool (b, n), True = padding: batch 0 has a padded token in the middle, batch 1 a padded
    tail that empties whole blocks of 3."""
    mask = torch.zeros(b, n, dtype=torch.bool)
    mask[0, 2] = True
    mask[1, 5:] = True
    return mask


# --------------------------------------------------------------------------- Sinkhorn operator


def test_columns_sum_to_one_after_every_iteration_and_rows_converge():
    """16 random 8 x 8 problems (tau = 0.75, fp32): column sums are 1 (1e-5) after each of
    K = 1..30 rounds; the worst row-sum error never grows with K, is large after one round and
    small after many (rows converge); entries are positive and finite."""
    g = torch.Generator().manual_seed(0)
    log_alpha = torch.randn(16, 8, 8, generator=g) / 0.75
    row_errors = []
    for iters in range(1, 31):
        p = log_sinkhorn(log_alpha, iters).exp()
        assert torch.isfinite(p).all() and (p > 0).all()
        torch.testing.assert_close(p.sum(-2), torch.ones(16, 8), rtol=0, atol=1e-5)
        row_errors.append((p.sum(-1) - 1).abs().max().item())
    assert all(b <= a + 1e-6 for a, b in zip(row_errors, row_errors[1:])), row_errors
    assert row_errors[0] > 5e-2
    assert row_errors[9] < 5e-3
    assert row_errors[29] < 1e-5


def test_log_space_survives_extreme_logits():
    """Logits in [-1e4, 1e4] (fp32): finite, columns still sum to 1."""
    g = torch.Generator().manual_seed(1)
    log_alpha = (torch.rand(4, 6, 6, generator=g) * 2 - 1) * 1e4
    p = log_sinkhorn(log_alpha, 7).exp()
    assert torch.isfinite(p).all()
    torch.testing.assert_close(p.sum(-2), torch.ones(4, 6), rtol=0, atol=1e-5)


def test_support_entries_outside_are_exactly_zero():
    """Entries outside the support are exactly 0 for every K; a line with no allowed entry is
    all zero; on the allowed square sub-block the result equals Sinkhorn of the sub-block."""
    g = torch.Generator().manual_seed(2)
    log_alpha = torch.randn(5, 5, generator=g, dtype=torch.float64)
    valid = torch.tensor([True, False, True, True, False])
    support = valid[:, None] & valid[None, :]
    for iters in (1, 3, 7):
        p = log_sinkhorn(log_alpha, iters, support).exp()
        assert torch.equal(p[~support], torch.zeros_like(p[~support]))
        sub = log_sinkhorn(log_alpha[valid][:, valid], iters).exp()
        torch.testing.assert_close(p[valid][:, valid], sub, rtol=0, atol=1e-14)


def test_permutation_equivariance():
    """S(Pr R Pc) = Pr S(R) Pc for permutation matrices Pr, Pc."""
    g = torch.Generator().manual_seed(3)
    r = torch.randn(7, 7, generator=g, dtype=torch.float64)
    rows, cols = torch.randperm(7, generator=g), torch.randperm(7, generator=g)
    p = log_sinkhorn(r, 5).exp()
    p_perm = log_sinkhorn(r[rows][:, cols], 5).exp()
    torch.testing.assert_close(p_perm, p[rows][:, cols], rtol=0, atol=1e-14)


def test_row_constant_is_removed():
    """Adding a constant to each row of log alpha changes nothing (the first row step removes it)."""
    g = torch.Generator().manual_seed(4)
    r = torch.randn(6, 6, generator=g, dtype=torch.float64)
    shift = torch.randn(6, 1, generator=g, dtype=torch.float64) * 10
    torch.testing.assert_close(log_sinkhorn(r + shift, 3), log_sinkhorn(r, 3), rtol=0, atol=1e-12)


def test_low_temperature_approaches_the_best_assignment():
    """As tau -> 0 (no noise) P approaches the 0/1 matrix of the assignment maximising
    sum P_ij R_ij (found by brute force over all 6! permutations)."""
    g = torch.Generator().manual_seed(5)
    target = torch.randperm(6, generator=g)
    r = torch.rand(6, 6, generator=g, dtype=torch.float64) * 0.5
    r[torch.arange(6), target] += 0.6
    best = max(itertools.permutations(range(6)), key=lambda p: sum(r[i, p[i]].item() for i in range(6)))
    hard = torch.zeros(6, 6, dtype=torch.float64)
    hard[torch.arange(6), torch.tensor(best)] = 1.0
    err = {tau: (log_sinkhorn(r / tau, 200).exp() - hard).abs().max().item() for tau in (0.3, 0.05, 0.01)}
    assert err[0.3] > err[0.05] > err[0.01]
    assert err[0.01] < 1e-3


def test_gumbel_noise_seeded_and_standard():
    """Same seed, same noise; the mean is the Euler-Mascheroni constant 0.5772."""
    a = gumbel_noise((200_000,), generator=torch.Generator().manual_seed(0))
    b = gumbel_noise((200_000,), generator=torch.Generator().manual_seed(0))
    assert torch.equal(a, b) and torch.isfinite(a).all()
    assert abs(a.double().mean().item() - 0.5772) < 0.01


# --------------------------------------------------------------------------- op vs reference


CASES = [
    # (causal, top_blocks, sortcut_blocks)
    (False, 1, 0), (False, 2, 0), (False, 3, 0), (False, 1, 2), (True, 1, 0), (True, 2, 0),
]


def use_batched_path(monkeypatch):
    """Route the op through the all-heads path that runs off CPU (joint blocks by a custom
    autograd function, one batched attention call) instead of the CPU's per-head loop."""

    def batched(qc, kc, vc, perms, slot_ok, slot_bias, keep, causal, b, scale):
        keys, values = sinkhorn_ops._JointBlocks.apply(perms, kc, b), sinkhorn_ops._JointBlocks.apply(perms, vc, b)
        return sinkhorn_ops._blocked(qc, keys, values, slot_ok, slot_bias, keep, causal, b, scale)

    monkeypatch.setattr(sinkhorn_ops, "_blocked_per_head", batched)


PATHS = ["per_head", "per_head_autograd", "batched"]


@pytest.mark.parametrize("causal, top_blocks, sortcut", CASES)
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
@pytest.mark.parametrize("given_logits", [False, True], ids=["default_logits", "given_logits"])
@pytest.mark.parametrize("path", PATHS)
def test_matches_reference(causal, top_blocks, sortcut, masked, given_logits, path, monkeypatch):
    """N = 11 with blocks of 3 (internal padding of one token), with and without a key padding
    mask that empties whole blocks, default or given sorting logits: equals the slow reference
    (loops over blocks, probability-space Sinkhorn, explicit per-query softmax). On each path:
    the CPU's per-head loop without autograd (reused buffers) and with it, and the batched one."""
    if path == "batched":
        use_batched_path(monkeypatch)
    q, k, v = make_qkv(n=11, dv=5, requires_grad=path == "per_head_autograd")
    mask = padding_mask(11) if masked else None
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(2, 1, 4, 4, generator=g, dtype=torch.float64) * 2 if given_logits else None
    opts = dict(block_size=3, top_blocks=top_blocks, sortcut_blocks=sortcut, sort_logits=logits)
    out = sinkhorn_attention(q, k, v, key_padding_mask=mask, causal=causal, **opts)
    ref = sinkhorn_attention_reference(q, k, v, mask, causal, **opts)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("causal, top_blocks", [(False, 1), (False, 2), (True, 2)])
def test_per_head_and_batched_paths_have_equal_gradients(causal, top_blocks, monkeypatch):
    """Masked, with given sorting logits that need a gradient too (the bias of partly padded
    slots depends on them): both paths give the same gradients for q, k, v and the logits."""
    q, k, v = make_qkv(n=11, dv=5, requires_grad=True)
    logits = torch.randn(2, 2, 4, 4, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    logits.requires_grad_()
    inputs = (q, k, v, logits)

    def grads():
        out = sinkhorn_attention(q, k, v, key_padding_mask=padding_mask(11), causal=causal, block_size=3,
                                 top_blocks=top_blocks, sort_logits=logits)
        return torch.autograd.grad(out.square().sum(), inputs)

    per_head = grads()
    use_batched_path(monkeypatch)
    for a, b in zip(per_head, grads()):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_training_noise_is_gumbel_from_the_generator(causal):
    """training=True adds Gumbel noise drawn from ``generator``: equals the reference given the
    same noise; same seed, same output; another seed, another output; training=False is
    deterministic and noise-free."""
    q, k, v = make_qkv(n=12)
    opts = dict(block_size=3, causal=causal, tau=0.5)
    noisy = sinkhorn_attention(q, k, v, training=True, generator=torch.Generator().manual_seed(1), **opts)
    again = sinkhorn_attention(q, k, v, training=True, generator=torch.Generator().manual_seed(1), **opts)
    other = sinkhorn_attention(q, k, v, training=True, generator=torch.Generator().manual_seed(2), **opts)
    assert torch.equal(noisy, again)
    assert not torch.allclose(noisy, other, atol=1e-6)
    noise = gumbel_noise((2, 2, 4, 4), generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ref = sinkhorn_attention_reference(q, k, v, None, causal, block_size=3, tau=0.5, noise=noise)
    torch.testing.assert_close(noisy, ref, rtol=0, atol=1e-12)
    clean = sinkhorn_attention(q, k, v, **opts)
    torch.testing.assert_close(clean, sinkhorn_attention_reference(q, k, v, None, causal, block_size=3, tau=0.5),
                               rtol=0, atol=1e-12)


# --------------------------------------------------------------------------- limits


def block_attention(q, k, v, b, sources):
    """Block i attends to [block sources[i] ; block i] with one exact softmax."""
    outs = []
    for i, j in enumerate(sources):
        qi = q[:, :, i * b:(i + 1) * b]
        keys = torch.cat([k[:, :, j * b:(j + 1) * b], k[:, :, i * b:(i + 1) * b]], dim=2)
        vals = torch.cat([v[:, :, j * b:(j + 1) * b], v[:, :, i * b:(i + 1) * b]], dim=2)
        outs.append(softmax_attention_reference(qi, keys, vals))
    return torch.cat(outs, dim=2)


def test_hard_permutation_moves_whole_blocks():
    """Logits peaked on a permutation pi with tau -> 0 and no noise give a hard P: block i
    attends exactly to [block pi(i) ; block i] (one fixed point included)."""
    q, k, v = make_qkv(n=20, dv=3)
    pi = [3, 0, 2, 4, 1]  # block 2 keeps itself
    logits = torch.zeros(1, 1, 5, 5, dtype=torch.float64)
    logits[0, 0, torch.arange(5), torch.tensor(pi)] = 50.0
    out = sinkhorn_attention(q, k, v, block_size=4, sort_logits=logits, tau=0.01)
    torch.testing.assert_close(out, block_attention(q, k, v, 4, pi), rtol=0, atol=1e-12)


def test_identity_permutation_is_block_local_attention():
    """P = I: every block attends to two copies of itself in one softmax, which is plain
    block-local attention (duplicated keys split their weight)."""
    q, k, v = make_qkv(n=18, dv=3)
    logits = torch.eye(6, dtype=torch.float64)[None, None] * 50.0
    out = sinkhorn_attention(q, k, v, block_size=3, sort_logits=logits, tau=0.01)
    local = torch.cat(
        [softmax_attention_reference(*(x[:, :, i:i + 3] for x in (q, k, v))) for i in range(0, 18, 3)], dim=2
    )
    torch.testing.assert_close(out, local, rtol=0, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_single_block_is_exact_attention(causal):
    """N <= block_size: one block, P = [[1]] (causal: a null block), so the result is exact
    softmax attention."""
    q, k, v = make_qkv(n=9, dv=5)
    mask = padding_mask(9)
    out = sinkhorn_attention(q, k, v, key_padding_mask=mask, causal=causal, block_size=64)
    ref = softmax_attention_reference(q, k, v, key_padding_mask=mask, causal=causal)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)


# --------------------------------------------------------------------------- causality


@pytest.mark.parametrize("top_blocks", [1, 2])
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
@pytest.mark.parametrize("given_logits", [False, True], ids=["default_logits", "given_logits"])
def test_causal_no_leak_at_every_t(top_blocks, masked, given_logits):
    """N = 14, blocks of 4 (so t = 3, 4, 7, 8, 11, 12 are block boundaries), Gumbel noise on
    from identically seeded generators: for every t, new q/k/v content after t leaves outputs
    0..t bit-for-bit unchanged, and the gradient of outputs 0..t w.r.t. q, k, v after t is
    exactly zero."""
    n = 14
    q, k, v = make_qkv(n=n, dv=3, requires_grad=True)
    mask = padding_mask(n) if masked else None
    logits = None
    if given_logits:  # lower triangle used only; upper entries may be anything
        logits = torch.randn(2, 2, 4, 4, generator=torch.Generator().manual_seed(3), dtype=torch.float64)

    def run(q, k, v):
        return sinkhorn_attention(
            q, k, v, key_padding_mask=mask, causal=True, block_size=4, top_blocks=top_blocks,
            sort_logits=logits, training=True, generator=torch.Generator().manual_seed(11),
        )

    out = run(q, k, v)
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(4), dtype=out.dtype)
    for t in range(n):
        out2 = run(perturb_after(q, t, t), perturb_after(k, t, 50 + t), perturb_after(v, t, 90 + t))
        assert torch.equal(out2[:, :, :t + 1], out[:, :, :t + 1]), f"outputs up to t={t} changed"
        grads = torch.autograd.grad((out[:, :, :t + 1] * cot[:, :, :t + 1]).sum(), (q, k, v), retain_graph=True)
        for name, g in zip("qkv", grads):
            assert torch.equal(g[:, :, t + 1:], torch.zeros_like(g[:, :, t + 1:])), f"d out[:{t + 1}] / d {name}"
        assert any(g[:, :, : t + 1].abs().sum() > 0 for g in grads)


def test_causal_block_zero_is_causal_local_attention():
    """Block 0 has no earlier block (a null block): its rows equal causal exact attention over
    the block alone."""
    q, k, v = make_qkv(n=12, dv=3)
    out = sinkhorn_attention(q, k, v, causal=True, block_size=4)
    ref = softmax_attention_reference(q[:, :, :4], k[:, :, :4], v[:, :, :4], causal=True)
    torch.testing.assert_close(out[:, :, :4], ref, rtol=0, atol=1e-12)


def test_column_normalisation_on_the_causal_support_would_leak():
    """Why the causal path normalises rows only: full Sinkhorn on the strictly-lower support
    lets a later row's logits change an earlier row of P (column sums run over later rows)."""
    g = torch.Generator().manual_seed(6)
    r = torch.randn(5, 5, generator=g, dtype=torch.float64)
    support = torch.ones(5, 5, dtype=torch.bool).tril(-1)
    r2 = r.clone()
    r2[4] += torch.randn(5, generator=g, dtype=torch.float64) * 3  # only the last row changes
    p, p2 = log_sinkhorn(r, 3, support).exp(), log_sinkhorn(r2, 3, support).exp()
    assert (p[2] - p2[2]).abs().max() > 1e-3


# --------------------------------------------------------------------------- padding


@pytest.mark.parametrize("causal, top_blocks", [(False, 1), (False, 2), (True, 2)])
def test_padding_invariance(causal, top_blocks):
    """New q/k/v content at padded positions leaves every real output unchanged (1e-12); a fully
    padded batch row outputs zeros."""
    n = 13
    q, k, v = make_qkv(b=3, n=n, dv=3)
    mask = torch.zeros(3, n, dtype=torch.bool)
    mask[0, [1, 5, 6, 7]] = True
    mask[1, 6:] = True
    mask[2] = True
    opts = dict(key_padding_mask=mask, causal=causal, block_size=3, top_blocks=top_blocks)
    out = sinkhorn_attention(q, k, v, **opts)
    where = mask[:, None, :, None]
    g = torch.Generator().manual_seed(9)
    q2, k2, v2 = (torch.where(where, torch.randn(x.shape, generator=g, dtype=x.dtype) * 5, x) for x in (q, k, v))
    out2 = sinkhorn_attention(q2, k2, v2, **opts)
    real = ~where.expand_as(out)
    torch.testing.assert_close(out2[real], out[real], rtol=0, atol=1e-12)
    assert torch.isfinite(out2).all()
    assert torch.equal(out[2], torch.zeros_like(out[2]))


def test_trailing_padding_blocks_change_nothing():
    """Appending whole blocks of padding leaves the real outputs unchanged (empty blocks are
    dropped from the Sinkhorn problem), and a length that is not a multiple of the block size
    equals the explicitly padded input with a mask."""
    q, k, v = make_qkv(b=1, n=10, dv=3)
    base = sinkhorn_attention(q, k, v, block_size=4, top_blocks=2)
    for extra in (2, 6, 10):
        pad = [torch.cat([x, torch.randn(1, 2, extra, x.shape[-1], dtype=x.dtype)], dim=2) for x in (q, k, v)]
        mask = torch.zeros(1, 10 + extra, dtype=torch.bool)
        mask[:, 10:] = True
        out = sinkhorn_attention(*pad, key_padding_mask=mask, block_size=4, top_blocks=2)
        torch.testing.assert_close(out[:, :, :10], base, rtol=0, atol=1e-12)


# --------------------------------------------------------------------------- SortCut


def test_sortcut_is_global_attention_over_the_first_sorted_blocks():
    """SortCut with given logits: every query attends to exactly the n * b keys/values of the
    first n sorted blocks (sum_j P_ij K_j for i < n), in one softmax, with no local block."""
    q, k, v = make_qkv(n=12, dv=3)
    logits = torch.randn(2, 2, 4, 4, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    out = sinkhorn_attention(q, k, v, block_size=3, sortcut_blocks=2, sort_logits=logits)
    p = log_sinkhorn(logits / 0.75, 7).exp()[:, :, :2]  # (B, H, 2, 4)
    keys = (p @ k.unflatten(2, (4, 3)).flatten(-2)).unflatten(-1, (3, 4)).flatten(2, 3)
    vals = (p @ v.unflatten(2, (4, 3)).flatten(-2)).unflatten(-1, (3, 3)).flatten(2, 3)
    assert keys.shape[2] == 6
    torch.testing.assert_close(out, softmax_attention_reference(q, keys, vals), rtol=0, atol=1e-12)


def test_sortcut_does_not_depend_on_query_blocks():
    """With the sorting fixed, a query's SortCut output depends on that query alone: permuting
    the queries across blocks permutes the outputs."""
    q, k, v = make_qkv(n=12, dv=3)
    logits = torch.randn(2, 2, 4, 4, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    opts = dict(block_size=3, sortcut_blocks=2, sort_logits=logits)
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(0))
    out = sinkhorn_attention(q, k, v, **opts)
    out_perm = sinkhorn_attention(q[:, :, perm], k, v, **opts)
    torch.testing.assert_close(out_perm, out[:, :, perm], rtol=0, atol=1e-12)


def test_sortcut_refuses_causal_and_several_top_blocks():
    q, k, v = make_qkv(n=12)
    with pytest.raises(NotImplementedError, match="SortCut"):
        sinkhorn_attention(q, k, v, causal=True, block_size=3, sortcut_blocks=1)
    with pytest.raises(ValueError, match="top_blocks"):
        sinkhorn_attention(q, k, v, block_size=3, sortcut_blocks=1, top_blocks=2)


# --------------------------------------------------------------------------- options, dtypes, gradients


@pytest.mark.parametrize(
    "opts, error, match",
    [
        ({"block_size": 0}, ValueError, "block_size"),
        ({"sinkhorn_iters": 0}, ValueError, "sinkhorn_iters"),
        ({"tau": 0.0}, ValueError, "tau"),
        ({"top_blocks": 0}, ValueError, "top_blocks"),
        ({"sortcut_blocks": -1}, ValueError, "sortcut_blocks"),
        ({"training": 1}, TypeError, "training"),
        ({"generator": 3}, TypeError, "generator"),
        ({"sort_logits": torch.zeros(2, 2, 4)}, ValueError, "sort_logits"),
        ({"sort_logits": torch.zeros(2, 2, 3, 3)}, ValueError, r"sort_logits must have shape \(B, H, NB, NB\)"),
    ],
)
def test_option_errors(opts, error, match):
    q, k, v = make_qkv(n=12)
    with pytest.raises(error, match=match):
        sinkhorn_attention(q, k, v, block_size=opts.pop("block_size", 3), **opts)


def test_self_attention_only():
    q, _, _ = make_qkv(n=6)
    _, k, v = make_qkv(n=9)
    with pytest.raises(ValueError, match="self-attention only"):
        sinkhorn_attention(q, k, v)


@pytest.mark.parametrize("causal", [False, True])
def test_bf16_autocast_computes_in_float32(causal):
    """Under bf16 autocast the math runs in float32: bf16 inputs give the float32 result on the
    same (rounded) inputs, returned in bf16."""
    q, k, v = (x.bfloat16() for x in make_qkv(n=21, d=8, dtype=torch.float32))
    mask = torch.zeros(2, 21, dtype=torch.bool)
    mask[1, 15:] = True
    opts = dict(key_padding_mask=mask, causal=causal, block_size=4, top_blocks=2)
    ref = sinkhorn_attention(q.float(), k.float(), v.float(), **opts)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = sinkhorn_attention(q, k, v, **opts)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)


@pytest.mark.slow  # float64 gradcheck through the sort network (15 s); the generic sweep has a faster one
@pytest.mark.parametrize("causal, top_blocks", [(False, 2), (True, 2), (False, 1)])
def test_gradcheck_through_sinkhorn(causal, top_blocks):
    """float64 gradcheck with several blocks, partial-padding blocks and given logits, so the
    gradient runs through the Sinkhorn iterations and the padded-slot weights."""
    q, k, v = make_qkv(b=1, n=8, d=3, requires_grad=True)
    logits = torch.randn(1, 2, 3, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    logits.requires_grad_(True)
    mask = torch.zeros(1, 8, dtype=torch.bool)
    mask[0, [2, 7]] = True

    def fn(q, k, v, logits):
        return sinkhorn_attention(q, k, v, key_padding_mask=mask, causal=causal, block_size=3,
                                  top_blocks=top_blocks, sort_logits=logits)

    def fn_default(q, k, v):
        return sinkhorn_attention(q, k, v, key_padding_mask=mask, causal=causal, block_size=3, top_blocks=top_blocks)

    assert torch.autograd.gradcheck(fn, (q, k, v, logits), eps=1e-6, atol=1e-6, rtol=1e-4)
    assert torch.autograd.gradcheck(fn_default, (q, k, v), eps=1e-6, atol=1e-6, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("causal", [False, True])
def test_long_sequence_forward_backward(causal):
    """N = 131072 (B=1, H=1, D=32), block 64, padded tail and a length that is not a multiple
    of the block size, forward and backward in float32: nothing of size N x N is formed (it
    would be 64 GiB); outputs and gradients are finite."""
    n = 131072 - 5
    q, k, v = make_qkv(b=1, h=1, n=n, d=32, dtype=torch.float32, requires_grad=True)
    mask = torch.zeros(1, n, dtype=torch.bool)
    mask[0, -1000:] = True
    out = sinkhorn_attention(q, k, v, key_padding_mask=mask, causal=causal, block_size=64)
    assert out.shape == (1, 1, n, 32) and torch.isfinite(out).all()
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(torch.isfinite(g).all() for g in grads)
    assert grads[1].abs().sum() > 0
