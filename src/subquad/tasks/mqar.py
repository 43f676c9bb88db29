"""Multi-query associative recall (MQAR): the synthetic recall task of Zoology (Arora et al. 2023,
"Zoology: Measuring and Improving Recall in Efficient Language Models", Section 3; their generator
is ``zoology/data/associative_recall.py`` in HazyResearch/zoology).

A sample of ``seq_len`` tokens starts with ``num_pairs`` key-value pairs ``k1 v1 k2 v2 ...``
(distinct keys from ``2 .. vocab_size/2 - 1``, distinct values from ``vocab_size/2 .. vocab_size -
1``). The rest is the query region, seen as slots of two tokens: every key appears once more, at
the first token of a slot drawn without replacement with probability proportional to ``a *
slot^(a - 1)`` (``a = power_a``, 0.01 as in Zoology: most queries come soon after the pairs, some
far); every other position holds the filler token ``1`` (Zoology's ``random_non_queries=False``),
or with ``random_fillers=True`` a token drawn uniformly from the whole vocabulary (Zoology's
default; with a small vocabulary, a key then also appears at random places, followed by a wrong
token, which makes the task far harder at long N). The label of a query position is its key's value; all other positions
are :data:`~subquad.tasks.base.IGNORE`. The metric is the accuracy over query positions.

One difference from Zoology, for a bidirectional encoder: Zoology trains a causal language model
whose target at a query is the next token. Here the label sits on the query token itself and the
value never appears after it (Zoology's inputs hold no value there either), so causal and
non-causal methods solve the same problem and no answer is visible in the input. Samples are drawn
in memory from ``(data_seed, split, index)``: no files, the same sample for every run and process.
Token ``0`` is padding (only when a batch is padded to a multiple), ``1`` the filler.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..checks import check_bool, check_float, check_int
from .base import IGNORE, Task, TaskData, register_task

__all__ = ["MQAR", "MQARDataset", "make_sample"]

_SPLIT_CODE = {"train": 0, "val": 1, "test": 2}
FILLER = 1


@register_task
@dataclass(frozen=True)
class MQAR(Task):
    """Multi-query associative recall (Zoology), generated in memory. ``num_pairs`` pairs in
    sequences of ``seq_len`` tokens (``seq_len >= 4 * num_pairs``: the pairs and one query slot per
    key), ``vocab_size`` tokens; ``train_pairs`` (optional): training samples draw their number of
    pairs from these instead, as Zoology trains on a mixture of pair counts (the easy ones teach the
    recall circuit sooner); ``train_lengths`` (optional): training samples take these lengths in
    turn (Zoology trains on several lengths too); ``train_size`` distinct training samples (Zoology: 100 000),
    ``eval_size`` each for validation and test. Task options: ``-t seq_len=512 -t num_pairs=32``.
    Preset ``mqar``: 2 layers, dim 64, 1 head, a short convolution before each mixer, a linear
    head at every position."""

    name = "mqar"
    per_token = True
    preset = "mqar"

    seq_len: int = 256
    num_pairs: int = 16
    vocab_size: int = 512
    power_a: float = 0.01
    random_fillers: bool = False
    train_pairs: tuple[int, ...] = ()
    train_lengths: tuple[int, ...] = ()
    train_size: int = 100_000
    eval_size: int = 1_000
    data_seed: int = 0

    def __post_init__(self) -> None:
        for name in ("train_pairs", "train_lengths"):  # a list from a JSON config too
            object.__setattr__(self, name, tuple(getattr(self, name)))
        check_int("mqar", "num_pairs", self.num_pairs, minimum=1)
        for pairs in self.train_pairs:
            check_int("mqar", "train_pairs", pairs, minimum=1)
        check_int("mqar", "seq_len", self.seq_len, minimum=4 * self.num_pairs)
        smallest = min(self.train_pairs) if self.train_pairs else self.num_pairs  # a training sample's fewest pairs
        for length in self.train_lengths or (self.seq_len,):
            check_int("mqar", "train_lengths" if self.train_lengths else "seq_len", length, minimum=4 * smallest)
        check_int("mqar", "vocab_size", self.vocab_size, minimum=2 * max((self.num_pairs, *self.train_pairs)) + 4)
        check_bool("mqar", "random_fillers", self.random_fillers)
        check_float("mqar", "power_a", self.power_a, minimum=0.0, inclusive=False)
        check_int("mqar", "train_size", self.train_size, minimum=1)
        check_int("mqar", "eval_size", self.eval_size, minimum=1)
        check_int("mqar", "data_seed", self.data_seed, minimum=0)

    @property
    def num_classes(self) -> int:
        return self.vocab_size

    @property
    def max_length(self) -> int:
        return max((self.seq_len, *self.train_lengths))

    def sample_length(self, split: str, index: int) -> int:
        """Tokens of sample ``index``: ``seq_len``, or for training samples with ``train_lengths``
        the lengths in turn (``index`` modulo their number)."""
        if split == "train" and self.train_lengths:
            return self.train_lengths[index % len(self.train_lengths)]
        return self.seq_len

    def load(self, data_dir: str, eval_samples: int | None) -> TaskData:
        sets = {s: MQARDataset(self, s, self.train_size if s == "train" else self.eval_size) for s in _SPLIT_CODE}
        n_eval = self.eval_size if eval_samples is None else min(eval_samples, self.eval_size)
        chance = 2.0 / self.vocab_size  # a uniform guess among the values
        mix = "".join(f"; training {what} {'/'.join(map(str, values))}"
                      for what, values in (("pairs", self.train_pairs), ("lengths", self.train_lengths)) if values)
        mix = f" ({mix[2:]})" if mix else ""
        return TaskData(sets["train"], sets["val"], sets["test"], np.arange(n_eval), np.arange(n_eval),
                        facts={"chance_accuracy": chance},
                        description=f"mqar: {self.num_pairs} pairs in {self.seq_len} tokens{mix}, vocabulary "
                                    f"{self.vocab_size}; {self.train_size} train / {n_eval} val / {n_eval} test "
                                    "samples, generated in memory")


def make_sample(task: MQAR, split: str, index: int) -> tuple[np.ndarray, np.ndarray]:
    """Sample ``index`` of ``split``: ``(tokens int64 (seq_len,), labels int64 (seq_len,))``."""
    rng = np.random.default_rng([task.data_seed, _SPLIT_CODE[split], int(index)])
    half = task.vocab_size // 2
    p = task.num_pairs
    n = task.sample_length(split, index)
    if split == "train" and task.train_pairs:
        fits = [pairs for pairs in task.train_pairs if 4 * pairs <= n]
        p = fits[rng.integers(len(fits))]
    keys = rng.choice(np.arange(2, half), size=p, replace=False)
    values = rng.choice(np.arange(half, task.vocab_size), size=p, replace=False)
    if task.random_fillers:
        tokens = rng.integers(1, task.vocab_size, size=n)
    else:
        tokens = np.full(n, FILLER, dtype=np.int64)
    labels = np.full(n, IGNORE, dtype=np.int64)
    tokens[0:2 * p:2] = keys
    tokens[1:2 * p:2] = values
    slots = (n - 2 * p) // 2
    weight = task.power_a * np.arange(1, slots + 1, dtype=np.float64) ** (task.power_a - 1)
    where = 2 * p + 2 * rng.choice(slots, size=p, replace=False, p=weight / weight.sum())
    tokens[where] = keys
    labels[where] = values
    return tokens, labels


class MQARDataset(torch.utils.data.Dataset):
    """``size`` samples of one split; ``ds[i]`` is ``(tokens, labels)`` as :func:`make_sample`
    draws them; :meth:`batch` stacks them (labels ``(B, L)``)."""

    def __init__(self, task: MQAR, split: str, size: int):
        self.task, self.split, self.size = task, split, size

    def __len__(self) -> int:
        return self.size

    def lengths(self) -> np.ndarray:
        return np.array([self.task.sample_length(self.split, i) for i in range(self.size)], dtype=np.int64)

    def __getitem__(self, i: int):
        if not 0 <= i < self.size:
            raise IndexError(f"mqar {self.split}: index {i} out of range for {self.size} samples")
        tokens, labels = make_sample(self.task, self.split, i)
        return torch.from_numpy(tokens), torch.from_numpy(labels)

    def batch(self, indices, pad_to: int, multiple: int | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Samples are never truncated: ``pad_to`` below the longest is a ValueError. The batch is as
        long as its longest sample, rounded up to ``multiple`` (at most ``pad_to``), with padding
        token 0 (``multiple=None``: padded to ``pad_to``)."""
        pairs = [make_sample(self.task, self.split, int(i)) for i in np.asarray(indices).tolist()]
        n = max((len(t) for t, _ in pairs), default=1)
        if pad_to < n:
            raise ValueError(f"mqar samples have {n} tokens; pad_to={pad_to} would cut their queries")
        length = pad_to if multiple is None else min(pad_to, -(-n // multiple) * multiple)
        tokens = np.zeros((len(pairs), length), dtype=np.int64)
        labels = np.full((len(pairs), length), IGNORE, dtype=np.int64)
        pad = torch.ones(tokens.shape, dtype=torch.bool)
        for row, (t, y) in enumerate(pairs):
            tokens[row, :len(t)], labels[row, :len(t)] = t, y
            pad[row, :len(t)] = False
        return torch.from_numpy(tokens), pad, torch.from_numpy(labels)
