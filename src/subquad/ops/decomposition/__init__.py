"""Matrix decompositions as global-context mixers: the "hams" of Hamburger (Geng et al., ICLR 2021).

Each op takes ``x`` of shape ``(B*S, D, N)``: one independent ``D x N`` matrix per sample and
group whose columns are the N positions. It factorises ``x ~ bases @ coef^T`` with
``bases (B*S, D, R)`` and ``coef (B*S, N, R)`` and returns the low-rank reconstruction
``bases @ coef^T`` (``(B*S, D, N)``, the input dtype). The work is O(N D R) per step; nothing
of size N x N is formed.

Shared skeleton:

1. initial bases: fresh random bases per sample and group (``generator`` for reproducibility),
   or injected with ``bases=``;
2. ``steps`` local steps of the decomposition (the modules pass ``train_steps`` = 6 in training
   and ``eval_steps`` = 7 in eval);
3. one more coefficient step that carries the gradient, then the reconstruction.

``grad="one_step"`` (default, the paper's one-step gradient) runs step 2 under ``no_grad``, so
step 3 sees the bases and coefficients as constants and the backward costs the same for every
``steps``. ``grad="bptt"`` back-propagates through all steps.

All iterations run in float32 under autocast (float64 stays float64). ``key_padding_mask``
(bool ``(B*S, N)``, True = padding) zeroes the padded columns and removes them from every sum
over positions, so they cannot influence real columns; their output columns are 0.

Slow per-matrix references written from the paper's formulas are in :mod:`.naive`, for tests.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ...checks import check_bool, check_choice, check_float, check_int
from ...registry import register_mixer
from .._masks import compute_dtype, compute_precision

__all__ = ["DEFAULT_RANK", "GRAD_MODES", "HAMS", "HamburgerOptions", "cd", "factorize", "nmf", "random_bases", "vq"]

GRAD_MODES = ("one_step", "bptt")
DEFAULT_RANK = 64
_BASES_EPS = 1e-6  # eps of the basis normalisation inside the steps (VQ, CD)


def random_bases(
    batch: int,
    dim: int,
    rank: int,
    *,
    distribution: str,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> Tensor:
    """``(batch, dim, rank)`` random bases, each column of unit L2 norm over ``dim``.

    ``distribution="uniform"``: U(0, 1) entries (non-negative, for NMF); ``"normal"``: N(0, 1)
    (VQ, CD). With a generator the draw happens on the generator's device, then moves to
    ``device``.
    """
    check_choice("random_bases", "distribution", distribution, ("uniform", "normal"))
    draw = torch.rand if distribution == "uniform" else torch.randn
    draw_device = generator.device if generator is not None else device
    b = draw(batch, dim, rank, generator=generator, dtype=dtype, device=draw_device)
    return F.normalize(b, dim=1).to(device=device)


# --------------------------------------------------------------------------------------------
# local steps (module-level functions so tests can count calls)


def _nmf_update_coef(x: Tensor, bases: Tensor, coef: Tensor, eps: float) -> Tensor:
    """Multiplicative update of coef ``(BS, N, R)``: ``coef * (X^T B) / (coef (B^T B) + eps)``."""
    numerator = torch.bmm(x.transpose(1, 2), bases)
    denominator = torch.bmm(coef, torch.bmm(bases.transpose(1, 2), bases))
    if torch.is_grad_enabled():
        return coef * numerator / (denominator + eps)
    return numerator.mul_(coef).div_(denominator.add_(eps))  # same values, no new (N, R) tensors


def _nmf_update_bases(x: Tensor, bases: Tensor, coef: Tensor, eps: float) -> Tensor:
    """Multiplicative update of bases ``(BS, D, R)``: ``B * (X coef) / (B (coef^T coef) + eps)``."""
    numerator = torch.bmm(x, coef)
    denominator = torch.bmm(bases, torch.bmm(coef.transpose(1, 2), coef))
    if torch.is_grad_enabled():
        return bases * numerator / (denominator + eps)
    return numerator.mul_(bases).div_(denominator.add_(eps))


def _nmf_step(x, x_unit, bases, coef, keep, inv_t, eps):
    """One Lee-Seung step, Gauss-Seidel order: coef first, then bases with the new coef."""
    coef = _nmf_update_coef(x, bases, coef, eps)
    bases = _nmf_update_bases(x, bases, coef, eps)
    return bases, coef


def _soft_assign(x_unit: Tensor, bases_unit: Tensor, keep: Tensor | None, inv_t: float) -> Tensor:
    """``softmax(inv_t * x_unit^T bases_unit)`` over R, ``(BS, N, R)``; padded rows zeroed."""
    coef = torch.softmax(inv_t * torch.bmm(x_unit.transpose(1, 2), bases_unit), dim=-1)
    return coef if keep is None else coef * keep


def _vq_step(x, x_unit, bases, coef, keep, inv_t, eps):
    """Soft k-means step: cosine soft assignment, coef normalised over positions, each basis the
    weighted mean of the raw columns ``X coef``. The incoming coef is not used."""
    coef = _soft_assign(x_unit, F.normalize(bases, dim=1, eps=_BASES_EPS), keep, inv_t)
    coef = coef / (eps + coef.sum(dim=1, keepdim=True))
    bases = torch.bmm(x, coef)
    return bases, coef


def _cd_step(x, x_unit, bases, coef, keep, inv_t, eps):
    """Spherical k-means step: soft assignment to the unit-norm bases, coef normalised over
    positions, bases = unit-norm ``X coef``. The incoming coef is not used."""
    coef = _soft_assign(x_unit, bases, keep, inv_t)
    coef = coef / (eps + coef.sum(dim=1, keepdim=True))
    bases = F.normalize(torch.bmm(x, coef), dim=1, eps=_BASES_EPS)
    return bases, coef


# --------------------------------------------------------------------------------------------
# gradient-carrying coefficient steps


def _nmf_final(x, bases, coef, keep, inv_t, beta, eps):
    return _nmf_update_coef(x, bases, coef, eps)


def _vq_final(x, bases, coef, keep, inv_t, beta, eps):
    # cosine normalisation with the norm as a constant in backward (the forward value is the
    # plain normalisation)
    with torch.no_grad():
        norm = x.norm(dim=1, keepdim=True)
    x_unit = x / (eps + norm)
    return _soft_assign(x_unit, F.normalize(bases, dim=1, eps=_BASES_EPS), keep, inv_t)


def _cd_final(x, bases, coef, keep, inv_t, beta, eps):
    # ridge least squares: coef = X^T B (B^T B + beta I)^{-1} = X^T (B G^{-1}), G symmetric
    r = bases.shape[-1]
    gram = torch.bmm(bases.transpose(1, 2), bases)
    gram = gram + beta * torch.eye(r, dtype=gram.dtype, device=gram.device)
    projector = torch.linalg.solve(gram, bases.transpose(1, 2)).transpose(1, 2)  # (BS, D, R)
    return torch.bmm(x.transpose(1, 2), projector)


_HAMS = {
    # name: (distribution of the initial bases, local step, final step)
    "nmf": ("uniform", "_nmf_step", "_nmf_final"),
    "vq": ("normal", "_vq_step", "_vq_final"),
    "cd": ("normal", "_cd_step", "_cd_final"),
}


# --------------------------------------------------------------------------------------------
# validation and the shared skeleton


def _check_inputs(name, x, rank, steps, grad, bases, key_padding_mask, inv_t, eps):
    if not isinstance(x, Tensor):
        raise TypeError(f"{name}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.ndim != 3:
        raise ValueError(f"{name}: x must have 3 dimensions (B*S, D, N), got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"{name}: x must be a floating-point tensor, got {x.dtype}")
    if min(x.shape) == 0:
        raise ValueError(f"{name}: x must have no empty dimension, got shape {tuple(x.shape)}")
    check_int(name, "steps", steps, minimum=0)
    check_choice(name, "grad", grad, GRAD_MODES)
    check_float(name, "inv_t", inv_t, minimum=0.0, inclusive=False)
    check_float(name, "eps", eps, minimum=0.0, inclusive=False)
    if bases is not None:
        if not isinstance(bases, Tensor):
            raise TypeError(f"{name}: bases must be a torch.Tensor or None, got {type(bases).__name__}")
        if bases.ndim != 3 or tuple(bases.shape[:2]) != tuple(x.shape[:2]):
            raise ValueError(
                f"{name}: bases must have shape (B*S, D, R) = ({x.shape[0]}, {x.shape[1]}, R), "
                f"got {tuple(bases.shape)}"
            )
        if not bases.is_floating_point():
            raise TypeError(f"{name}: bases must be a floating-point tensor, got {bases.dtype}")
        if bases.device != x.device:
            raise ValueError(f"{name}: bases are on {bases.device}, x on {x.device}")
        if rank is not None and rank != bases.shape[-1]:
            raise ValueError(f"{name}: rank={rank} but the given bases have {bases.shape[-1]} columns")
        rank = bases.shape[-1]
    if rank is None:
        rank = DEFAULT_RANK
    check_int(name, "rank", rank, minimum=1)
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, Tensor) or key_padding_mask.dtype != torch.bool:
            raise TypeError(f"{name}: key_padding_mask must be a bool tensor (True = padding)")
        if tuple(key_padding_mask.shape) != (x.shape[0], x.shape[2]):
            raise ValueError(
                f"{name}: key_padding_mask must have shape (B*S, N) = {(x.shape[0], x.shape[2])}, "
                f"got {tuple(key_padding_mask.shape)}"
            )
        if key_padding_mask.device != x.device:
            raise ValueError(f"{name}: key_padding_mask is on {key_padding_mask.device}, x on {x.device}")
    return rank


def factorize(
    x: Tensor,
    ham: str = "nmf",
    rank: int | None = None,
    *,
    steps: int = 6,
    grad: str = "one_step",
    bases: Tensor | None = None,
    generator: torch.Generator | None = None,
    key_padding_mask: Tensor | None = None,
    inv_t: float | None = None,
    beta: float = 0.1,
    eps: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """The factors of :func:`nmf`, :func:`vq` or :func:`cd` (``ham``) without the
    reconstruction: ``bases (B*S, D, R)`` after the local steps and ``coef (B*S, N, R)`` from
    the gradient-carrying step, in the compute dtype (float32, or float64 for float64 x).

    ``x ~ bases @ coef^T``. A layer that applies a linear map W to the reconstruction can form
    ``(W bases) @ coef^T`` instead, which never materialises the ``(B*S, D, N)`` output.
    ``inv_t=None`` takes the ham's default (1 for NMF, 100 for VQ and CD); ``beta`` is used by
    CD only. Other arguments as :func:`nmf`.
    """
    check_choice("factorize", "ham", ham, tuple(_HAMS))
    if inv_t is None:
        inv_t = 1.0 if ham == "nmf" else 100.0
    if ham == "cd":
        check_float("cd", "beta", beta, minimum=0.0, inclusive=False)
    rank = _check_inputs(ham, x, rank, steps, grad, bases, key_padding_mask, inv_t, eps)
    distribution, step_name, final_name = _HAMS[ham]
    step, final = globals()[step_name], globals()[final_name]
    dtype = compute_dtype(x.dtype)
    batch, dim, _ = x.shape
    with compute_precision(x):
        xc = x.to(dtype)
        keep = None
        if key_padding_mask is not None:
            keep = (~key_padding_mask).to(dtype)[:, :, None]  # (BS, N, 1)
            xc = xc * keep.transpose(1, 2)
        if bases is None:
            b = random_bases(batch, dim, rank, distribution=distribution, generator=generator,
                             dtype=dtype, device=x.device)
        else:
            b = bases.detach().to(dtype)
        iterate = torch.no_grad() if grad == "one_step" else contextlib.nullcontext()
        with iterate:
            x_unit = F.normalize(xc, dim=1) if ham != "nmf" else None
            coef = None
            if ham == "nmf":
                coef = torch.softmax(inv_t * torch.bmm(xc.transpose(1, 2), b), dim=-1)
                if keep is not None:
                    coef = coef * keep
            for _ in range(steps):
                b, coef = step(xc, x_unit, b, coef, keep, inv_t, eps)
        if grad == "one_step":
            b = b.detach()
            coef = None if coef is None else coef.detach()
        # padded rows of the final coef are 0 (NMF, CD: x has zero columns there; VQ: masked)
        coef = final(xc, b, coef, keep, inv_t, beta, eps)
    return b, coef


def _reconstruct(x, factors, return_factors):
    b, coef = factors
    with compute_precision(x):
        out = torch.bmm(b, coef.transpose(1, 2)).to(x.dtype)
    return (out, b, coef) if return_factors else out


def nmf(x: Tensor, rank: int | None = None, *, steps: int = 6, grad: str = "one_step", bases: Tensor | None = None,
        generator: torch.Generator | None = None, key_padding_mask: Tensor | None = None, inv_t: float = 1.0,
        eps: float = 1e-6, return_factors: bool = False):
    """Non-negative matrix factorisation by Lee-Seung multiplicative updates.

    Args:
        x: ``(B*S, D, N)``, non-negative (the Hamburger puts a ReLU before it).
        rank: number R of bases (default 64, or the width of ``bases``).
        steps: local steps; each updates coef, then the bases with the new coef.
        grad: ``"one_step"`` or ``"bptt"`` (see the module docstring).
        bases: ``(B*S, D, R)`` initial bases (non-negative); default: U(0, 1) columns
            normalised to unit L2 norm, drawn with ``generator``.
        key_padding_mask: bool ``(B*S, N)``, True = padded column.
        inv_t: inverse temperature of the initial coef ``softmax(inv_t X^T B)`` over R.
        eps: added to the update denominators.
        return_factors: also return the final ``bases (B*S, D, R)`` and ``coef (B*S, N, R)``.

    Returns:
        ``bases @ coef^T``, ``(B*S, D, N)`` in the dtype of x (and the factors, in the compute
        dtype, when asked). The gradient-carrying step is one more coef update.
    """
    factors = factorize(x, "nmf", rank, steps=steps, grad=grad, bases=bases, generator=generator,
                        key_padding_mask=key_padding_mask, inv_t=inv_t, eps=eps)
    return _reconstruct(x, factors, return_factors)


def vq(x: Tensor, rank: int | None = None, *, steps: int = 6, grad: str = "one_step", bases: Tensor | None = None,
       generator: torch.Generator | None = None, key_padding_mask: Tensor | None = None, inv_t: float = 100.0,
       eps: float = 1e-6, return_factors: bool = False):
    """Soft vector quantisation (soft k-means with cosine similarity).

    Each local step assigns every column to the R codewords with
    ``softmax(inv_t * cos(x, b))`` over R, normalises the assignments over positions (each
    codeword's weights sum to 1) and sets each codeword to the weighted mean ``X coef`` of the
    raw columns. The gradient-carrying step is the soft assignment (rows sum to 1) with the
    column norms of x held constant in backward. Initial bases: N(0, 1), unit-norm columns.
    Arguments and returns as :func:`nmf`.
    """
    factors = factorize(x, "vq", rank, steps=steps, grad=grad, bases=bases, generator=generator,
                        key_padding_mask=key_padding_mask, inv_t=inv_t, eps=eps)
    return _reconstruct(x, factors, return_factors)


def cd(x: Tensor, rank: int | None = None, *, steps: int = 6, grad: str = "one_step", bases: Tensor | None = None,
       generator: torch.Generator | None = None, key_padding_mask: Tensor | None = None, inv_t: float = 100.0,
       beta: float = 0.1, eps: float = 1e-6, return_factors: bool = False):
    """Concept decomposition (spherical k-means bases, ridge-regression coefficients).

    Local steps: soft assignment ``softmax(inv_t * cos(x, b))`` to the unit-norm bases,
    normalised over positions, then bases = unit-norm ``X coef``. The gradient-carrying step
    solves the ridge problem ``coef = X^T B (B^T B + beta I)^{-1}``, so the output is the ridge
    projection of x onto the span of the bases. Initial bases: N(0, 1), unit-norm columns.
    Arguments and returns as :func:`nmf`; ``beta`` > 0 is the ridge weight.
    """
    factors = factorize(x, "cd", rank, steps=steps, grad=grad, bases=bases, generator=generator,
                        key_padding_mask=key_padding_mask, inv_t=inv_t, beta=beta, eps=eps)
    return _reconstruct(x, factors, return_factors)


HAMS = ("nmf", "vq", "cd")


@dataclass
class HamburgerOptions:
    """Options of the ``"hamburger"`` token mixer (:class:`HamburgerMixer`).

    ham: ``"nmf"`` (default), ``"vq"`` or ``"cd"``.
    rank: bases per group; None: ``min(64, max(1, (embed_dim / num_heads) // 8))``.
    train_steps / eval_steps: local steps in training / eval (6 / 7).
    grad: ``"one_step"`` (default) or ``"bptt"``.
    inv_t: softmax inverse temperature (None: 1 for NMF, 100 for VQ and CD).
    beta: ridge weight of CD.
    rand_init: fresh random bases at every forward (True) or a persistent dictionary.
    eta: step of the dictionary's online update (``rand_init=False``).
    """

    ham: str = "nmf"
    rank: int | None = None
    train_steps: int = 6
    eval_steps: int = 7
    grad: str = "one_step"
    inv_t: float | None = None
    beta: float = 0.1
    rand_init: bool = True
    eta: float = 0.9

    def __post_init__(self):
        check_choice("hamburger", "ham", self.ham, HAMS)
        if self.rank is not None:
            check_int("hamburger", "rank", self.rank, minimum=1)
        check_int("hamburger", "train_steps", self.train_steps, minimum=0)
        check_int("hamburger", "eval_steps", self.eval_steps, minimum=0)
        check_choice("hamburger", "grad", self.grad, GRAD_MODES)
        if self.inv_t is not None:
            check_float("hamburger", "inv_t", self.inv_t, minimum=0.0, inclusive=False)
        check_float("hamburger", "beta", self.beta, minimum=0.0, inclusive=False)
        check_bool("hamburger", "rand_init", self.rand_init)
        check_float("hamburger", "eta", self.eta, minimum=0.0)
        if self.eta > 1:
            raise ValueError(f"hamburger: eta must be in [0, 1], got {self.eta}")


# the token mixer built from these ops (its module lives with the layers)
register_mixer(
    "hamburger",
    module="subquad.layers.hamburger:HamburgerMixer",
    options=HamburgerOptions,
    summary="Hamburger: NMF / soft VQ / concept decomposition over positions, one-step gradient "
    "(Geng et al. 2021)",
    complexity="linear",
    causal=False,
    key_padding=True,
    stochastic=True,
    learned_parameters=True,
    peer="subquad.compare.peers:HAMBURGER_PYTORCH",
)
