"""LRA ListOps: a seeded, fast re-implementation of the generator, TSV files, a dataset, and the task.

A sample is a nested list expression such as ``[MAX 2 9 [MIN 4 7 ] 0 ]`` and its label, the
value of the expression (a digit, 10 classes). Operators: ``[MIN``, ``[MAX``, ``[MED`` (median,
``int(numpy.median)``: the mean of the two middle values for an even count, truncated) and
``[SM`` (sum modulo 10); ``]`` closes a list. The tree distribution is that of the LRA generator:
a node at depth ``d`` (root ``d = 1``) is a list with probability 1/4 when ``d < max_depth``
(else always a digit); a list has ``U{2..max_args}`` arguments and a uniform operator; a digit is
uniform in 0..9. A tree is kept iff ``min_length < length < max_length`` (tokens, strict), and
sequences are unique across all splits.

Unlike LRA (no seed, set-order splits), generation is reproducible: each split is drawn from its
own stream of ``numpy.random.SeedSequence(seed)``, so the test and validation sets do not depend
on the requested train size, and a smaller train set is a prefix of a larger one. Trees are
sampled level by level, vectorised over a batch of roots, and trees that reach ``max_length``
stop growing early (that cannot change which trees are kept), so 100k samples take seconds.

Files (``basic_train.tsv``, ``basic_val.tsv``, ``basic_test.tsv`` as in LRA): a header
``Source<TAB>Target``, then one ``tokens<TAB>label`` line per sample. The reader also accepts
the LRA release files, whose sources carry extra ``(`` ``)`` tokens (dropped, as the LRA input
pipeline does). Fixed vocabulary: ``0`` padding, ``1..10`` digits 0..9, ``11..14`` the
operators, ``15`` the closing bracket.

Modules: ``grammar`` (vocabulary, tokenising, evaluating), ``generator``, ``files``, ``dataset``;
the task the trainer runs is :class:`ListOps`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..base import Task, TaskData, register_task
from .dataset import ListOpsDataset, ListOpsSplit, label_distribution, majority_baseline
from .files import generate_and_write, load_splits, read_split, split_path, write_splits
from .generator import SPLITS, GeneratorConfig, generate, generate_splits
from .grammar import (CLOSE, FIRST_OP, NUM_CLASSES, OPERATORS, PAD, TOKENS, VOCAB_SIZE, decode, encode, evaluate,
                      tree_depth)

__all__ = [
    "ListOps",
    "PAD",
    "CLOSE",
    "FIRST_OP",
    "TOKENS",
    "OPERATORS",
    "VOCAB_SIZE",
    "NUM_CLASSES",
    "SPLITS",
    "GeneratorConfig",
    "ListOpsSplit",
    "generate",
    "generate_splits",
    "write_splits",
    "generate_and_write",
    "read_split",
    "load_splits",
    "encode",
    "decode",
    "evaluate",
    "tree_depth",
    "label_distribution",
    "majority_baseline",
    "ListOpsDataset",
    "split_path",
]


@register_task
@dataclass(frozen=True)
class ListOps(Task):
    """LRA ListOps classification. Reads the files of a run's data directory (``subquad data listops``
    writes them); no task options. Preset ``nystromformer``: 2 layers, dim 64, 2 heads, FFN 128,
    batch 32, lr 1e-4, 1000 warm-up steps then linear decay, 5000 steps, pad to 2048."""

    name = "listops"
    per_token = False

    @property
    def vocab_size(self) -> int:
        return VOCAB_SIZE

    @property
    def num_classes(self) -> int:
        return NUM_CLASSES

    def data_hint(self, data_dir: str) -> str:
        return f"`subquad data listops --out {data_dir}`"

    def load(self, data_dir: str, eval_samples: int | None) -> TaskData:
        splits = load_splits(data_dir)
        sets = {s: ListOpsDataset(splits[s]) for s in SPLITS}
        n_val, n_test = (len(sets[s]) if eval_samples is None else min(eval_samples, len(sets[s]))
                         for s in ("val", "test"))
        train_labels = splits["train"].labels
        majority_class, majority_test = majority_baseline(train_labels, splits["test"].labels[:n_test])
        _, majority_val = majority_baseline(train_labels, splits["val"].labels[:n_val])
        facts = {"majority_class": majority_class, "majority_test_accuracy": majority_test,
                 "majority_val_accuracy": majority_val,
                 "train_label_distribution": label_distribution(train_labels),
                 "test_label_distribution": label_distribution(splits["test"].labels)}
        description = (f"listops: {len(sets['train'])} train / {len(sets['val'])} val / {len(sets['test'])} test; "
                       f"majority class {majority_class} = {100 * majority_test:.2f}% of test; train labels "
                       + " ".join(f"{c}:{100 * p:.1f}%" for c, p in enumerate(facts["train_label_distribution"])))
        return TaskData(sets["train"], sets["val"], sets["test"], np.arange(n_val), np.arange(n_test), facts,
                        description)
