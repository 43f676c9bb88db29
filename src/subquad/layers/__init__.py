"""``nn.Module`` layers that own parameters and call the ops: :class:`MultiheadAttention` and
the base :class:`AttentionCore` in ``attention.py``, one file per method whose module owns state
(its core, named by the method's registry entry), and the Hamburger mixer."""

from .attention import (
    AttentionCore,
    MHADtypeError,
    MHAShapeError,
    MHAShapeRuntimeError,
    MultiheadAttention,
)
from .hamburger import Hamburger, HamburgerMixer

__all__ = [
    "MultiheadAttention",
    "AttentionCore",
    "MHAShapeError",
    "MHAShapeRuntimeError",
    "MHADtypeError",
    "Hamburger",
    "HamburgerMixer",
]
