"""Encoder built from any registered method: padding never leaks, pooling uses real tokens only,
the mixer factory covers attention methods and token mixers, bad arguments are clear errors."""

from __future__ import annotations

import pytest
import torch

import subquad
from subquad.layers.attention import MultiheadAttention
from subquad.models import AttentionMixer, Encoder, build_mixer, sinusoidal_positions

METHODS = [m.name for m in subquad.list_methods()]
# Options that suit tiny shapes (N = 24, head dim 8); methods not listed use their defaults.
TINY_OPTIONS = {
    "nystrom": {"num_landmarks": 4},
    "performer": {"num_features": 16},
    "lara": {"num_landmarks": 4},
    "sinkhorn": {"block_size": 4},
}


def _tiny_encoder(method: str, **kwargs) -> Encoder:
    torch.manual_seed(0)
    args = dict(method=method, method_options=TINY_OPTIONS.get(method, {}), dim=16, depth=2, heads=2,
                ffn_dim=32, max_len=32, dropout=0.0, head_hidden=8)
    args.update(kwargs)
    return Encoder(16, 10, **args).double()


def _batch(n: int = 24):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(1, 16, (4, n), generator=g)
    pad = torch.zeros(4, n, dtype=torch.bool)
    pad[1, n - 5:] = True
    pad[2, 7:] = True
    pad[3, 1:] = True  # a single real token
    return tokens.masked_fill(pad, 0), pad


def _seeded(fn, seed: int = 123):
    """Call ``fn`` with the global RNG at a fixed state (stochastic methods draw from it)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return fn()


@pytest.mark.parametrize("method", METHODS)
def test_padding_never_reaches_real_tokens(method):
    """Changing the tokens at padded positions leaves every logit unchanged (train and eval)."""
    model = _tiny_encoder(method)
    tokens, pad = _batch()
    other = tokens.masked_fill(pad, 7)
    for training in (False, True):
        model.train(training)
        a = _seeded(lambda: model(tokens, pad))
        b = _seeded(lambda: model(other, pad))
        assert a.shape == (4, 10) and a.dtype == torch.float64
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("method", METHODS)
def test_gradients_reach_the_mixer(method):
    model = _tiny_encoder(method)
    tokens, pad = _batch()
    loss = torch.nn.functional.cross_entropy(_seeded(lambda: model(tokens, pad)), torch.arange(4))
    loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if ".mixer." in n]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)
    assert torch.isfinite(model.token_embedding.weight.grad).all()


def test_pooling_averages_real_tokens_only():
    model = _tiny_encoder("softmax")
    states = torch.randn(3, 5, 16, dtype=torch.float64)
    pad = torch.tensor([[False] * 5, [False, False, True, True, True], [True] * 5])
    pooled = model.pool(states, pad)
    torch.testing.assert_close(pooled[0], states[0].mean(0))
    torch.testing.assert_close(pooled[1], states[1, :2].mean(0))
    assert torch.equal(pooled[2], torch.zeros(16, dtype=torch.float64))  # no real token
    torch.testing.assert_close(model.pool(states, None), states.mean(1))


def test_fully_padded_row_is_finite():
    model = _tiny_encoder("nystrom").eval()
    tokens = torch.zeros(2, 24, dtype=torch.int64)
    pad = torch.ones(2, 24, dtype=torch.bool)
    assert torch.isfinite(model(tokens, pad)).all()


def test_mixer_factory_builds_both_kinds():
    attn = build_mixer("nystrom", 16, 2, num_landmarks=4, conv_kernel_size=3)
    assert isinstance(attn, AttentionMixer) and isinstance(attn.attention, MultiheadAttention)
    assert attn.attention.method == "nystrom" and attn.attention.batch_first
    x = torch.randn(2, 9, 16)
    assert attn(x, key_padding_mask=torch.zeros(2, 9, dtype=torch.bool)).shape == (2, 9, 16)
    mixers = [m for m in subquad.list_methods() if m.kind == "mixer"]
    for info in mixers:
        module = build_mixer(info.name, 16, 2)
        assert isinstance(module, info.module)
        assert module(x, key_padding_mask=None).shape == (2, 9, 16)


def test_mixer_factory_errors():
    with pytest.raises(ValueError, match="unknown method 'nope'.*softmax"):
        build_mixer("nope", 16, 2)
    with pytest.raises(ValueError, match="unknown option"):
        build_mixer("nystrom", 16, 2, landmarks=4)
    with pytest.raises(ValueError, match="attention weights"):
        build_mixer("linear", 16, 2, attention_dropout=0.1)
    mixers = [m.name for m in subquad.list_methods() if m.kind == "mixer"]
    for name in mixers:
        with pytest.raises(ValueError, match="unknown option"):
            build_mixer(name, 16, 2, not_an_option=1)


def test_softmax_attention_dropout_is_used_in_training_only():
    model = _tiny_encoder("softmax", attention_dropout=0.5)
    tokens, pad = _batch()
    model.eval()
    torch.testing.assert_close(_seeded(lambda: model(tokens, pad), 1), _seeded(lambda: model(tokens, pad), 2))
    model.train()
    assert not torch.allclose(_seeded(lambda: model(tokens, pad), 1), _seeded(lambda: model(tokens, pad), 2))


def test_sinusoidal_positions():
    table = sinusoidal_positions(50, 8)
    assert table.shape == (50, 8)
    torch.testing.assert_close(table[0], torch.tensor([0.0, 1.0] * 4))
    torch.testing.assert_close(table[7, 0], torch.sin(torch.tensor(7.0)))
    torch.testing.assert_close(table[7, 3], torch.cos(torch.tensor(7.0 / 10000 ** (2 / 8))))
    model = _tiny_encoder("linear", positions="sinusoidal")
    assert "position_embedding" not in model.state_dict()  # fixed, not learned
    learned = _tiny_encoder("linear")
    assert "position_embedding" in dict(learned.named_parameters())


@pytest.mark.parametrize("method", ["softmax", "nystrom"])
def test_cls_pooling(method):
    """pooling="cls": the summary is the final state of a learned first token (LRA's CLS); padding
    still never reaches it, and the position table has one more row."""
    model = _tiny_encoder(method, pooling="cls")
    assert model.cls_token.shape == (1, 1, 16) and torch.count_nonzero(model.cls_token) == 0
    assert model.position_embedding.shape[0] == model.max_len + 1
    tokens, pad = _batch()
    model.eval()
    states = model.encode(tokens, pad)
    assert states.shape == (4, tokens.shape[1] + 1, 16)
    torch.testing.assert_close(model(tokens, pad), model.head(states[:, 0]))
    torch.testing.assert_close(model(tokens.masked_fill(pad, 7), pad), model(tokens, pad), rtol=1e-10, atol=1e-10)
    model(torch.ones(1, model.max_len, dtype=torch.int64))  # the longest input still fits
    with pytest.raises(ValueError, match="pooling"):
        _tiny_encoder(method, pooling="max")


def test_classifier_head_shapes():
    assert isinstance(_tiny_encoder("linear", head_hidden=0).head, torch.nn.Linear)
    head = _tiny_encoder("linear", head_hidden=8).head
    assert [type(m).__name__ for m in head] == ["Linear", "ReLU", "Linear"]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(dim=15), "divisible"),
        (dict(positions="rotary"), "positions"),
        (dict(dropout=1.0), "dropout"),
        (dict(depth=0), "depth"),
        (dict(method="nope"), "unknown method"),
        (dict(method_options={"num_features": 0}, method="performer"), "num_features"),
    ],
)
def test_bad_constructor_arguments(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        _tiny_encoder(**{"method": "softmax", **kwargs})


def test_bad_forward_arguments():
    model = _tiny_encoder("softmax")
    tokens, pad = _batch()
    with pytest.raises(ValueError, match="exceeds max_len"):
        model(torch.ones(1, 40, dtype=torch.int64))
    with pytest.raises(ValueError, match="integer tensor"):
        model(tokens.double(), pad)
    with pytest.raises(ValueError, match="shape of tokens"):
        model(tokens, pad[:, :10])
    with pytest.raises(TypeError, match="bool"):
        model(tokens, pad.float())
