"""LRA ListOps: a seeded, fast re-implementation of the generator, TSV files, and a dataset.

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
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

__all__ = [
    "PAD",
    "CLOSE",
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

PAD = 0
OPERATORS = ("[MIN", "[MAX", "[MED", "[SM")
TOKENS = ("<pad>",) + tuple(str(d) for d in range(10)) + OPERATORS + ("]",)
CLOSE = TOKENS.index("]")
FIRST_OP = TOKENS.index("[MIN")
VOCAB_SIZE = len(TOKENS)  # 16
NUM_CLASSES = 10
SPLITS = ("train", "val", "test")
_TOKEN_ID = {t: i for i, t in enumerate(TOKENS) if i != PAD}
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


# --------------------------------------------------------------------------- token helpers


def encode(source: str) -> list[int]:
    """Token ids of a source string (whitespace separated; ``(`` and ``)`` are ignored)."""
    out = []
    for tok in source.replace("(", " ").replace(")", " ").split():
        if tok not in _TOKEN_ID:
            raise ValueError(f"listops: unknown token {tok!r}; the vocabulary is {list(TOKENS[1:])}")
        out.append(_TOKEN_ID[tok])
    return out


def decode(ids) -> str:
    """Source string of token ids (padding ids are skipped)."""
    return " ".join(TOKENS[int(i)] for i in ids if int(i) != PAD)


def _apply(op: str, values: list[int]) -> int:
    if op == "[MIN":
        return min(values)
    if op == "[MAX":
        return max(values)
    if op == "[MED":
        return int(np.median(values))
    return sum(values) % 10


def evaluate(ids) -> int:
    """Value of one expression given as token ids (or a source string); a plain stack
    evaluator, the oracle for the vectorised generator."""
    if isinstance(ids, str):
        ids = encode(ids)
    stack: list[tuple[str, list[int]]] = []
    result = None
    for i in ids:
        i = int(i)
        if i == PAD:
            continue
        if result is not None:
            raise ValueError("listops: tokens after the end of the expression")
        tok = TOKENS[i]
        if tok in OPERATORS:
            stack.append((tok, []))
        elif tok == "]":
            if not stack:
                raise ValueError("listops: ']' without an open list")
            op, values = stack.pop()
            if not values:
                raise ValueError(f"listops: empty list {op} ]")
            value = _apply(op, values)
            if stack:
                stack[-1][1].append(value)
            else:
                result = value
        else:
            value = int(tok)
            if stack:
                stack[-1][1].append(value)
            else:
                result = value
    if stack or result is None:
        raise ValueError("listops: incomplete expression")
    return result


def tree_depth(ids) -> tuple[int, int]:
    """``(depth, widest list)`` of an expression: depth counts the digit level (a lone digit has
    depth 1, ``[SM 1 2 ]`` depth 2); widest is the largest argument count of any list."""
    depth = widest = 0
    stack: list[int] = []
    for i in ids:
        i = int(i)
        if FIRST_OP <= i < CLOSE:
            if stack:
                stack[-1] += 1
            stack.append(0)
            depth = max(depth, len(stack))
        elif i == CLOSE:
            widest = max(widest, stack.pop())
        elif i != PAD:
            if stack:
                stack[-1] += 1
            depth = max(depth, len(stack) + 1)
    return depth, widest


# --------------------------------------------------------------------------- generator


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


# --------------------------------------------------------------------------- statistics


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


# --------------------------------------------------------------------------- files

_TOKEN_TEXT = np.zeros((VOCAB_SIZE, 4), dtype=np.uint8)
_TOKEN_TEXT_LEN = np.zeros(VOCAB_SIZE, dtype=np.int64)
for _i, _t in enumerate(TOKENS[1:], start=1):
    _TOKEN_TEXT[_i, : len(_t)] = np.frombuffer(_t.encode(), dtype=np.uint8)
    _TOKEN_TEXT_LEN[_i] = len(_t)
# the reader looks up one-byte tokens in a table and longer ones by their 32-bit key (text bytes,
# little endian) in a small perfect hash: key % size is distinct for every token
_SINGLE_ID = np.zeros(256, dtype=np.uint8)
_LONG_KEYS = {}
for _i, _t in enumerate(TOKENS[1:], start=1):
    if len(_t) == 1:
        _SINGLE_ID[ord(_t)] = _i
    else:
        _LONG_KEYS[int(_TOKEN_TEXT[_i].view("<u4")[0])] = _i
_size = next(m for m in range(len(_LONG_KEYS), 1 << 16)
             if len({k % m for k in _LONG_KEYS}) == len(_LONG_KEYS))
_HASH_KEYS = np.zeros(_size, dtype=np.uint32)  # 0 never matches: a real key has a non-zero first byte
_HASH_IDS = np.zeros(_size, dtype=np.uint8)
for _k, _i in _LONG_KEYS.items():
    _HASH_KEYS[_k % _size] = _k
    _HASH_IDS[_k % _size] = _i
_SEPARATORS = np.zeros(256, dtype=bool)
_SEPARATORS[[ord(c) for c in " \t\r\n()"]] = True


def split_path(directory: str | os.PathLike, split: str) -> Path:
    """``DIR/basic_{split}.tsv`` (the LRA file names)."""
    return Path(directory) / f"basic_{split}.tsv"


def _write_tsv(path: Path, data: ListOpsSplit) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(b"Source\tTarget\n")
        chunk = 4096
        for a in range(0, len(data), chunk):
            b = min(a + chunk, len(data))
            ids = data.tokens[data.offsets[a]:data.offsets[b]]
            text = np.full((len(ids), 5), ord(" "), dtype=np.uint8)
            text[:, :4] = _TOKEN_TEXT[ids]
            keep = np.ones((len(ids), 5), dtype=bool)
            keep[:, :4] = np.arange(4)[None, :] < _TOKEN_TEXT_LEN[ids][:, None]
            buf = text[keep].tobytes()  # every token followed by one space
            ends = np.cumsum(_TOKEN_TEXT_LEN[ids] + 1)
            line_ends = ends[data.offsets[a + 1:b + 1] - data.offsets[a] - 1]
            start = 0
            for end, label in zip(line_ends.tolist(), data.labels[a:b].tolist()):
                f.write(buf[start:end - 1])
                f.write(b"\t%d\n" % label)
                start = end
    os.replace(tmp, path)


def read_split(path: str | os.PathLike) -> ListOpsSplit:
    """Read one TSV split (ours or the LRA release's); unknown tokens are a ValueError."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"listops: no such file {str(path)!r}")
    with open(path, "rb") as f:
        header = f.readline()
        if not header.startswith(b"Source"):
            raise ValueError(f"listops: {str(path)!r} does not start with the header 'Source<TAB>Target'")
        lines = [line for line in f.read().split(b"\n") if line.strip()]
    sources, labels = [], []
    for lineno, line in enumerate(lines, start=2):
        src, sep, target = line.rpartition(b"\t")
        if not sep:
            raise ValueError(f"listops: {str(path)!r} line {lineno} has no tab")
        try:
            label = int(target)
        except ValueError:
            raise ValueError(f"listops: {str(path)!r} line {lineno}: bad label {target[:20]!r}") from None
        if not 0 <= label < NUM_CLASSES:
            raise ValueError(f"listops: {str(path)!r} line {lineno}: label {label} outside 0..9")
        sources.append(src)
        labels.append(label)
    tokens, counts = [], []
    chunk = 4096
    for a in range(0, len(sources), chunk):
        t, c = _tokenize(sources[a:a + chunk], path, a + 2)
        tokens.append(t)
        counts.append(c)
    counts = np.concatenate(counts) if counts else np.zeros(0, np.int64)
    offsets = np.zeros(len(labels) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    flat = np.concatenate(tokens) if tokens else np.zeros(0, np.uint8)
    return ListOpsSplit(flat, offsets, np.asarray(labels, dtype=np.int64))


def _tokenize(sources: list[bytes], path: Path, first_line: int) -> tuple[np.ndarray, np.ndarray]:
    """Vectorised tokenisation of many source lines: ``(ids uint8 flat, tokens per line)``."""
    joined = b"\n" + b"\n".join(sources) + b"\n"
    arr = np.frombuffer(joined, dtype=np.uint8)
    sep = _SEPARATORS[arr]
    edge = np.diff(sep.view(np.int8))  # -1: a token starts at i + 1; +1: a token ends at i + 1
    starts = np.flatnonzero(edge == -1) + 1
    ends = np.flatnonzero(edge == 1) + 1
    lens = ends - starts
    ids = _SINGLE_ID[arr[starts]]
    ids[lens != 1] = 0
    long = np.flatnonzero(lens > 1)
    if len(long):
        start, n = starts[long], lens[long]
        key = arr[start].astype(np.uint32)
        for j in range(1, 4):
            byte = np.where(n > j, arr[np.minimum(start + j, len(arr) - 1)], 0).astype(np.uint32)
            key |= byte << np.uint32(8 * j)
        slot = key % np.uint32(len(_HASH_KEYS))
        ok = (_HASH_KEYS[slot] == key) & (n <= 4)
        ids[long] = np.where(ok, _HASH_IDS[slot], 0)
    line_ends = np.flatnonzero(arr == ord("\n"))[1:]
    if not ids.all():
        i = int(np.flatnonzero(ids == 0)[0])
        line = int(np.searchsorted(line_ends, starts[i]))
        tok = joined[starts[i]:ends[i]].decode(errors="replace")
        raise ValueError(f"listops: {str(path)!r} line {first_line + line}: unknown token {tok!r}; "
                         f"the vocabulary is {list(TOKENS[1:])}")
    counts = np.diff(np.searchsorted(starts, line_ends), prepend=0).astype(np.int64)
    return ids, counts


def write_splits(directory: str | os.PathLike, splits: dict[str, ListOpsSplit], *,
                 meta: dict | None = None) -> None:
    """Write ``basic_{train,val,test}.tsv`` and ``meta.json`` (sizes, label distributions,
    majority baseline, and ``meta``) into ``directory``; each file is written atomically."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for split, data in splits.items():
        _write_tsv(split_path(directory, split), data)
        _write_cache(split_path(directory, split), data)
    info = dict(meta or {})
    info["sizes"] = {s: len(d) for s, d in splits.items()}
    info["label_distribution"] = {s: label_distribution(d.labels) for s, d in splits.items()}
    info["length"] = {s: _length_stats(d) for s, d in splits.items()}
    if "train" in splits and "test" in splits:
        cls, acc = majority_baseline(splits["train"].labels, splits["test"].labels)
        info["majority_class"] = cls
        info["majority_test_accuracy"] = acc
    tmp = directory / "meta.json.tmp"
    tmp.write_text(json.dumps(info, indent=2) + "\n")
    os.replace(tmp, directory / "meta.json")


def _length_stats(data: ListOpsSplit) -> dict:
    lengths = data.lengths()
    if len(lengths) == 0:
        return {}
    return {"min": int(lengths.min()), "max": int(lengths.max()), "mean": float(lengths.mean()),
            "median": float(np.median(lengths))}


def load_splits(directory: str | os.PathLike, splits=SPLITS, *,
                cache: bool = True) -> dict[str, ListOpsSplit]:
    """Read the given splits from ``directory``; a clear error when the data is missing.

    With ``cache`` (default) a tokenised copy ``basic_{split}.npz`` is used when it matches the
    TSV file (same size and modification time), and written next to it (if the directory is
    writable) after parsing the TSV."""
    directory = Path(directory)
    missing = [str(split_path(directory, s)) for s in splits if not split_path(directory, s).is_file()]
    if missing:
        raise FileNotFoundError(
            f"listops: no ListOps data in {str(directory)!r} (missing {missing}); create it with "
            f"`subquad data listops --out {directory}`"
        )
    return {s: _load_cached(split_path(directory, s)) if cache else read_split(split_path(directory, s))
            for s in splits}


def _fingerprint(path: Path) -> np.ndarray:
    st = path.stat()
    return np.array([st.st_size, st.st_mtime_ns], dtype=np.int64)


def _write_cache(path: Path, data: ListOpsSplit) -> None:
    cache = path.with_suffix(".npz")
    tmp = cache.with_name(cache.name + ".tmp.npz")
    try:
        np.savez(tmp, tokens=data.tokens, offsets=data.offsets, labels=data.labels, source=_fingerprint(path))
        os.replace(tmp, cache)
    except OSError:  # a read-only data directory: no cache
        tmp.unlink(missing_ok=True)


def _load_cached(path: Path) -> ListOpsSplit:
    cache = path.with_suffix(".npz")
    if cache.is_file():
        try:
            with np.load(cache, allow_pickle=False) as z:
                if np.array_equal(z["source"], _fingerprint(path)):
                    return ListOpsSplit(z["tokens"], z["offsets"], z["labels"])
        except (OSError, ValueError, KeyError):
            pass  # unreadable cache: parse the TSV again
    data = read_split(path)
    _write_cache(path, data)
    return data


def generate_and_write(directory: str | os.PathLike, *, train_size: int = 96_000, val_size: int = 2_000,
                       test_size: int = 2_000, seed: int = 0, config: GeneratorConfig | None = None) -> dict:
    """Generate the splits and write them; returns the meta dict (with ``seconds``)."""
    cfg = config or GeneratorConfig()
    t0 = time.perf_counter()
    splits = generate_splits(train_size, val_size, test_size, seed=seed, config=cfg)
    gen_s = time.perf_counter() - t0
    meta = {"task": "listops", "seed": seed, "generator": cfg.__dict__, "vocabulary": list(TOKENS),
            "generate_seconds": round(gen_s, 3)}
    write_splits(directory, splits, meta=meta)
    meta = json.loads((Path(directory) / "meta.json").read_text())
    meta["seconds"] = round(time.perf_counter() - t0, 3)
    return meta


# --------------------------------------------------------------------------- dataset


class ListOpsDataset(torch.utils.data.Dataset):
    """Tokenised ListOps split. ``ds[i]`` is ``(tokens int64 (L_i,), label)``;
    :meth:`batch` pads a list of indices and returns ``tokens (B, L)`` int64,
    ``key_padding_mask (B, L)`` bool (True = padding) and ``labels (B,)`` int64."""

    def __init__(self, data: ListOpsSplit):
        self.data = data

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "ListOpsDataset":
        return cls(read_split(path))

    def __len__(self) -> int:
        return len(self.data)

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
