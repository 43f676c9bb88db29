"""The attention core of a stochastic method that draws its random tensors once: the tensors of
its registry entry's ``fixed_draw`` (MagicPIG's hash directions) are buffers of the core, drawn
at construction and passed to every call, training and eval, so the module's output is a
deterministic function of its input."""

from __future__ import annotations

import torch

from .attention import AttentionCore

__all__ = ["DrawnCore"]


class DrawnCore(AttentionCore):
    """Keeps ``method.fixed_draw(options, head_dim, generator)`` as buffers (drawn from the
    ``generator`` option if one is given, else from the global RNG)."""

    def __init__(self, method, num_heads, head_dim, options, *, dropout=0.0, device=None, dtype=None):
        super().__init__(method, num_heads, head_dim, options, dropout=dropout, device=device, dtype=dtype)
        drawn = self._draw()
        given = sorted(set(drawn) & set(self.options))
        if given:
            raise ValueError(f"{method.name}: MultiheadAttention draws and keeps {given}; do not pass them")
        for name, t in drawn.items():
            self.register_buffer(name, t.to(device=device))
        self.drawn = tuple(drawn)

    def _draw(self) -> dict[str, torch.Tensor]:
        o = self.method.make_options(**self.options)
        return self.method.fixed_draw(o, self.head_dim, o.generator)

    def op_options(self):
        return {**super().op_options(), **{name: getattr(self, name) for name in self.drawn}}

    def reset_parameters(self) -> None:
        """Draw the buffers again (what initialises them after ``to_empty()`` of a meta-device module)."""
        with torch.no_grad():
            for name, t in self._draw().items():
                getattr(self, name).copy_(t)
        super().reset_parameters()
