"""The attention core of Performer: the fixed projection it owns for eval."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..checks import check_bool
from ..ops.performer import random_projection
from .attention import AttentionCore

__all__ = ["PerformerCore", "PerformerModuleOptions"]


@dataclass
class PerformerModuleOptions:
    """``redraw_features``: draw a fresh projection at every training forward (eval always uses
    the fixed one)."""

    redraw_features: bool = True

    def __post_init__(self):
        check_bool("performer", "redraw_features", self.redraw_features)


class PerformerCore(AttentionCore):
    """Performer with a fixed projection buffer for eval (deterministic) and, while training
    with ``redraw_features=True`` (default), a fresh projection at every forward."""

    module_options = PerformerModuleOptions

    def __init__(self, method, num_heads, head_dim, options, *, dropout=0.0, device=None, dtype=None):
        if "features" in options:
            raise ValueError("performer: MultiheadAttention owns its features; do not pass 'features'")
        super().__init__(method, num_heads, head_dim, options)
        self.redraw_features = self.module.redraw_features
        o = method.make_options(**self.options)
        w = random_projection(o.num_features, head_dim, orthogonal=o.orthogonal, generator=o.generator)
        self.register_buffer("features", w.to(device=device, dtype=torch.float32))

    @torch.no_grad()
    def redraw(self, generator: torch.Generator | None = None) -> None:
        """Draw a new fixed projection (the one used in eval)."""
        o = self.method.make_options(**self.options)
        w = random_projection(o.num_features, self.head_dim, orthogonal=o.orthogonal, generator=generator)
        self.features.copy_(w)

    def reset_parameters(self) -> None:
        """Redraw the fixed projection (from the ``generator`` option if one was given); this is
        what initialises the buffer after ``to_empty()`` of a meta-device module."""
        self.redraw(self.method.make_options(**self.options).generator)

    def op_options(self):
        if self.training and self.redraw_features:
            return dict(self.options)
        return {**self.options, "features": self.features}
