"""Scores of semantic segmentation: the confusion matrix of labelled pixels and the mean
intersection over union (mIoU) read from it, as segmentation benchmarks report it (PASCAL VOC,
ADE20K; the numbers of Hamburger's paper, Geng et al. 2021, are this mIoU).

The confusion matrix is additive, so it can be summed over batches and processes before the
scores are read: ``IoU_c = TP_c / (TP_c + FP_c + FN_c)``, averaged over the classes that occur
(in the labels or the predictions) in what was evaluated; a class that occurs nowhere is left out
of the mean, not counted as 0 or 1.
"""

from __future__ import annotations

import torch

__all__ = ["confusion_counts", "mean_iou", "iou_per_class"]


def confusion_counts(logits: torch.Tensor, labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """``(num_classes * num_classes,)`` float64 counts on the CPU: entry ``true * num_classes +
    predicted`` counts the pixels of class ``true`` predicted as ``predicted`` (the argmax of
    ``logits (K, num_classes)`` for ``labels (K,)``, every label in ``0 .. num_classes - 1``)."""
    predicted = logits.argmax(-1).reshape(-1)
    labels = labels.reshape(-1).to(predicted.device)
    flat = labels * num_classes + predicted
    return torch.bincount(flat, minlength=num_classes * num_classes).to("cpu", torch.float64)


def iou_per_class(counts: torch.Tensor) -> torch.Tensor:
    """IoU of every class from flat or square confusion counts (rows true, columns predicted);
    NaN for a class that occurs neither in the labels nor in the predictions."""
    k = int(round(counts.numel() ** 0.5))
    confusion = counts.reshape(k, k).to(torch.float64)
    hits = confusion.diagonal()
    union = confusion.sum(0) + confusion.sum(1) - hits
    return torch.where(union > 0, hits / union.clamp_min(1), torch.full_like(hits, float("nan")))


def mean_iou(counts: torch.Tensor, classes: slice | None = None) -> float:
    """The mean IoU over ``classes`` (all by default) that occur; 0.0 when none does."""
    iou = iou_per_class(counts)
    if classes is not None:
        iou = iou[classes]
    present = iou[~iou.isnan()]
    return float(present.mean()) if present.numel() else 0.0
