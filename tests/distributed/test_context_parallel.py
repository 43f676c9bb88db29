"""subquad.distributed.attention on two processes against the single-process op on the whole
sequence: this rank's rows of the output and of the gradients of q, k and v (float32, 1e-5),
causal and not, with key padding, with shards of unequal length, and cross lengths; and a whole
encoder under ``subquad.distributed.context_parallel`` (positions, short convolution, attention)
against the same encoder in one process, outputs and parameter gradients.

These tests run under ``torchrun`` (``tests/test_distributed.py`` starts ``torchrun
--nproc_per_node=2 -m pytest tests/distributed`` on gloo), where the fixture below joins the
process group once per process; collected by a plain ``pytest``, they are skipped."""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist

import subquad
import subquad.distributed as sqd
from subquad.models import Encoder

pytestmark = pytest.mark.skipif("WORLD_SIZE" not in os.environ,
                                reason="runs under torchrun (tests/test_distributed.py starts it)")


@pytest.fixture(scope="module", autouse=True)
def process_group():
    # a rank that fails between collectives leaves the others waiting: time out, never hang
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    yield
    dist.destroy_process_group()


B, H, D, DV = 2, 3, 8, 5
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _options(method: str) -> dict:
    """Options with every random or learned tensor fixed, the same on every rank."""
    g = torch.Generator().manual_seed(7)
    if method == "performer":
        from subquad.ops.performer import random_projection
        return {"features": random_projection(16, D, generator=g), "chunk_size": 4}
    if method == "hedgehog":
        return {"weight": torch.randn(H, D, D, generator=g) * 0.5, "bias": torch.randn(H, 1, D, generator=g) * 0.1,
                "chunk_size": 4}
    if method == "linear":
        return {"chunk_size": 4}
    return {}


def _parts(x: torch.Tensor, lengths: list[int], dim: int) -> torch.Tensor:
    """This rank's part of ``x`` when the ranks hold ``lengths`` positions along ``dim``."""
    return x.split(lengths, dim)[dist.get_rank()]


def _check(method: str, causal: bool, q_lengths: list[int], k_lengths: list[int], padded: bool,
           options: dict | None = None, sharded_options: dict | None = None) -> None:
    g = torch.Generator().manual_seed(0)  # the same full tensors on every rank
    N, M = sum(q_lengths), sum(k_lengths)
    q, k = torch.randn(B, H, N, D, generator=g), torch.randn(B, H, M, D, generator=g)
    v, w = torch.randn(B, H, M, DV, generator=g), torch.randn(B, H, N, DV, generator=g)
    mask = None
    if padded:  # item 0: random padding; item 1: every key of the last rank padded
        mask = torch.rand(B, M, generator=g) < 0.3
        mask[1] = False
        mask[1, M - k_lengths[-1]:] = True
    options = _options(method) if options is None else options
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = subquad.attention(*full, method=method, causal=causal, key_padding_mask=mask, **options)
    (ref * w).sum().backward()
    mine = [_parts(t, n, 2).clone().requires_grad_() for t, n in ((q, q_lengths), (k, k_lengths), (v, k_lengths))]
    out = sqd.attention(*mine, method=method, causal=causal,
                        key_padding_mask=None if mask is None else _parts(mask, k_lengths, 1),
                        **(options if sharded_options is None else sharded_options))
    (out * _parts(w, q_lengths, 2)).sum().backward()
    torch.testing.assert_close(out, _parts(ref.detach(), q_lengths, 2), **TOL)
    for a, b, n in zip(mine, full, (q_lengths, k_lengths, k_lengths)):
        torch.testing.assert_close(a.grad, _parts(b.grad, n, 2), **TOL)


CAUSAL = ["linear", "performer", "hedgehog", "softmax"]
LENGTHS = {"even": [6, 6], "uneven": [3, 8], "one token": [1, 5]}


def test_two_ranks():
    assert dist.get_world_size() == 2


def test_supported_methods():
    assert set(sqd.supported_methods()) == {"linear", "performer", "hedgehog", "efficient", "softmax", "hybrid"}


@pytest.mark.parametrize("lengths", list(LENGTHS), ids=list(LENGTHS))
@pytest.mark.parametrize("padded", [False, True], ids=["dense", "padded"])
@pytest.mark.parametrize("method", CAUSAL)
def test_causal_equals_the_whole_sequence(method, padded, lengths):
    _check(method, True, LENGTHS[lengths], LENGTHS[lengths], padded)


@pytest.mark.parametrize("padded", [False, True], ids=["dense", "padded"])
@pytest.mark.parametrize("method", CAUSAL + ["efficient"])
def test_non_causal_equals_the_whole_sequence(method, padded):
    _check(method, False, [4, 7], [4, 7], padded)


@pytest.mark.parametrize("method", CAUSAL + ["efficient"])
def test_cross_lengths(method):
    """Non-causal, queries and keys split differently (q: 5 + 4, k: 3 + 8)."""
    _check(method, False, [5, 4], [3, 8], True)


@pytest.mark.parametrize("causal", [False, True])
def test_performer_draws_rank_zeros_projection(causal):
    """Without ``features``, each rank's generator differs; the projection is rank 0's."""
    options = {"num_features": 16, "chunk_size": 4, "generator": torch.Generator().manual_seed(11)}
    mine = dict(options, generator=torch.Generator().manual_seed(11 + 5 * dist.get_rank()))
    _check("performer", causal, [6, 6], [6, 6], False, options=options, sharded_options=mine)


def test_unsupported_method_and_options_are_refused():
    x = torch.randn(1, 1, 4, D)
    with pytest.raises(NotImplementedError, match="no context-parallel form"):
        sqd.attention(x, x, x, method="nystrom")
    with pytest.raises(NotImplementedError, match="window=0"):
        sqd.attention(x, x, x, method="hedgehog", window=2)
    with pytest.raises(NotImplementedError, match="dropout"):
        sqd.attention(x, x, x, method="softmax", dropout_p=0.1)
    with pytest.raises(NotImplementedError, match="not causal"):
        sqd.attention(x, x, x, method="efficient", causal=True)


@pytest.mark.parametrize("method", ["linear", "softmax"])
def test_bf16_autocast(method):
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, H, 6, D, generator=g) for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = sqd.attention(q, k, v, method=method, causal=True)
    assert out.dtype == torch.float32 and out.shape == (B, H, 6, D) and torch.isfinite(out).all()


def test_shard_splits_like_tensor_split():
    x = torch.arange(11).view(1, 1, 11, 1)
    assert sqd.shard(x, dim=2).flatten().tolist() == ([0, 1, 2, 3, 4, 5] if dist.get_rank() == 0 else
                                                      [6, 7, 8, 9, 10])


@pytest.mark.parametrize("n", [6, 40])
def test_linear_traffic_does_not_grow_with_n(n):
    """LASP-2's exchange: forward, one all-gather of R states (B, H, F, Dv + 1); backward, one
    all-reduce of the same; nothing of size N."""
    q, k, v = (torch.randn(B, H, n, D, requires_grad=True) for _ in range(3))
    with sqd.traffic() as forward:
        out = sqd.attention(q, k, v, method="linear", causal=True)
    with sqd.traffic() as backward:
        out.sum().backward()
    state = 2 * B * H * D * (D + 1) * 4  # 2 ranks x (F = D features) x (Dv + 1) float32
    assert forward == {"bytes": state, "calls": 1} and backward == {"bytes": state, "calls": 1}


def test_ring_traffic():
    """Forward: the shard lengths, then R - 1 sends of k and v; backward: R sends of k, v and their
    gradients."""
    q, k, v = (torch.randn(B, H, 6, D, requires_grad=True) for _ in range(3))
    with sqd.traffic() as forward:
        out = sqd.attention(q, k, v, method="softmax", causal=True)
    with sqd.traffic() as backward:
        out.sum().backward()
    shard = B * H * 6 * D * 4
    assert forward == {"bytes": 2 * 2 * 8 + 2 * shard, "calls": 2}
    assert backward == {"bytes": 2 * 4 * shard, "calls": 2}


HYBRID = {"query_block": 4, "key_block": 2, "num_blocks": 2, "sinks": 1, "local": 1}


@pytest.mark.parametrize("score", ["mean", "mean_query"])
@pytest.mark.parametrize("lengths", [[24, 24], [24, 9], [32, 21]], ids=["even", "uneven", "longer"])
@pytest.mark.parametrize("key_block", [2, 4])
def test_hybrid_causal_equals_the_whole_sequence(lengths, key_block, score):
    _check("hybrid", True, lengths, lengths, False, options=dict(HYBRID, key_block=key_block, score=score))


def test_hybrid_short_sequence_is_exact_attention():
    """When the selection takes every block, hybrid is exact attention: the ring runs it."""
    _check("hybrid", True, [4, 2], [4, 2], False, options=HYBRID)


def test_hybrid_refuses_what_it_cannot_shard():
    x = torch.randn(1, 1, 16, D)
    with pytest.raises(NotImplementedError, match="causal"):
        sqd.attention(x, x, x, method="hybrid", **HYBRID)
    with pytest.raises(NotImplementedError, match="key_padding_mask"):
        sqd.attention(x, x, x, method="hybrid", causal=True, key_padding_mask=torch.zeros(1, 16, dtype=torch.bool),
                      **HYBRID)
    with pytest.raises(NotImplementedError, match="top_p"):
        sqd.attention(x, x, x, method="hybrid", causal=True, top_p=0.5, **HYBRID)
    with pytest.raises(ValueError, match="dense prefix"):
        sqd.attention(x[:, :, :8], x[:, :, :8], x[:, :, :8], method="hybrid", causal=True, **HYBRID)
    with pytest.raises(ValueError, match="whole query blocks"):
        y = x[:, :, : 13 - 2 * dist.get_rank()]  # rank 0: 13 tokens
        sqd.attention(y, y, y, method="hybrid", causal=True, **HYBRID)


@pytest.mark.parametrize("lengths", [[24, 24], [40, 9]], ids=["even", "rank 0 more rounds"])
def test_hybrid_in_several_rounds(lengths, monkeypatch):
    """Two query blocks a round: several rounds of fetches, forward and backward, and a rank with
    fewer query blocks serving in rounds where it computes nothing."""
    import subquad.ops.hybrid.sharded as sharded

    monkeypatch.setattr(sharded, "ROUND_BLOCKS", 2)
    _check("hybrid", True, lengths, lengths, False, options=HYBRID)


def test_hybrid_traffic_is_bounded_by_its_rounds():
    """A round fetches at most ROUND_BLOCKS x (sinks + local + num_blocks) blocks per (item, head),
    each block's keys and values, plus the wanted ids and the counts: the bytes a rank sends per
    call stay under that, whatever the data; rank 0 (the owner of rank 1's past) sends blocks."""
    import subquad.ops.hybrid.sharded as sharded

    g = torch.Generator().manual_seed(5)
    n = 24
    q, k, v = (torch.randn(B, H, n, D, generator=g).requires_grad_() for _ in range(3))
    with sqd.traffic() as forward:
        out = sqd.attention(q, k, v, method="hybrid", causal=True, **HYBRID)
    with sqd.traffic() as backward:
        out.sum().backward()
    past = HYBRID["sinks"] + HYBRID["local"] + HYBRID["num_blocks"]
    blocks = B * H * sharded.ROUND_BLOCKS * past  # per round, at most
    rounds = -(-(n // HYBRID["query_block"]) // sharded.ROUND_BLOCKS)
    bound = rounds * (blocks * 2 * HYBRID["key_block"] * D * 4 + blocks * 2 * 8 + 2 * 8) + 2 * 8 + 2 * 8 * 8
    assert 0 < forward["bytes"] <= bound and backward["bytes"] <= bound
    if dist.get_rank() == 0:  # it served rank 1's sinks block at least, forward and backward (the gradients)
        assert forward["bytes"] >= B * H * 2 * HYBRID["key_block"] * D * 4


# --------------------------------------------------------------------------- the zig-zag layout

def _check_layout(method: str, causal: bool, n: int, padded: bool, layout: str = "zigzag") -> None:
    """Every rank holds the positions ``shard(..., layout=layout)`` gives it; its output and
    gradient rows are the same positions of the single-process op's."""
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(B, H, n, D, generator=g), torch.randn(B, H, n, D, generator=g)
    v = torch.randn(B, H, n, DV, generator=g)
    w = torch.randn(B, H, n, DV, generator=g)
    mask = (torch.rand(B, n, generator=g) < 0.3) if padded else None
    options = _options(method)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = subquad.attention(*full, method=method, causal=causal, key_padding_mask=mask, **options)
    (ref * w).sum().backward()
    mine = [sqd.shard(t, 2, layout=layout).clone().requires_grad_() for t in (q, k, v)]
    out = sqd.attention(*mine, method=method, causal=causal, layout=layout, **options,
                        key_padding_mask=None if mask is None else sqd.shard(mask, 1, layout=layout))
    (out * sqd.shard(w, 2, layout=layout)).sum().backward()
    torch.testing.assert_close(out, sqd.shard(ref.detach(), 2, layout=layout), **TOL)
    for a, b in zip(mine, full):
        torch.testing.assert_close(a.grad, sqd.shard(b.grad, 2, layout=layout), **TOL)


def test_zigzag_shard_holds_parts_r_and_2r_minus_1_minus_r():
    x = torch.arange(13).view(1, 13)
    parts = x.tensor_split(4, 1)
    want = torch.cat([parts[dist.get_rank()], parts[3 - dist.get_rank()]], 1)
    assert torch.equal(sqd.shard(x, 1, layout="zigzag"), want)


@pytest.mark.parametrize("n", [12, 13, 3])
@pytest.mark.parametrize("padded", [False, True])
def test_ring_attention_zigzag_equals_the_whole_sequence(n, padded):
    _check_layout("softmax", True, n, padded)


@pytest.mark.parametrize("method", ["softmax", "linear", "efficient"])
def test_zigzag_without_causal_mask(method):
    _check_layout(method, False, 13, padded=True)


@pytest.mark.parametrize("method", ["linear", "hybrid"])
def test_causal_zigzag_is_refused_where_unbalanced_work_is_not(method):
    q = torch.randn(1, 2, 8, D)
    with pytest.raises(NotImplementedError, match="contiguous layout only"):
        sqd.attention(q, q, q, method=method, causal=True, layout="zigzag")
    with pytest.raises(ValueError, match="layout must be one of"):
        sqd.shard(q, layout="striped")


# --------------------------------------------------------------------------- a whole model

MODEL_TOL = {"rtol": 1e-4, "atol": 1e-5}


def _encoder(method: str, conv: int, **options) -> Encoder:
    torch.manual_seed(0)  # the same weights on every rank
    return Encoder(50, 7, method=method, method_options=options, dim=16, depth=2, heads=2, ffn_dim=32, max_len=64,
                   dropout=0.0, head_hidden=0, pooling="none", conv_kernel_size=conv).eval()


def _run(model: Encoder, lengths: list[int], padded: bool) -> None:
    g = torch.Generator().manual_seed(1)
    N = sum(lengths)
    tokens = torch.randint(0, 50, (2, N), generator=g)
    pad = None
    if padded:  # item 1's last positions are padding
        pad = torch.zeros(2, N, dtype=torch.bool)
        pad[1, N - max(1, N // 3):] = True
    w = torch.randn(2, N, 7, generator=g)
    ref = model(tokens, pad)
    (ref * w).sum().backward()
    want = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    mine = lambda x: x.split(lengths, 1)[dist.get_rank()]  # noqa: E731
    with sqd.context_parallel(model):
        out = model(mine(tokens), None if pad is None else mine(pad))
    (out * mine(w)).sum().backward()
    torch.testing.assert_close(out, mine(ref.detach()), **TOL)
    for name, p in model.named_parameters():
        grad = p.grad.clone()
        dist.all_reduce(grad)
        torch.testing.assert_close(grad, want[name], **MODEL_TOL, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("method,options", [("linear", {}), ("softmax", {}), ("efficient", {}),
                                            ("performer", {"num_features": 8}), ("hedgehog", {}), ("none", {})])
@pytest.mark.parametrize("padded", [False, True])
def test_encoder_equals_the_whole_sequence(method, options, padded):
    _run(_encoder(method, 3, **options), [7, 6], padded)


@pytest.mark.parametrize("lengths,conv", [([2, 1], 3), ([2, 2], 4), ([1, 5], 4), ([9, 9], 1)])
def test_short_convolution_across_the_boundary(lengths, conv):
    """Shards shorter than the convolution's reach: the tokens before come from the ranks before
    (zeros before the sequence), as in one process."""
    _run(_encoder("linear", conv), lengths, padded=False)


def test_the_model_runs_whole_again_after_the_block():
    model = _encoder("linear", 3)
    tokens = torch.randint(0, 50, (1, 10))
    before = model(tokens)
    with sqd.context_parallel(model):
        model(tokens.split([5, 5], 1)[dist.get_rank()])
    assert all(m.sequence_shards is None for m in model.modules() if hasattr(m, "sequence_shards"))
    torch.testing.assert_close(model(tokens), before)


def test_what_cannot_be_sharded_is_refused():
    pooled = Encoder(50, 7, method="linear", dim=16, heads=2, pooling="mean")
    with pytest.raises(ValueError, match="pooling='none'"):
        with sqd.context_parallel(pooled):
            pass
    with pytest.raises(ValueError, match="no context-parallel form"):
        with sqd.context_parallel(_encoder("nystrom", 0)):
            pass
    model = _encoder("softmax", 0)
    with pytest.raises(ValueError, match="exceeds max_len"):
        with sqd.context_parallel(model):
            model(torch.zeros(1, 40, dtype=torch.long))  # 80 positions on two ranks
    attn = model.blocks[0].mixer.attention
    x = torch.randn(1, 4, 16)
    with pytest.raises(ValueError, match="no attn_mask"):
        with sqd.context_parallel(attn):
            attn(x, x, x, attn_mask=torch.zeros(4, 4, dtype=torch.bool), need_weights=False)
