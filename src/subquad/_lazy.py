"""Packages whose public names load on first use (PEP 562), so that importing them costs nothing
until one is read: ``subquad``, ``subquad.train`` and ``subquad.hf``, which the ``subquad`` command
imports to read its parsers (``subquad --help`` answers without importing torch), and
``subquad.data``, whose loaders need torch and transformers.

A package's ``__init__`` names where each public name lives and takes its module-level
``__getattr__`` and ``__dir__`` from :func:`lazy_module`::

    _LAZY = {"TrainConfig": "config", "train": "trainer"}
    __getattr__, __dir__ = lazy_module(__name__, _LAZY, __all__)

This module imports nothing of subquad, and nothing but the standard library.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Iterable, Mapping
from typing import Any

__all__ = ["lazy_module"]


def lazy_module(package: str, names: Mapping[str, str], public: Iterable[str] = (), *,
                subpackages: bool = False) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` of ``package``: a name of ``names`` is imported from its submodule
    (``names[name]``, relative to ``package``) the first time it is read and then kept in the
    package's namespace; with ``subpackages``, any other public name that is a submodule of
    ``package`` is imported as that submodule."""
    public = list(public)

    def __getattr__(name: str) -> Any:
        namespace = vars(importlib.import_module(package))
        if name in names:
            value = getattr(importlib.import_module(f".{names[name]}", package), name)
        elif subpackages and not name.startswith("_") and importlib.util.find_spec(f"{package}.{name}") is not None:
            value = importlib.import_module(f".{name}", package)
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(importlib.import_module(package))) | set(public))

    return __getattr__, __dir__
