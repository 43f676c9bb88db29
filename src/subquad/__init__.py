"""subquad: sub-quadratic attention for PyTorch, measured against exact attention."""

from .registry import MethodInfo, attention, get_method, list_methods, register_method
from . import ops  # noqa: F401  (registers the built-in methods)
from .layers import MultiheadAttention

__version__ = "0.1.0"

__all__ = [
    "attention",
    "list_methods",
    "get_method",
    "register_method",
    "MethodInfo",
    "MultiheadAttention",
    "__version__",
]
