"""Helpers shared by several ops: checks of generator and tensor options, and random draws.

(Input checks of q, k, v and of plain options are in :mod:`subquad.checks`.)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["check_generator", "check_tensor_option", "randn"]


def check_generator(method: str, generator: Any) -> None:
    """TypeError unless ``generator`` is None or a ``torch.Generator``."""
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"{method}: generator must be a torch.Generator, got {type(generator).__name__}")


def check_tensor_option(method: str, name: str, value: Any, shape: str, *, or_none: bool = False) -> None:
    """ValueError unless ``value`` is None or a floating tensor with as many dimensions as
    ``shape`` names (``"(m, D)"``: two); the message names ``shape`` (and None when ``or_none``)."""
    ndim = shape.count(",") + 1
    if value is not None and (not isinstance(value, Tensor) or value.ndim != ndim or not value.is_floating_point()):
        raise ValueError(
            f"{method}: {name} must be a floating {shape} tensor{' or None' if or_none else ''}, got "
            f"{getattr(value, 'shape', type(value).__name__)}"
        )


def randn(shape, generator: torch.Generator | None, like: Tensor) -> Tensor:
    """Standard normal draws with the dtype and device of ``like``; drawn on the generator's
    device (CPU for a CPU generator) and moved, so a CPU generator works for any device."""
    if generator is None:
        return torch.randn(shape, dtype=like.dtype, device=like.device)
    out = torch.randn(shape, generator=generator, dtype=like.dtype, device=generator.device)
    return out.to(like.device)
