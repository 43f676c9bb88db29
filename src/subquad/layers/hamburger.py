"""Hamburger (Geng et al., ICLR 2021): a global-context block built around a matrix decomposition.

``lower bread`` (1x1 conv) -> ``ham`` (NMF, soft VQ or concept decomposition of the
``D x N`` matrix of positions, see :mod:`subquad.ops.decomposition`) -> ``upper bread``
(1x1 conv), with a residual. The ham has no learnable parameters: by default it starts from
fresh random bases at every forward, runs ``train_steps`` (training) or ``eval_steps`` (eval)
local steps without gradient and back-propagates through one final step only.

- :class:`Hamburger`: feature maps ``(B, C, H, W)``, variants V1, V2 and the light head.
- :class:`HamburgerMixer`: a token mixer for sequences ``(B, N, C)`` with a key padding mask,
  registered as method ``"hamburger"`` (self-only, not causal).
- :class:`MatrixDecomposition`: the ham itself, with the optional persistent dictionary.

The first 1x1 conv after the ham is applied to the factors, ``(W bases) coef^T``, which equals
``W (bases coef^T)`` but never forms the ``(B, D, N)`` reconstruction.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..ops._masks import compute_precision
from ..checks import check_bool, check_choice, check_float, check_int
from ..ops.decomposition import GRAD_MODES, HAMS, HamburgerOptions, factorize, random_bases
from .attention import _as_padding_mask

__all__ = ["Hamburger", "HamburgerMixer", "HamburgerOptions", "MatrixDecomposition"]

VERSIONS = ("v1", "v2", "light")


class MatrixDecomposition(nn.Module):
    """The ham: a matrix decomposition of ``x (B, C, N)`` in ``groups`` groups of ``C / groups``
    channels, ``x[b, group s] ~ bases @ coef^T`` with ``rank`` bases per sample and group.

    Args:
        channels: C, the number of input channels.
        ham: ``"nmf"`` (needs x >= 0), ``"vq"`` or ``"cd"``.
        groups: S; C must be divisible by S. Groups and samples never mix.
        rank: R, bases per group.
        train_steps / eval_steps: local steps in training / eval mode.
        grad: ``"one_step"`` (default) or ``"bptt"``.
        inv_t: softmax inverse temperature (default 1 for NMF, 100 for VQ and CD).
        beta: ridge weight of CD.
        rand_init: True (default): fresh random bases at every forward (the ham then holds no
            state at all). False: a persistent dictionary, the buffer ``bases`` ``(S, C/S, R)``
            drawn at construction; every forward starts from it.
        eta: step of the online dictionary update (``rand_init=False``): after each forward in
            training mode, ``bases <- normalize(bases + eta * (mean_b(final bases) - bases))``
            (columns renormalised to unit norm). Eval forwards never change it.
        update_dictionary: set False to freeze the persistent dictionary.
        generator: draws the persistent dictionary at construction (``rand_init=False``).
    """

    def __init__(self, channels: int, *, ham: str = "nmf", groups: int = 1, rank: int = 64,
                 train_steps: int = 6, eval_steps: int = 7, grad: str = "one_step",
                 inv_t: float | None = None, beta: float = 0.1, rand_init: bool = True, eta: float = 0.9,
                 update_dictionary: bool = True, generator: torch.Generator | None = None, device=None):
        super().__init__()
        check_int("Hamburger", "channels", channels, minimum=1)
        check_choice("Hamburger", "ham", ham, HAMS)
        check_int("Hamburger", "groups", groups, minimum=1)
        if channels % groups:
            raise ValueError(f"Hamburger: the ham's channels ({channels}) must be divisible by groups ({groups})")
        check_int("Hamburger", "rank", rank, minimum=1)
        check_int("Hamburger", "train_steps", train_steps, minimum=0)
        check_int("Hamburger", "eval_steps", eval_steps, minimum=0)
        check_choice("Hamburger", "grad", grad, GRAD_MODES)
        if inv_t is not None:
            check_float("Hamburger", "inv_t", inv_t, minimum=0.0, inclusive=False)
        check_float("Hamburger", "beta", beta, minimum=0.0, inclusive=False)
        check_bool("Hamburger", "rand_init", rand_init)
        check_float("Hamburger", "eta", eta, minimum=0.0)
        if eta > 1:
            raise ValueError(f"Hamburger: eta must be in [0, 1], got {eta}")
        check_bool("Hamburger", "update_dictionary", update_dictionary)
        self.channels = channels
        self.ham = ham
        self.groups = groups
        self.rank = rank
        self.train_steps = train_steps
        self.eval_steps = eval_steps
        self.grad = grad
        self.inv_t = (1.0 if ham == "nmf" else 100.0) if inv_t is None else float(inv_t)
        self.beta = float(beta)
        self.rand_init = rand_init
        self.eta = float(eta)
        self.update_dictionary = update_dictionary
        if rand_init:
            self.register_buffer("bases", None)
        else:
            dist = "uniform" if ham == "nmf" else "normal"
            d = random_bases(groups, channels // groups, rank, distribution=dist, generator=generator)
            self.register_buffer("bases", d.to(device=device))

    @property
    def steps(self) -> int:
        """The number of local steps the next forward runs (depends on ``self.training``)."""
        return self.train_steps if self.training else self.eval_steps

    def forward(self, x: Tensor, key_padding_mask: Tensor | None = None, *,
                generator: torch.Generator | None = None, return_factors: bool = False):
        """``x (B, C, N)`` -> reconstruction ``(B, C, N)`` in the dtype of x, or with
        ``return_factors=True`` the factors ``bases (B*S, C/S, R)`` and ``coef (B*S, N, R)``
        (compute dtype). ``key_padding_mask`` bool ``(B, N)``, True = padded position: it is
        zeroed and excluded from the decomposition, and its output is 0. ``generator`` draws
        the random bases (``rand_init=True``)."""
        if not isinstance(x, Tensor) or x.ndim != 3 or x.shape[1] != self.channels:
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"Hamburger: the ham expects x of shape (B, {self.channels}, N), got {shape}")
        batch, channels, n = x.shape
        s = self.groups
        xg = x.reshape(batch * s, channels // s, n)
        mask = None
        if key_padding_mask is not None:
            if key_padding_mask.dtype != torch.bool or tuple(key_padding_mask.shape) != (batch, n):
                raise ValueError(f"Hamburger: key_padding_mask must be bool (B, N) = {(batch, n)}, got "
                                 f"{key_padding_mask.dtype} {tuple(key_padding_mask.shape)}")
            mask = key_padding_mask.repeat_interleave(s, dim=0)
        bases0 = None if self.rand_init else self.bases.repeat(batch, 1, 1)
        bases, coef = factorize(xg, self.ham, self.rank, steps=self.steps, grad=self.grad, bases=bases0,
                                generator=generator, key_padding_mask=mask, inv_t=self.inv_t, beta=self.beta)
        if self.training and not self.rand_init and self.update_dictionary:
            self.online_update(bases)
        if return_factors:
            return bases, coef
        with compute_precision(x):
            out = torch.bmm(bases, coef.transpose(1, 2))
        return out.reshape(batch, channels, n).to(x.dtype)

    @torch.no_grad()
    def online_update(self, final_bases: Tensor) -> None:
        """Move the persistent dictionary toward the batch mean of ``final_bases``
        ``(B*S, D, R)``: ``bases <- normalize_D(bases + eta * (mean_b - bases))``."""
        if self.rand_init:
            raise RuntimeError("Hamburger: online_update needs the persistent dictionary (rand_init=False)")
        s, d, r = self.bases.shape
        target = final_bases.detach().reshape(-1, s, d, r).mean(0).to(self.bases.dtype)
        self.bases.copy_(F.normalize(self.bases + self.eta * (target - self.bases), dim=1))

    def extra_repr(self) -> str:
        return (f"{self.ham}, channels={self.channels}, groups={self.groups}, rank={self.rank}, "
                f"train_steps={self.train_steps}, eval_steps={self.eval_steps}, grad={self.grad!r}, "
                f"inv_t={self.inv_t}, rand_init={self.rand_init}")


def _linear_of_reconstruction(weight: Tensor, bases: Tensor, coef: Tensor, groups: int, dtype, *,
                              channels_last: bool = False) -> Tensor:
    """``weight (C_out, S*D) @ reconstruction`` for every sample, ``(B, C_out, N)`` (or
    ``(B, N, C_out)`` with ``channels_last``), computed as ``(weight_s @ bases_s) @ coef_s^T``
    summed over the groups s, so the reconstruction is never formed.
    bases ``(B*S, D, R)``, coef ``(B*S, N, R)``."""
    bs, d, r = bases.shape
    batch, n, c_out = bs // groups, coef.shape[1], weight.shape[0]
    with compute_precision(coef):
        w = weight.reshape(c_out, groups, d).to(bases.dtype)
        wb = torch.einsum("osd,bsdr->bosr", w, bases.reshape(batch, groups, d, r)).reshape(batch, c_out, groups * r)
        coef = coef.reshape(batch, groups, n, r)
        if channels_last:
            out = torch.bmm(coef.transpose(1, 2).reshape(batch, n, groups * r), wb.transpose(1, 2))
        else:
            out = torch.bmm(wb, coef.transpose(2, 3).reshape(batch, groups * r, n))
    return out.to(dtype)


class Hamburger(nn.Module):
    """Hamburger block for feature maps ``(B, C, H, W)`` -> ``(B, C, H, W)``; any H and W.

    Variants (all convs 1x1; ReLU after the lower bread exactly when ``ham="nmf"``):

    - ``"v1"`` (paper): ``ReLU(Z + BN(upper(ham(lower(Z)))))``.
    - ``"v2"``: a "cheese" ``conv(D->D, no bias) -> BN -> ReLU`` after the ham, then the upper
      bread with no norm: ``ReLU(Z + upper(cheese(ham(lower(Z)))))``.
    - ``"light"`` (Light-Ham head): as V1 with GroupNorm instead of BatchNorm.

    Args:
        channels: C.
        ham_channels: D, the ham's width (default C); divisible by ``groups``.
        version: ``"v1"`` (default), ``"v2"`` or ``"light"``.
        norm_groups: GroupNorm groups of the light variant (default ``gcd(32, C)``).
        ham, groups, rank, train_steps, eval_steps, grad, inv_t, beta, rand_init, eta,
        update_dictionary: see :class:`MatrixDecomposition`.

    Conv weights are initialised ``N(0, 2 / out_channels)`` (He, fan-out); norms with weight 1,
    bias 0. The lower bread has a bias, the upper bread and the cheese conv do not.
    ``forward(z, *, generator=None)``: ``generator`` draws the ham's random bases.
    """

    def __init__(self, channels: int, ham_channels: int | None = None, *, version: str = "v1",
                 ham: str = "nmf", groups: int = 1, rank: int = 64, train_steps: int = 6, eval_steps: int = 7,
                 grad: str = "one_step", inv_t: float | None = None, beta: float = 0.1, rand_init: bool = True,
                 eta: float = 0.9, update_dictionary: bool = True, norm_groups: int | None = None,
                 device=None, dtype=None):
        super().__init__()
        check_int("Hamburger", "channels", channels, minimum=1)
        ham_channels = channels if ham_channels is None else ham_channels
        check_int("Hamburger", "ham_channels", ham_channels, minimum=1)
        check_choice("Hamburger", "version", version, VERSIONS)
        factory = {"device": device, "dtype": dtype}
        self.channels = channels
        self.ham_channels = ham_channels
        self.version = version
        self.lower_bread = nn.Conv2d(channels, ham_channels, 1, bias=True, **factory)
        self.ham = MatrixDecomposition(ham_channels, ham=ham, groups=groups, rank=rank, train_steps=train_steps,
                                       eval_steps=eval_steps, grad=grad, inv_t=inv_t, beta=beta,
                                       rand_init=rand_init, eta=eta, update_dictionary=update_dictionary,
                                       device=device)
        if version == "v2":
            self.cheese = nn.Sequential(
                nn.Conv2d(ham_channels, ham_channels, 1, bias=False, **factory),
                nn.BatchNorm2d(ham_channels, **factory),
                nn.ReLU(),
            )
            self.upper_bread = nn.Conv2d(ham_channels, channels, 1, bias=False, **factory)
            self.norm = None
        else:
            self.cheese = None
            self.upper_bread = nn.Conv2d(ham_channels, channels, 1, bias=False, **factory)
            if version == "v1":
                self.norm = nn.BatchNorm2d(channels, **factory)
            else:
                if norm_groups is None:
                    norm_groups = math.gcd(32, channels)
                check_int("Hamburger", "norm_groups", norm_groups, minimum=1)
                if channels % norm_groups:
                    raise ValueError(f"norm_groups ({norm_groups}) must divide channels ({channels})")
                self.norm = nn.GroupNorm(norm_groups, channels, **factory)
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, z: Tensor, *, generator: torch.Generator | None = None) -> Tensor:
        if not isinstance(z, Tensor):
            raise TypeError(f"Hamburger: z must be a tensor, got {type(z).__name__}")
        if z.ndim != 4 or z.shape[1] != self.channels:
            raise ValueError(f"Hamburger: z must have shape (B, {self.channels}, H, W), got {tuple(z.shape)}")
        batch, _, height, width = z.shape
        x = self.lower_bread(z)
        if self.ham.ham == "nmf":
            x = F.relu(x)
        bases, coef = self.ham(x.flatten(2), generator=generator, return_factors=True)
        first = self.cheese[0] if self.cheese is not None else self.upper_bread
        y = _linear_of_reconstruction(first.weight.flatten(1), bases, coef, self.ham.groups, x.dtype)
        y = y.reshape(batch, -1, height, width)
        if self.cheese is not None:
            y = self.upper_bread(self.cheese[2](self.cheese[1](y)))
        else:
            y = self.norm(y)
        return F.relu(z + y)

    def extra_repr(self) -> str:
        return f"channels={self.channels}, ham_channels={self.ham_channels}, version={self.version!r}"


class HamburgerMixer(nn.Module):
    """Hamburger as a token mixer: ``(B, N, C)`` -> ``(B, N, C)``, mixing all N positions.

    ``lower bread`` ``Linear(C, C)`` (+ ReLU for NMF) -> ham over the positions, in
    ``num_heads`` groups of ``C / num_heads`` channels (``num_heads`` is the group count S)
    -> ``upper bread`` ``Linear(C, C, bias=False)``. No residual and no norm: it takes the
    place of an attention layer, whose block adds both. Linear weights are Xavier-uniform,
    the bias zero (as the q/k/v projections of :class:`subquad.MultiheadAttention`).

    ``forward(x, key_padding_mask=None, *, generator=None)``: ``key_padding_mask`` bool
    ``(B, N)`` (True = padding; a float 0 / -inf mask also works). Padded positions are zeroed
    after the lower bread and excluded from the decomposition, so they cannot influence real
    positions; their outputs are 0. Not causal: every output depends on every real position.
    Options: see :class:`HamburgerOptions`.
    """

    def __init__(self, embed_dim: int, num_heads: int = 1, *, ham: str = "nmf", rank: int | None = None,
                 train_steps: int = 6, eval_steps: int = 7, grad: str = "one_step", inv_t: float | None = None,
                 beta: float = 0.1, rand_init: bool = True, eta: float = 0.9, device=None, dtype=None):
        super().__init__()
        check_int("hamburger", "embed_dim", embed_dim, minimum=1)
        check_int("hamburger", "num_heads", num_heads, minimum=1)
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        options = HamburgerOptions(ham=ham, rank=rank, train_steps=train_steps, eval_steps=eval_steps,
                                   grad=grad, inv_t=inv_t, beta=beta, rand_init=rand_init, eta=eta)
        head_dim = embed_dim // num_heads
        if rank is None:
            rank = min(64, max(1, head_dim // 8))
        factory = {"device": device, "dtype": dtype}
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.options = options
        self.lower_bread = nn.Linear(embed_dim, embed_dim, bias=True, **factory)
        self.ham = MatrixDecomposition(embed_dim, ham=ham, groups=num_heads, rank=rank, train_steps=train_steps,
                                       eval_steps=eval_steps, grad=grad, inv_t=inv_t, beta=beta,
                                       rand_init=rand_init, eta=eta, device=device)
        self.upper_bread = nn.Linear(embed_dim, embed_dim, bias=False, **factory)
        nn.init.xavier_uniform_(self.lower_bread.weight)
        nn.init.zeros_(self.lower_bread.bias)
        nn.init.xavier_uniform_(self.upper_bread.weight)

    def forward(self, x: Tensor, key_padding_mask: Tensor | None = None, *,
                generator: torch.Generator | None = None) -> Tensor:
        if not isinstance(x, Tensor):
            raise TypeError(f"hamburger: x must be a tensor, got {type(x).__name__}")
        if x.ndim != 3 or x.shape[-1] != self.embed_dim:
            raise ValueError(f"hamburger: x must have shape (B, N, {self.embed_dim}), got {tuple(x.shape)}")
        batch, n, _ = x.shape
        if n == 0:
            raise ValueError("hamburger: the sequence length must be at least 1")
        pad = _as_padding_mask(key_padding_mask, batch, n)
        if pad is not None and pad.device != x.device:
            raise ValueError(f"hamburger: key_padding_mask is on {pad.device}, x on {x.device}")
        h = self.lower_bread(x)
        if self.ham.ham == "nmf":
            h = F.relu(h)
        if pad is not None:
            h = h.masked_fill(pad[:, :, None], 0.0)
        bases, coef = self.ham(h.transpose(1, 2), pad, generator=generator, return_factors=True)
        return _linear_of_reconstruction(self.upper_bread.weight, bases, coef, self.num_heads, h.dtype,
                                         channels_last=True)

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}"
