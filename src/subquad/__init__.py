"""subquad: sub-quadratic attention for PyTorch, measured against exact attention.

The names below are imported on first use (PEP 562), so ``import subquad`` costs nothing until one
of them is read, and the ``subquad`` command answers ``--help`` without importing torch. The
registry imports :mod:`subquad.ops`, which registers the built-in methods, the first time it is
asked for a method, and ``subquad.ops``, ``subquad.layers`` and the other subpackages load when
first read as attributes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._lazy import lazy_module

__version__ = "0.1.0"

#: public name -> the module that defines it
_LAZY = {
    "attention": "registry",
    "list_methods": "registry",
    "get_method": "registry",
    "register_method": "registry",
    "MethodInfo": "registry",
    "MultiheadAttention": "layers",
}

__all__ = [
    "attention",
    "list_methods",
    "get_method",
    "register_method",
    "MethodInfo",
    "MultiheadAttention",
    "__version__",
]

__getattr__, __dir__ = lazy_module(__name__, _LAZY, __all__, subpackages=True)

if TYPE_CHECKING:  # what static tools see; at run time __getattr__ imports these
    from . import ops  # noqa: F401
    from .layers import MultiheadAttention  # noqa: F401
    from .registry import MethodInfo, attention, get_method, list_methods, register_method  # noqa: F401
