"""English text that ships with Python packages, read without importing them.

Training text for :func:`subquad.hf.transfer` comes from the docstrings of installed
*third-party* packages (numpy, torch, transformers by default); the docstrings of the Python
*standard library* are kept for evaluation, so the two never overlap. Docstrings are read from
the ``.py`` sources with :mod:`ast` (no import, deterministic order), split into paragraphs
at blank lines, and kept when they look like prose (mostly letters, few code symbols).
"""

from __future__ import annotations

import ast
import importlib.util
import random
import sysconfig
from pathlib import Path

__all__ = ["docstrings", "third_party_texts", "stdlib_paragraphs", "pack"]


def _package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _prose(text: str) -> bool:
    if len(text) < 200:
        return False
    letters = sum(c.isalpha() or c.isspace() for c in text)
    code = sum(text.count(s) for s in (">>>", "::", "{", "}", "=", "_", "`", "|", "[", "]"))
    return letters / len(text) > 0.9 and code < len(text) / 120


def docstrings(root: Path, *, exclude: tuple[str, ...] = ("test", "tests", "_vendor", "site-packages")) -> list[str]:
    """Prose paragraphs of every docstring (module, class, function) under ``root``, in sorted
    file order, duplicates removed."""
    seen: set[str] = set()
    out = []
    for path in sorted(root.rglob("*.py")):
        if any(part in exclude for part in path.relative_to(root).parts[:-1]):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            doc = ast.get_docstring(node)
            if not doc:
                continue
            for para in doc.split("\n\n"):
                para = " ".join(para.split())
                if _prose(para) and para not in seen:
                    seen.add(para)
                    out.append(para)
    return out


def third_party_texts(packages: tuple[str, ...] = ("numpy", "torch", "transformers")) -> list[str]:
    """Prose paragraphs from the docstrings of installed third-party packages (training text)."""
    out = []
    for name in packages:
        root = _package_dir(name)
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
