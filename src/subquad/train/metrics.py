"""What a run reports: ``metrics.csv`` (and TensorBoard), the progress bar or log lines, and the
loss and accuracy of a batch (per sequence or per labelled position)."""

from __future__ import annotations

import csv
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..tasks import IGNORE

__all__ = ["METRICS", "METRIC_COLUMNS", "MetricsWriter", "Progress", "loss_and_correct"]

METRICS = "metrics.csv"
METRIC_COLUMNS = ("step", "split", "loss", "accuracy", "samples", "lr", "samples_per_s", "tokens_per_s",
                  "elapsed_s")


class MetricsWriter:
    """``metrics.csv`` (one row per log / evaluation) and, if installed, TensorBoard. ``scores``:
    the task's own scores (``Task.scores``), columns after :data:`METRIC_COLUMNS`."""

    def __init__(self, out_dir: Path, *, resume_step: int | None, tensorboard: bool | None,
                 scores: tuple[str, ...] = ()):
        self.path = out_dir / METRICS
        self.columns = (*METRIC_COLUMNS, *scores)
        rows = []
        if resume_step is not None and self.path.is_file():
            with open(self.path, newline="") as f:
                rows = [r for r in csv.DictReader(f)
                        if int(r["step"]) <= resume_step and r["split"] in ("train", "val")]
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w", newline="") as f:  # keep only what the checkpoint has seen
            writer = csv.DictWriter(f, fieldnames=self.columns)
            writer.writeheader()
            writer.writerows(rows)
        os.replace(tmp, self.path)
        self.file = open(self.path, "a", newline="")
        self.writer = csv.DictWriter(self.file, fieldnames=self.columns)
        self.tb = None
        if tensorboard is not False:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                if tensorboard:
                    raise ValueError("tensorboard=True but the tensorboard package is not installed "
                                     "(pip install 'subquad[train]')") from None
            else:
                purge = None if resume_step is None else resume_step + 1
                self.tb = SummaryWriter(str(out_dir / "tensorboard"), purge_step=purge)

    def write(self, row: dict[str, Any]) -> None:
        self.writer.writerow({k: row.get(k, "") for k in self.columns})
        self.file.flush()
        if self.tb is not None:
            for key in ("loss", "accuracy", "lr", "samples_per_s", *self.columns[len(METRIC_COLUMNS):]):
                if row.get(key) not in (None, ""):
                    self.tb.add_scalar(f"{row['split']}/{key}", float(row[key]), int(row["step"]))

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()


class Progress:
    """tqdm bar when available and wanted (``use_tqdm`` not False), else a plain line every
    ``log_every`` steps; evaluation lines either way. Silent only when not ``enabled`` (the
    processes of a distributed run other than the first)."""

    def __init__(self, enabled: bool, use_tqdm: bool | None, total: int, initial: int):
        self.enabled = enabled
        self.bar = None
        if enabled and use_tqdm is not False:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                interactive = sys.stderr.isatty()
                self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True,
                                mininterval=0.5 if interactive else 30.0)

    def update(self, step: int, info: dict[str, Any], plain: bool) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(info, refresh=False)
        elif plain:
            print(f"step {step}: " + ", ".join(f"{k} {v}" for k, v in info.items()), flush=True)

    def write(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def loss_and_correct(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Summed cross-entropy (float32), number of correct predictions and number of labels of a
    batch: ``logits (B, C)`` with ``labels (B,)``, or ``(B, L, C)`` with ``labels (B, L)`` where
    :data:`~subquad.tasks.IGNORE` marks positions without a label."""
    logits = logits.reshape(-1, logits.shape[-1]).float()
    labels = labels.reshape(-1)
    labelled = labels != IGNORE
    loss = F.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="sum")
    correct = ((logits.argmax(-1) == labels) & labelled).sum()
    return loss, correct, labelled.sum()
