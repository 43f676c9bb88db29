"""The attention core of randomized attention: deterministic in eval."""

from __future__ import annotations

from .attention import AttentionCore

__all__ = ["RaCore"]


class RaCore(AttentionCore):
    """Randomized attention (Zheng et al. 2022): the op's ``estimator`` (default ``"sample"``, the
    unbiased stochastic one) while the module trains; in eval always
    ``estimator="mixture_mean"`` (f at the mean of the proposal mixture, no noise: biased, and a
    subquad choice rather than the paper's), so ``.eval()`` is deterministic."""

    def op_options(self):
        if self.training:
            return dict(self.options)
        return {**self.options, "estimator": "mixture_mean"}
