"""ListOps files: the LRA TSV format (read and write), a tokenised cache, and the meta file."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np

from .dataset import ListOpsSplit, label_distribution, majority_baseline
from .generator import SPLITS, GeneratorConfig, generate_splits
from .grammar import NUM_CLASSES, TOKENS, VOCAB_SIZE

__all__ = ["split_path", "read_split", "write_splits", "load_splits", "generate_and_write"]

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
