"""English text that ships with Python packages, read without importing them.

Training text for :func:`subquad.hf.transfer` comes from the docstrings of installed
*third-party* packages (numpy, torch, transformers by default); the docstrings of the Python
*standard library* are kept for evaluation, so the two never overlap. Docstrings are read from
the ``.py`` sources with :mod:`ast` (no import, deterministic order), split into paragraphs
at blank lines, and kept when they look like prose (mostly letters, few code symbols): the
reader is :mod:`subquad.data.prose`.
"""

from __future__ import annotations

import random
import sysconfig
from pathlib import Path

from ..data.prose import docstrings, package_dir

__all__ = ["docstrings", "third_party_texts", "stdlib_paragraphs", "pack"]


def third_party_texts(packages: tuple[str, ...] = ("numpy", "torch", "transformers")) -> list[str]:
    """Prose paragraphs from the docstrings of installed third-party packages (training text)."""
    out = []
    for name in packages:
        root = package_dir(name)
        if root is not None:
            out += docstrings(root)
    return out


def stdlib_paragraphs() -> list[str]:
    """Prose paragraphs from the docstrings of the Python standard library (held-out text)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return docstrings(root, exclude=("test", "tests", "idlelib", "site-packages", "lib2to3", "turtledemo"))


def pack(paragraphs: list[str], count: int, *, words: int = 300, seed: int = 0) -> list[str]:
    """``count`` texts of about ``words`` words each, made of shuffled paragraphs joined by
    blank lines (so a model sees long inputs; 300 words is about 400 MiniLM tokens)."""
    rng = random.Random(seed)
    order = list(paragraphs)
    rng.shuffle(order)
    out, cur, n = [], [], 0
    for p in order:
        cur.append(p)
        n += len(p.split())
        if n >= words:
            out.append("\n\n".join(cur))
            cur, n = [], 0
            if len(out) == count:
                break
    return out
