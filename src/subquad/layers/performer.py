"""The attention core of Performer: the fixed projection it owns for eval."""

from __future__ import annotations

import torch

from ..ops.performer import random_projection
from .attention import AttentionCore

__all__ = ["PerformerCore"]


class PerformerCore(AttentionCore):
    """Performer with a fixed projection buffer for eval (deterministic) and, while training
    with ``redraw_features=True`` (default), a fresh projection at every forward."""

    module_options = ("redraw_features",)

    def __init__(self, method, num_heads, head_dim, options, *, dropout=0.0, device=None, dtype=None):
        options = dict(options)
        self.redraw_features = options.pop("redraw_features", True)
        if not isinstance(self.redraw_features, bool):
            raise TypeError(f"performer: redraw_features must be a bool, got {self.redraw_features!r}")
        if "features" in options:
            raise ValueError("performer: MultiheadAttention owns its features; do not pass 'features'")
        super().__init__(method, num_heads, head_dim, options)
        o = method.make_options(**options)
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
