"""The ListOps generator: trees drawn level by level, vectorised over a batch of roots, from a
seeded stream per split (see the package docstring for the distribution)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .dataset import ListOpsSplit
from .grammar import CLOSE, FIRST_OP, OPERATORS

__all__ = ["GeneratorConfig", "SPLITS", "generate", "generate_splits"]

SPLITS = ("train", "val", "test")
# roots drawn per vectorised batch; part of the definition of a seed's stream, do not change
_ROOTS_PER_BATCH = 1 << 15


@dataclass(frozen=True)
class GeneratorConfig:
    """Parameters of the tree distribution (LRA defaults)."""

    max_depth: int = 10
    max_args: int = 10
    min_length: int = 500
    max_length: int = 2000

    def __post_init__(self):
        for name, lo in (("max_depth", 1), ("max_args", 2), ("min_length", 0), ("max_length", 2)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                raise ValueError(f"listops: {name} must be an int >= {lo}, got {value!r}")
        if self.max_length - self.min_length < 2:
            raise ValueError(
                f"listops: need min_length < length < max_length for some length, got min_length="
                f"{self.min_length}, max_length={self.max_length}"
            )


def _sample_batch(rng: np.random.Generator, num_roots: int, cfg: GeneratorConfig):
    """Sample ``num_roots`` trees level by level; return the kept ones (root order) as
    ``(tokens uint8 flat, lengths int64, labels int64)``.

    Per level, ``tree`` (root of each node) and ``parent`` (index in the level above) are
    non-decreasing, so the arguments of a list are contiguous in the next level."""
    levels, length = _grow_levels(rng, num_roots, cfg)
    keep_tree = (length > cfg.min_length) & (length < cfg.max_length)
    if not keep_tree.any():
        return np.zeros(0, np.uint8), np.zeros(0, np.int64), np.zeros(0, np.int64)
    compact = _kept_levels(levels, keep_tree)
    values, sizes = _values_and_sizes(compact)
    return _pre_order_tokens(compact, sizes), sizes[0], values[0]


def _grow_levels(rng: np.random.Generator, num_roots: int, cfg: GeneratorConfig) -> tuple[list, np.ndarray]:
    """Draw the trees one depth at a time: ``(levels, length)`` with one ``(tree, parent, internal,
    token)`` per depth and the token count of each tree (a lower bound for trees that stopped
    growing at ``max_length``)."""
    ways = len(OPERATORS) * (cfg.max_args - 1)
    span = 10 * ways  # one draw gives a digit (code % 10) or an operator and an argument count
    levels = []  # per depth: (tree, parent, internal, token)
    tree = np.arange(num_roots, dtype=np.int32)
    parent = np.zeros(0, dtype=np.int32)
    length = np.zeros(num_roots, dtype=np.int64)  # tokens generated so far (a lower bound until done)
    for depth in range(1, cfg.max_depth + 1):
        n = len(tree)
        if n == 0:
            break
        if depth < cfg.max_depth:
            internal = rng.random(n, dtype=np.float32) < 0.25
        else:
            internal = np.zeros(n, dtype=bool)
        code = rng.integers(0, span, n, dtype=np.int32)
        lists = np.flatnonzero(internal)
        op = code[lists] % len(OPERATORS)
        nargs = 2 + (code[lists] // len(OPERATORS)) % (cfg.max_args - 1)
        token = (1 + code % 10).astype(np.uint8)
        token[lists] = FIRST_OP + op
        length += np.bincount(tree, minlength=num_roots)
        length += np.bincount(tree[lists], minlength=num_roots)
        levels.append((tree, parent, internal, token))
        # trees at max_length already can never be kept: stop growing them
        grow = length[tree[lists]] < cfg.max_length
        parent = np.repeat(lists[grow].astype(np.int32), nargs[grow])
        tree = tree[parent]
    return levels, length


def _kept_levels(levels: list, keep_tree: np.ndarray) -> list:
    """The levels with only the nodes of kept trees (whole trees: parents of kept nodes are
    kept), trees and parents renumbered."""
    new_tree_id = (np.cumsum(keep_tree) - 1).astype(np.int32)
    compact = []
    prev_map = None
    for tree, parent, internal, token in levels:
        keep = keep_tree[tree]
        if not keep.any():
            break
        index_map = (np.cumsum(keep) - 1).astype(np.int32)
        new_parent = prev_map[parent[keep]] if prev_map is not None else parent
        compact.append((new_tree_id[tree[keep]], new_parent, internal[keep], token[keep]))
        prev_map = index_map
    return compact


def _values_and_sizes(compact: list) -> tuple[list, list]:
    """Bottom-up: the value and the subtree length (in tokens) of every node, per level."""
    values = [None] * len(compact)
    sizes = [None] * len(compact)
    for d in range(len(compact) - 1, -1, -1):
        _, _, internal, token = compact[d]
        value = token.astype(np.int64) - 1  # digits; overwritten for lists
        size = np.ones(len(token), dtype=np.int64)
        lists = np.flatnonzero(internal)
        if len(lists):
            child_list = (np.cumsum(internal) - 1)[compact[d + 1][1]]  # which list each argument is in
            hist = np.bincount(child_list * 10 + values[d + 1], minlength=len(lists) * 10).reshape(-1, 10)
            # a list: operator + closing bracket + its arguments' tokens
            inner = np.bincount(child_list, weights=sizes[d + 1], minlength=len(lists))
            size[lists] = 2 + inner.astype(np.int64)
            value[lists] = _reduce_histograms(hist, token[lists].astype(np.int64) - FIRST_OP)
        values[d] = value
        sizes[d] = size
    return values, sizes


def _pre_order_tokens(compact: list, sizes: list) -> np.ndarray:
    """Top-down: every tree's tokens in pre-order (with closing brackets), the trees one after
    another."""
    lengths = sizes[0]
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    out = np.empty(int(lengths.sum()), dtype=np.uint8)
    pos = np.zeros(len(lengths), dtype=np.int64)  # pre-order position of every node inside its tree
    for d in range(len(compact)):
        tree, parent, internal, token = compact[d]
        size = sizes[d]
        if d > 0:
            excl = np.cumsum(size) - size  # exclusive prefix sum over the whole level
            first = np.flatnonzero(np.r_[True, parent[1:] != parent[:-1]])
            base = np.zeros(len(pos), dtype=np.int64)  # excl at each list's first argument
            base[parent[first]] = excl[first]
            pos = pos[parent] + 1 + (excl - base[parent])
        where = starts[tree] + pos
        out[where] = token
        lists = np.flatnonzero(internal)
        out[where[lists] + size[lists] - 1] = CLOSE
    return out


def _reduce_histograms(hist: np.ndarray, op: np.ndarray) -> np.ndarray:
    """Operator value per row from a digit histogram ``(n, 10)`` of its arguments."""
    present = hist > 0
    vmin = np.argmax(present, axis=1)
    vmax = 9 - np.argmax(present[:, ::-1], axis=1)
    vsum = (hist @ np.arange(10)) % 10
    count = hist.sum(axis=1)
    cum = np.cumsum(hist, axis=1)
    lo = np.argmax(cum >= ((count + 1) // 2)[:, None], axis=1)  # the ceil(n/2)-th smallest
    hi = np.argmax(cum >= (count // 2 + 1)[:, None], axis=1)  # the (n//2 + 1)-th smallest
    vmed = (lo + hi) // 2  # int(median): mean of the middle pair, truncated (values >= 0)
    return np.choose(op.astype(np.int64), [vmin, vmax, vmed, vsum])


def _stream(seed_seq: np.random.SeedSequence, n: int, cfg: GeneratorConfig, seen: set) -> ListOpsSplit:
    """The first ``n`` kept trees of one stream that are not in ``seen`` (``seen`` is updated)."""
    rng = np.random.default_rng(seed_seq)
    chunks, lens, labels = [], [], []
    have = 0
    while have < n:
        tokens, lengths, values = _sample_batch(rng, _ROOTS_PER_BATCH, cfg)
        start = 0
        for length, label in zip(lengths.tolist(), values.tolist()):
            seq = tokens[start:start + length]
            start += length
            key = seq.tobytes()
            if key in seen:
                continue
            seen.add(key)
            chunks.append(seq)
            lens.append(length)
            labels.append(label)
            have += 1
            if have == n:
                break
    offsets = np.zeros(n + 1, dtype=np.int64)
    if n:
        np.cumsum(lens, out=offsets[1:])
    flat = np.concatenate(chunks) if chunks else np.zeros(0, np.uint8)
    return ListOpsSplit(flat, offsets, np.asarray(labels, dtype=np.int64))


def _check_size(name: str, n) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"listops: {name} must be a non-negative int, got {n!r}")


def generate(n: int, *, seed: int = 0, config: GeneratorConfig | None = None) -> ListOpsSplit:
    """``n`` distinct samples from one seeded stream (the train stream of ``seed``)."""
    _check_size("n", n)
    cfg = config or GeneratorConfig()
    return _stream(np.random.SeedSequence(seed).spawn(3)[0], n, cfg, set())


def generate_splits(train_size: int = 96_000, val_size: int = 2_000, test_size: int = 2_000, *,
                    seed: int = 0, config: GeneratorConfig | None = None) -> dict[str, ListOpsSplit]:
    """Train/val/test splits with no sequence in two places. Each split has its own stream of
    ``SeedSequence(seed)``; test is drawn first, then val, then train (each skipping what is
    already taken), so test and val do not depend on ``train_size``."""
    for name, n in (("train_size", train_size), ("val_size", val_size), ("test_size", test_size)):
        _check_size(name, n)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"listops: seed must be a non-negative int, got {seed!r}")
    cfg = config or GeneratorConfig()
    streams = np.random.SeedSequence(seed).spawn(3)
    seen: set = set()
    out = {}
    for split, n in (("test", test_size), ("val", val_size), ("train", train_size)):
        out[split] = _stream(streams[SPLITS.index(split)], n, cfg, seen)
    return {s: out[s] for s in SPLITS}
