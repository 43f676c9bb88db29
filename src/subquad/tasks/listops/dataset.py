"""ListOps samples in memory: flat storage of a split, its statistics, and the torch Dataset."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .grammar import NUM_CLASSES, PAD

__all__ = ["ListOpsSplit", "ListOpsDataset", "label_distribution", "majority_baseline"]


@dataclass
class ListOpsSplit:
    """Token sequences stored flat: sample ``i`` is ``tokens[offsets[i]:offsets[i + 1]]``
    (ids of :data:`TOKENS`, no padding); ``labels`` int64 ``(n,)``."""

    tokens: np.ndarray  # uint8 (total,)
    offsets: np.ndarray  # int64 (n + 1,)
    labels: np.ndarray  # int64 (n,)

    def __len__(self) -> int:
        return len(self.labels)

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def sequence(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i]:self.offsets[i + 1]]


def label_distribution(labels: np.ndarray) -> list[float]:
    """Fraction of each class 0..9."""
    labels = np.asarray(labels)
    if len(labels) == 0:
        return [0.0] * NUM_CLASSES
    return (np.bincount(labels, minlength=NUM_CLASSES) / len(labels)).tolist()


def majority_baseline(train_labels: np.ndarray, eval_labels: np.ndarray) -> tuple[int, float]:
    """``(class, accuracy)``: the most frequent train class and the accuracy on ``eval_labels``
    of always predicting it."""
    cls = int(np.argmax(np.bincount(np.asarray(train_labels), minlength=NUM_CLASSES)))
    eval_labels = np.asarray(eval_labels)
    acc = float(np.mean(eval_labels == cls)) if len(eval_labels) else 0.0
    return cls, acc


class ListOpsDataset(torch.utils.data.Dataset):
    """Tokenised ListOps split. ``ds[i]`` is ``(tokens int64 (L_i,), label)``;
    :meth:`batch` pads a list of indices and returns ``tokens (B, L)`` int64,
    ``key_padding_mask (B, L)`` bool (True = padding) and ``labels (B,)`` int64."""

    def __init__(self, data: ListOpsSplit):
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def lengths(self) -> np.ndarray:
        """Tokens per sample, int64 ``(n,)``."""
        return self.data.lengths()

    def __getitem__(self, i: int):
        return torch.from_numpy(self.data.sequence(i).astype(np.int64)), int(self.data.labels[i])

    def batch(self, indices, pad_to: int, multiple: int | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sequences longer than ``pad_to`` are truncated, as in LRA. ``multiple=None`` pads every
        batch to ``L = pad_to`` (the published pipeline); an int pads to the batch's longest
        sample rounded up to a multiple of it, and at most ``pad_to``."""
        indices = np.asarray(indices, dtype=np.int64)
        length = pad_to
        if multiple is not None:
            longest = int((self.data.offsets[indices + 1] - self.data.offsets[indices]).max(initial=1))
            length = min(pad_to, -(-longest // multiple) * multiple)
        out = np.zeros((len(indices), length), dtype=np.int64)
        for row, i in enumerate(indices.tolist()):
            seq = self.data.sequence(i)[:length]
            out[row, : len(seq)] = seq
        tokens = torch.from_numpy(out)
        return tokens, tokens == PAD, torch.from_numpy(self.data.labels[indices])
