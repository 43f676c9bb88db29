"""English prose from the docstrings of installed Python packages, read without importing them.

Docstrings are read from the ``.py`` sources with :mod:`ast` (no import, sorted file order, so
the same installed version gives the same text), split into paragraphs at blank lines, and kept
when they look like prose (mostly letters, few code symbols). :mod:`subquad.hf.texts` builds its
training and held-out texts on these, :mod:`subquad.data.smollm` its long inputs.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path
from typing import Iterator

__all__ = ["package_dir", "is_prose", "iter_docstrings", "docstrings"]

EXCLUDE = ("test", "tests", "_vendor", "site-packages")


def package_dir(name: str) -> Path | None:
    """The folder of the installed package ``name`` (found without importing it), or None."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def is_prose(text: str) -> bool:
    """At least 200 characters, over 90 % letters and spaces, few code symbols."""
    if len(text) < 200:
        return False
    letters = sum(c.isalpha() or c.isspace() for c in text)
    code = sum(text.count(s) for s in (">>>", "::", "{", "}", "=", "_", "`", "|", "[", "]"))
    return letters / len(text) > 0.9 and code < len(text) / 120


def iter_docstrings(root: Path, *, exclude: tuple[str, ...] = EXCLUDE) -> Iterator[str]:
    """Prose paragraphs of every docstring (module, class, function) under ``root``, whitespace
    collapsed, in sorted file order, duplicates dropped; lazily, file by file."""
    seen: set[str] = set()
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
                if is_prose(para) and para not in seen:
                    seen.add(para)
                    yield para


def docstrings(root: Path, *, exclude: tuple[str, ...] = EXCLUDE) -> list[str]:
    """All of :func:`iter_docstrings` as a list."""
    return list(iter_docstrings(root, exclude=exclude))
