"""Landmark networks for LARA and the attention core that owns them.

``MultiheadAttention(E, H, method="lara", proposal=...)`` picks how the proposal means
``mu_c = q~_c + k~_c`` are built from the per-head queries and keys:

- ``"none"`` (default): masked segment means computed by the op; no parameters, so LARA can
  replace the attention of a trained softmax model.
- ``"adaptive-1d"``: ``Linear(d, d) -> LayerNorm(d)`` on every query (and, separately, every key),
  weights shared across heads, then masked means over C = min(num_landmarks, N, M) contiguous
  segments (:class:`AdaptiveLandmarks1d`). For sequences.
- ``"pool"`` / ``"pool-mixed"``: for tokens that form an ``(Hg, Wg)`` grid (row-major, as
  ``x.flatten(1, 2)`` of a ``(B, Hg, Wg, E)`` image): adaptive average pooling of each head to a
  ``g x g`` grid with ``g = isqrt(num_landmarks)`` (so C = g^2), then ``Linear + LayerNorm``;
  ``-mixed`` lets the key landmarks attend to each other,
  ``k~ <- softmax(s k~ k~^T) k~`` (:class:`PooledLandmarks2d`). The grid is the core option
  ``grid_size=(Hg, Wg)``; None means a square grid (N must be a perfect square).

The attention itself always uses the raw q and k; the networks only place the proposals.
Linear layers start from ``trunc_normal(std=0.02)`` with zero bias, LayerNorm from (1, 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from ..checks import check_choice
from ..ops.nystrom import segment_means
from .attention import AttentionCore

__all__ = ["AdaptiveLandmarks1d", "PooledLandmarks2d", "LaraCore", "PROPOSALS"]

PROPOSALS = ("none", "adaptive-1d", "pool", "pool-mixed")


def _projection(dim: int, device=None, dtype=None) -> nn.Sequential:
    """``Linear(dim, dim) -> LayerNorm(dim)`` with the authors' initialisation."""
    linear = nn.Linear(dim, dim, device=device, dtype=dtype)
    nn.init.trunc_normal_(linear.weight, std=0.02)
    nn.init.zeros_(linear.bias)
    return nn.Sequential(linear, nn.LayerNorm(dim, device=device, dtype=dtype))


def _query_keep(key_padding_mask: Tensor | None, n: int, m: int) -> Tensor | None:
    """Bool ``(B, N)`` of real queries: in self-attention (N == M) the key padding mask marks
    padded queries too (library convention); otherwise every query is real (None)."""
    if key_padding_mask is None or n != m:
        return None
    return ~key_padding_mask


class AdaptiveLandmarks1d(nn.Module):
    """``adaptive-1d`` proposals: q~, k~ ``(B, H, C, d)`` from q ``(B, H, N, d)`` and k
    ``(B, H, M, d)``, as masked segment means of ``LayerNorm(Linear(x))`` over
    C = min(num_landmarks, N, M) contiguous segments (uneven when C does not divide the
    length: the last ``length % C`` segments are one longer). Padded tokens are left out of
    the means (their content never matters; their count sets the segments)."""

    def __init__(self, head_dim: int, num_landmarks: int, *, device=None, dtype=None):
        super().__init__()
        self.num_landmarks = num_landmarks
        self.q_net = _projection(head_dim, device, dtype)
        self.k_net = _projection(head_dim, device, dtype)

    def forward(self, q: Tensor, k: Tensor, key_padding_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        n, m = q.shape[2], k.shape[2]
        c = min(self.num_landmarks, n, m)
        keep_k = None if key_padding_mask is None else ~key_padding_mask
        q_land, _ = segment_means(self.q_net(q), c, _query_keep(key_padding_mask, n, m))
        k_land, _ = segment_means(self.k_net(k), c, keep_k)
        return q_land, k_land

    def extra_repr(self) -> str:
        return f"num_landmarks={self.num_landmarks}"


class PooledLandmarks2d(nn.Module):
    """``pool`` / ``pool-mixed`` proposals for tokens on an ``(Hg, Wg)`` grid (row-major).

    Each head's q and k ``(B, H, Hg*Wg, d)`` are average-pooled to a ``g x g`` grid with
    ``g = isqrt(num_landmarks)`` (``adaptive_avg_pool2d``, so any grid size works; padded tokens
    are left out of the averages, and a cell with no real token gives 0), flattened to C = g^2
    landmarks, then passed through ``Linear + LayerNorm`` (shared across heads; q and k have
    separate networks). With ``mixed=True`` the key landmarks are replaced by
    ``softmax(scale * k~ k~^T) k~`` (default scale ``d ** -0.5``). Self-attention only.
    """

    def __init__(self, head_dim: int, num_landmarks: int, *, mixed: bool = False, scale: float | None = None,
                 device=None, dtype=None):
        super().__init__()
        self.grid = math.isqrt(num_landmarks)
        self.mixed = mixed
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.q_net = _projection(head_dim, device, dtype)
        self.k_net = _projection(head_dim, device, dtype)

    @property
    def num_landmarks(self) -> int:
        """C = isqrt(num_landmarks) ** 2."""
        return self.grid * self.grid

    def _pool(self, x: Tensor, grid_size: tuple[int, int], keep: Tensor | None) -> Tensor:
        B, H, L, d = x.shape
        img = x.transpose(-2, -1).reshape(B * H, d, *grid_size)
        if keep is None:
            pooled = F.adaptive_avg_pool2d(img, self.grid)
        else:
            w = keep.to(x.dtype)[:, None, :].expand(B, H, L).reshape(B * H, 1, *grid_size)
            pooled = F.adaptive_avg_pool2d(img * w, self.grid)
            share = F.adaptive_avg_pool2d(w, self.grid)
            pooled = torch.where(share > 0, pooled / share.clamp_min(torch.finfo(x.dtype).tiny), 0.0)
        return pooled.reshape(B, H, d, -1).transpose(-2, -1)  # (B, H, C, d)

    def forward(self, q: Tensor, k: Tensor, key_padding_mask: Tensor | None = None,
                grid_size: tuple[int, int] | None = None) -> tuple[Tensor, Tensor]:
        n = q.shape[2]
        if k.shape[2] != n:
            raise ValueError(f"lara: pooled proposals need self-attention (equal query and key lengths), "
                             f"got N={n}, M={k.shape[2]}")
        grid_size = square_grid(n) if grid_size is None else tuple(grid_size)
        if grid_size[0] * grid_size[1] != n:
            raise ValueError(f"lara: grid_size {grid_size} does not hold the {n} tokens")
        keep = None if key_padding_mask is None else ~key_padding_mask
        q_land = self.q_net(self._pool(q, grid_size, keep))
        k_land = self.k_net(self._pool(k, grid_size, keep))
        if self.mixed:
            k_land = torch.softmax(self.scale * k_land @ k_land.transpose(-2, -1), dim=-1) @ k_land
        return q_land, k_land

    def extra_repr(self) -> str:
        return f"grid={self.grid}x{self.grid}, mixed={self.mixed}"


def square_grid(n: int) -> tuple[int, int]:
    """``(g, g)`` with ``g * g == n``; ValueError naming ``grid_size`` otherwise."""
    g = math.isqrt(n)
    if g * g != n:
        raise ValueError(f"lara: {n} tokens do not form a square grid; pass grid_size=(height, width)")
    return g, g


@dataclass
class LaraModuleOptions:
    """``proposal``: the landmark network (one of :data:`PROPOSALS`); ``grid_size``: ``(height,
    width)`` of the token grid of the ``pool`` proposals (None: square)."""

    proposal: str = "none"
    grid_size: tuple[int, int] | None = None

    def __post_init__(self):
        check_choice("lara", "proposal", self.proposal, PROPOSALS)
        g = self.grid_size
        if g is not None:
            ok = (isinstance(g, (tuple, list)) and len(g) == 2
                  and all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in g))
            if not ok:
                raise ValueError(f"lara: grid_size must be (height, width) positive ints or None, got {g!r}")
            self.grid_size = tuple(g)


class LaraCore(AttentionCore):
    """LARA inside ``MultiheadAttention``: owns the landmark network chosen by ``proposal``
    (see the module docstring) and runs the op in training mode (``w = mu + noise``) while the
    module trains, and with ``w = mu`` (deterministic) in eval. ``grid_size`` is the token grid
    of the ``pool`` proposals. The op's ``training``, ``q_landmarks`` and ``k_landmarks`` are set
    by the core, not by the caller."""

    module_options = LaraModuleOptions

    def __init__(self, method, num_heads, head_dim, options, *, dropout=0.0, device=None, dtype=None):
        for owned in ("training", "q_landmarks", "k_landmarks"):
            if owned in options:
                raise ValueError(f"lara: MultiheadAttention sets {owned!r} itself (training follows "
                                 ".train()/.eval(), landmarks come from proposal=...); do not pass it")
        super().__init__(method, num_heads, head_dim, options)
        self.proposal = proposal = self.module.proposal
        self.grid_size = self.module.grid_size
        num_landmarks = method.make_options(**self.options).num_landmarks
        self.landmarks: nn.Module | None = None
        if proposal == "adaptive-1d":
            self.landmarks = AdaptiveLandmarks1d(head_dim, num_landmarks, device=device, dtype=dtype)
        elif proposal in ("pool", "pool-mixed"):
            self.landmarks = PooledLandmarks2d(head_dim, num_landmarks, mixed=proposal == "pool-mixed",
                                               device=device, dtype=dtype)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None, causal: bool,
                extra_keys: int = 0) -> Tensor:
        """As :meth:`AttentionCore.forward`; the landmark networks see the input's keys only
        (not the last ``extra_keys``, which ``add_bias_kv`` / ``add_zero_attn`` appended)."""
        opts = {**self.options, "training": self.training}
        if self.landmarks is not None and not causal:  # causal: let the op refuse it
            m = k.shape[2] - extra_keys
            k_in = k[:, :, :m]
            pad_in = None if key_padding_mask is None else key_padding_mask[:, :m]
            if isinstance(self.landmarks, PooledLandmarks2d):
                q_land, k_land = self.landmarks(q, k_in, pad_in, self.grid_size)
            else:
                q_land, k_land = self.landmarks(q, k_in, pad_in)
            opts.update(q_landmarks=q_land, k_landmarks=k_land)
        return self.method.op(q, k, v, key_padding_mask=key_padding_mask, causal=causal, **opts)

    def reset_parameters(self) -> None:
        """The landmark networks' initialisation: ``trunc_normal(std=0.02)`` weights, zero biases,
        LayerNorm (1, 0)."""
        if self.landmarks is None:
            return
        for mod in self.landmarks.modules():
            if isinstance(mod, nn.Linear):
                nn.init.trunc_normal_(mod.weight, std=0.02)
                nn.init.zeros_(mod.bias)
            elif isinstance(mod, nn.LayerNorm):
                mod.reset_parameters()

    def extra_repr(self) -> str:
        extra = f", proposal={self.proposal!r}"
        if self.grid_size is not None:
            extra += f", grid_size={self.grid_size}"
        return super().extra_repr() + extra
