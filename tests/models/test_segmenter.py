"""The segmenter (HamNet's layout scaled down): shapes, the cores it builds for each kind of
method, parameters matched across cores, and "none" (no token mixing) in every model."""

import pytest
import torch

from subquad.layers.hamburger import HamburgerMixer
from subquad.models import NO_MIXING, Encoder, Segmenter, build_mixer
from subquad.models.encoder import NoMixing, check_method, supports_attention_dropout
from subquad.models.segmenter import BreadMixer, SelfAttentionCore, context_mixer
from subquad.train import TrainConfig
from subquad.train.config import PAD_MULTIPLE, pad_multiple

# cores without parameters of their own: every one of these models has the same parameters
MATCHED = [("none", {}), ("hamburger", {}), ("hamburger", {"ham": "vq"}), ("hamburger", {"ham": "cd"}),
           ("softmax", {}), ("efficient", {}), ("linear", {})]


def _images(b=2, size=32, seed=0):
    return torch.rand(b, 1, size, size, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("method", ["none", "hamburger", "softmax"])
def test_output_shapes(method):
    torch.manual_seed(0)
    model = Segmenter(1, 11, method=method, dim=16, heads=2)
    x = _images(3, 32)
    logits = model(x)
    assert logits.shape == (3, 32, 32, 11) and torch.isfinite(logits).all()
    select = torch.rand(3, 32, 32, generator=torch.Generator().manual_seed(1)) < 0.2
    model.eval()
    torch.manual_seed(1)
    full = model(x, torch.zeros(3, 32, 32, dtype=torch.bool))
    torch.manual_seed(1)
    torch.testing.assert_close(model(x, None, select), full[select])
    assert model(_images(1, 40)).shape == (1, 40, 40, 11)  # any size: upsampled to the input's


def test_parameters_are_matched_across_cores():
    counts = {}
    for method, options in MATCHED:
        model = Segmenter(1, 11, method=method, method_options=options)
        counts[(method, options.get("ham"))] = sum(p.numel() for p in model.parameters())
    assert len(set(counts.values())) == 1, counts
    assert set(counts.values()) == {101995}  # the preset's model: dim 64, one context block


def test_the_cores_each_kind_gets():
    ham = context_mixer("hamburger", 16, 2, rank=4)
    assert isinstance(ham, HamburgerMixer) and ham.ham.rank == 4  # the mixer owns its breads
    none = context_mixer("none", 16, 2)
    assert isinstance(none, BreadMixer) and isinstance(none.core, NoMixing)
    soft = context_mixer("softmax", 16, 2)
    assert isinstance(soft, BreadMixer) and isinstance(soft.core, SelfAttentionCore)
    shapes = lambda m: sorted(tuple(p.shape) for p in m.parameters())  # noqa: E731
    assert shapes(ham) == shapes(none) == shapes(soft) == [(16,), (16, 16), (16, 16)]
    nystrom = context_mixer("nystrom", 16, 2, num_landmarks=4, conv_kernel_size=3)
    assert sum(p.numel() for p in nystrom.parameters()) > sum(p.numel() for p in soft.parameters())  # its conv


def test_attention_core_takes_the_map_as_queries_keys_and_values():
    torch.manual_seed(0)
    mixer = context_mixer("softmax", 8, 2)
    x = torch.randn(2, 10, 8)
    h = mixer.lower_bread(x).reshape(2, 10, 2, 4).transpose(1, 2)
    weights = torch.softmax(h @ h.transpose(-1, -2) / 2.0, dim=-1)
    expected = mixer.upper_bread((weights @ h).transpose(1, 2).reshape(2, 10, 8))
    torch.testing.assert_close(mixer(x), expected)
    identity = context_mixer("none", 8, 2)
    torch.testing.assert_close(identity(x), identity.upper_bread(identity.lower_bread(x)))


def test_block_is_residual_and_every_parameter_learns():
    torch.manual_seed(0)
    model = Segmenter(1, 11, method="hamburger", dim=16)
    logits = model(_images())
    torch.nn.functional.cross_entropy(logits.reshape(-1, 11), torch.randint(0, 11, (2 * 32 * 32,))).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not missing


def test_eval_is_repeatable_under_a_seed():
    model = Segmenter(1, 11, method="hamburger", dim=16).eval()
    x = _images()
    torch.manual_seed(3)
    a = model(x)
    torch.manual_seed(3)
    torch.testing.assert_close(model(x), a)


def test_errors():
    with pytest.raises(ValueError, match="unknown method 'nope'"):
        Segmenter(1, 11, method="nope")
    with pytest.raises(ValueError, match="unknown option"):
        Segmenter(1, 11, method="softmax", method_options={"landmarks": 3})
    with pytest.raises(ValueError, match="no options"):
        Segmenter(1, 11, method="none", method_options={"rank": 3})
    with pytest.raises(ValueError, match="attention weights"):
        Segmenter(1, 11, method="linear", attention_dropout=0.1)
    with pytest.raises(ValueError, match="divisible"):
        Segmenter(1, 11, method="softmax", dim=10, heads=3)
    with pytest.raises(ValueError, match="dim must be a positive int"):
        Segmenter(1, 11, dim=0)
    model = Segmenter(1, 11, method="none", dim=8)
    with pytest.raises(ValueError, match="never padded"):
        model(_images(), torch.ones(2, 32, 32, dtype=torch.bool))
    with pytest.raises(ValueError, match="float tensor"):
        model(torch.zeros(2, 32, 32))
    with pytest.raises(ValueError, match="select must be a bool"):
        model(_images(), None, torch.zeros(2, 16, 16, dtype=torch.bool))


def test_none_is_no_mixing_in_every_model():
    assert NO_MIXING == "none" and check_method("none") is None and check_method("softmax").name == "softmax"
    assert not supports_attention_dropout("none")
    mixer = build_mixer("none", 16, 2)
    x = torch.randn(2, 5, 16)
    assert isinstance(mixer, NoMixing) and mixer(x) is x and not list(mixer.parameters())
    with pytest.raises(ValueError, match="no options"):
        build_mixer("none", 16, 2, attention_dropout=0.1)
    encoder = Encoder(10, 3, method="none", dim=16, heads=2, ffn_dim=32, max_len=8)
    assert encoder(torch.randint(1, 10, (2, 8))).shape == (2, 3)
    cfg = TrainConfig.from_preset("mqar", method="none")
    cfg.validate()
    assert pad_multiple(cfg) == PAD_MULTIPLE
    with pytest.raises(ValueError, match="unknown method"):
        TrainConfig(method="nothing").validate()
