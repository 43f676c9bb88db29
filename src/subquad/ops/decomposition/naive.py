"""Slow references of the decompositions, for the tests (the library never imports them): one
matrix at a time, in the paper's orientation (C is R x N)."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["cd_reference", "nmf_reference", "vq_reference"]


def nmf_reference(x: Tensor, bases: Tensor, steps: int, *, inv_t: float = 1.0, eps: float = 1e-6):
    """Slow NMF on ``x (BS, D, N)`` from ``bases (BS, D, R)``. Returns the output
    ``(BS, D, N)`` and the factors after the local steps (before the final coef step):
    bases ``(BS, D, R)`` and coef ``(BS, N, R)``."""
    outs, all_bases, all_coefs = [], [], []
    for xm, dm in zip(x, bases):
        cm = torch.softmax(inv_t * (dm.T @ xm), dim=0)  # (R, N), columns sum to 1
        for _ in range(steps):
            cm = cm * (dm.T @ xm) / (dm.T @ dm @ cm + eps)
            dm = dm * (xm @ cm.T) / (dm @ (cm @ cm.T) + eps)
        all_bases.append(dm)
        all_coefs.append(cm.T)
        cm = cm * (dm.T @ xm) / (dm.T @ dm @ cm + eps)
        outs.append(dm @ cm)
    return torch.stack(outs), torch.stack(all_bases), torch.stack(all_coefs)


def _unit_columns(a: Tensor, eps: float) -> Tensor:
    return a / a.norm(dim=0).clamp_min(eps)


def vq_reference(x: Tensor, bases: Tensor, steps: int, *, inv_t: float = 100.0, eps: float = 1e-6):
    """Slow soft VQ (paper: ``C = softmax(cos(D, X) / T)``, ``D = X C^T diag(C 1)^{-1}``).
    Returns as :func:`nmf_reference` (coef is the last local step's, column-normalised)."""
    outs, all_bases, all_coefs = [], [], []
    for xm, dm in zip(x, bases):
        cm = None
        for _ in range(steps):
            cm = torch.softmax(inv_t * _unit_columns(dm, 1e-6).T @ _unit_columns(xm, 1e-12), dim=0)
            cm = cm / (eps + cm.sum(dim=1, keepdim=True))
            dm = xm @ cm.T
        all_bases.append(dm)
        all_coefs.append(None if cm is None else cm.T)
        xu = xm / (eps + xm.norm(dim=0))
        outs.append(dm @ torch.softmax(inv_t * (_unit_columns(dm, 1e-6).T @ xu), dim=0))
    coefs = None if steps == 0 else torch.stack(all_coefs)
    return torch.stack(outs), torch.stack(all_bases), coefs


def cd_reference(x: Tensor, bases: Tensor, steps: int, *, inv_t: float = 100.0, beta: float = 0.1,
                 eps: float = 1e-6):
    """Slow concept decomposition with an explicit inverse in the ridge step. Returns as
    :func:`nmf_reference`."""
    outs, all_bases, all_coefs = [], [], []
    for xm, dm in zip(x, bases):
        cm = None
        for _ in range(steps):
            cm = torch.softmax(inv_t * dm.T @ _unit_columns(xm, 1e-12), dim=0)  # dm has unit columns
            cm = cm / (eps + cm.sum(dim=1, keepdim=True))
            dm = _unit_columns(xm @ cm.T, 1e-6)
        all_bases.append(dm)
        all_coefs.append(None if cm is None else cm.T)
        eye = torch.eye(dm.shape[1], dtype=dm.dtype, device=dm.device)
        coef = xm.T @ dm @ torch.linalg.inv(dm.T @ dm + beta * eye)  # (N, R)
        outs.append(dm @ coef.T)
    coefs = None if steps == 0 else torch.stack(all_coefs)
    return torch.stack(outs), torch.stack(all_bases), coefs
