"""``nn.Module`` layers that own parameters and call the ops."""

from .attention import (
    AttentionCore,
    MHADtypeError,
    MHAShapeError,
    MHAShapeRuntimeError,
    MultiheadAttention,
    register_core,
)
from . import lara  # noqa: F401  (registers the LARA core and its landmark networks)
from . import sinkhorn  # noqa: F401  (registers the Sinkhorn core and its sort networks)
from .hamburger import Hamburger, HamburgerMixer

__all__ = [
    "MultiheadAttention",
    "AttentionCore",
    "register_core",
    "MHAShapeError",
    "MHAShapeRuntimeError",
    "MHADtypeError",
    "Hamburger",
    "HamburgerMixer",
]
