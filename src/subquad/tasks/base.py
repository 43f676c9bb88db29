"""What the trainer needs from a task, and the registry of tasks.

A task is a class with the fields below, registered by :func:`register_task`; the trainer,
``subquad evaluate`` and the distributed path use only this interface, so a new task is one module
(see CONTRIBUTING.md, "Adding a task").

Its data is a :class:`TaskData`: three datasets, each with ``len()``, ``lengths()`` (tokens per
sample, int array) and ``batch(indices, pad_to, multiple) -> (tokens (B, L) int64,
key_padding_mask (B, L) bool, labels)``; ``labels`` is ``(B,)`` for a task with one label per
sequence (``per_token = False``: the model pools its states) and ``(B, L)`` with
:data:`IGNORE` where a position has no label for ``per_token = True`` (the model's head reads every
position).

A task also says which model family the trainer builds for it (``model``: ``"encoder"`` for token
sequences, ``"segmenter"`` for images with labels per pixel, whose ``batch`` gives ``(images (B, C,
H, W) float, key_padding_mask (B, H, W), labels (B, H, W))``) and may report scores beyond loss and
accuracy: ``scores`` names them, :meth:`Task.score_counts` turns one evaluated batch into additive
counts (summed over batches and processes) and :meth:`Task.score_values` turns the sums into the
scores (a segmentation task's confusion matrix and mIoU); ``best_by`` names the validation score
that picks ``best.pt``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

if TYPE_CHECKING:
    import torch

__all__ = ["IGNORE", "Task", "TaskData", "register_task", "get_task", "list_tasks", "make_task"]

IGNORE = -100  # a position without a label (torch's cross_entropy ignore_index default)


@dataclass
class TaskData:
    """The splits of a run. ``val_idx`` / ``test_idx``: the samples evaluated (a prefix with
    ``eval_samples``); ``facts``: numbers about the data that ``results.json`` records (e.g. the
    majority-class baseline); ``description``: one line the trainer prints."""

    train: Any
    val: Any
    test: Any
    val_idx: np.ndarray
    test_idx: np.ndarray
    facts: dict[str, Any] = field(default_factory=dict)
    description: str = ""


class Task:
    """A task: options as dataclass fields (checked in ``__post_init__``), and

    ``name`` (registry key), ``per_token`` (labels per position, not per sequence), ``preset`` (the
    trainer's default preset for it; its docstring is the CLI's help),
    ``vocab_size`` and ``num_classes`` (properties or fields), ``max_length`` (longest input),
    ``load(data_dir, eval_samples) -> TaskData`` and ``data_hint(data_dir) -> str`` (how to create
    missing data; empty when the task generates its data in memory); ``model``, ``scores``,
    ``best_by``, :meth:`score_counts` and :meth:`score_values` as the module docstring says.
    """

    name: ClassVar[str] = ""
    per_token: ClassVar[bool] = False
    preset: ClassVar[str] = "nystromformer"  # the trainer's preset (subquad.train.config.PRESETS) by default
    model: ClassVar[str] = "encoder"  # the model family (subquad.train.model_file.MODEL_FAMILIES)
    scores: ClassVar[tuple[str, ...]] = ()  # scores beyond loss and accuracy, as score_values names them
    best_by: ClassVar[str] = "accuracy"  # the validation score (accuracy or one of scores) that picks best.pt

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    @property
    def num_classes(self) -> int:
        raise NotImplementedError

    @property
    def max_length(self) -> int | None:
        """The longest sample (None: decided by the data, truncated to the run's ``pad_to``)."""
        return None

    def load(self, data_dir: str, eval_samples: int | None) -> TaskData:
        raise NotImplementedError

    def data_hint(self, data_dir: str) -> str:
        return ""

    def score_counts(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
        """Additive counts of one evaluated batch (``logits (K, classes)`` of the ``K`` labelled
        positions or samples, ``labels (K,)``), summed over the batches and processes of an
        evaluation and handed to :meth:`score_values`; None for a task without ``scores``."""
        return None

    def score_values(self, counts: torch.Tensor) -> dict[str, float]:
        """The ``scores`` of an evaluation from its summed :meth:`score_counts`."""
        return {}

    def options(self) -> dict[str, Any]:
        """The task's options as a plain dict (what a run's config records)."""
        return dataclasses.asdict(self) if dataclasses.is_dataclass(self) else {}


_TASKS: dict[str, type[Task]] = {}


def register_task(cls: type[Task]) -> type[Task]:
    """Class decorator: make ``cls`` known by ``cls.name``."""
    if not cls.name:
        raise ValueError(f"task class {cls.__name__} has no name")
    if cls.name in _TASKS and _TASKS[cls.name] is not cls:
        raise ValueError(f"task {cls.name!r} is already registered")
    _TASKS[cls.name] = cls
    return cls


def list_tasks() -> list[str]:
    return list(_TASKS)


def get_task(name: str) -> type[Task]:
    """The registered task class; ValueError listing the known ones."""
    try:
        return _TASKS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown task {name!r}; tasks are {list(_TASKS)}") from None


def make_task(name: str, options: dict[str, Any] | None = None) -> Task:
    """An instance of task ``name`` with ``options``; unknown options raise ValueError naming the
    allowed ones."""
    cls = get_task(name)
    options = dict(options or {})
    allowed = [f.name for f in dataclasses.fields(cls)] if dataclasses.is_dataclass(cls) else []
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"task {name!r} has no option(s) {unknown}; its options are {allowed}")
    return cls(**options)
