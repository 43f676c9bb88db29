"""Reference rows of ``subquad compare --limits``: what no method of a given kind can beat, and how
sharp the attention is, on the same inputs and against the same float64 exact attention as the
methods' rows (:func:`subquad.compare.common.method_errors`).

- ``rank-r limit @ F%``: per head, ``P_r A V`` with ``P_r`` the projection on the top ``r = round(F N)``
  left singular vectors of the exact attention matrix ``A`` (float64; with ``causal`` the causal
  one), that is ``A_r V`` for the best rank-r ``A_r`` (Eckart-Young): no method whose attention
  matrix has rank at most r (``r`` random features or landmarks) does better. Up to
  :data:`FULL_SVD` queries the singular vectors come from a full SVD in float64, above it from
  randomized subspace iteration (Halko, Martinsson and Tropp 2011: ``r + 64`` columns,
  :data:`POWER_ITERATIONS` power iterations, float32).
- ``block-local @ F%``: exact attention restricted to the query's own contiguous block of
  ``round(F N)`` keys (causal: the keys of its block up to itself).
- ``uniform``: every query outputs the mean of the values it sees: the error of ignoring q and k.
- :func:`sharpness_rows`: the entropy and the weight on the largest keys of the exact attention
  rows (:func:`subquad.compare.fidelity.attention_sharpness`), per layer.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..ops._common import over_threads
from .fidelity import attention_sharpness, exact_reference, head_errors

__all__ = ["FULL_SVD", "POWER_ITERATIONS", "TOP_KEYS", "UNIFORM", "limit_rows", "rank_limit", "block_local",
           "sharpness_rows", "sharpness_table", "top_left_singular_vectors"]

#: up to this many queries the rank-r limit takes a full float64 SVD, above it a randomized one
FULL_SVD = 1024
#: power iterations of the randomized SVD (at N = 2048 within 0.3 % of the full SVD's error)
POWER_ITERATIONS = 8
_OVERSAMPLE = 64
#: the sharpness rows' weight on the largest keys counts this many keys
TOP_KEYS = 64
#: the label of the uniform row
UNIFORM = "uniform (mean of the visible values)"


def _weights(q: Tensor, k: Tensor, scale: float, causal: bool) -> Tensor:
    """One head's exact attention matrix ``(N, M)`` in float64, q ``(N, D)``, k ``(M, D)``."""
    logits = (q.double() @ k.double().T) * scale
    if causal:
        later = torch.ones(logits.shape, dtype=torch.bool, device=q.device).triu(1)
        logits = logits.masked_fill(later, float("-inf"))
    return torch.softmax(logits, dim=-1)


def top_left_singular_vectors(a: Tensor, rank: int, seed: int = 0) -> Tensor:
    """``(N, rank)`` float64: the top left singular vectors of ``a`` ``(N, M)``: a full float64 SVD
    up to :data:`FULL_SVD` rows, else randomized subspace iteration in float32 (``rank + 64``
    columns, :data:`POWER_ITERATIONS` power iterations, a sketch seeded with ``seed``)."""
    if a.shape[0] <= FULL_SVD:
        return torch.linalg.svd(a.double(), full_matrices=False).U[:, :rank]
    a = a.float()
    gen = torch.Generator().manual_seed(seed)
    y = a @ torch.randn(a.shape[1], min(rank + _OVERSAMPLE, a.shape[1]), generator=gen).to(a.device)
    for _ in range(POWER_ITERATIONS):
        y = a @ torch.linalg.qr(a.T @ torch.linalg.qr(y).Q).Q
    basis = torch.linalg.qr(y).Q
    u = torch.linalg.svd(basis.T @ a, full_matrices=False).U
    return (basis @ u[:, :rank]).double()


def rank_limit(q: Tensor, k: Tensor, exact: Tensor, scale: float, causal: bool, ranks: list[int],
               seed: int = 0) -> dict[int, Tensor]:
    """``{r: A_r V}`` ``(B, H, N, Dv)`` float64 for each ``r`` in ``ranks``: each head's exact output
    ``exact`` projected on the top-r left singular vectors of its attention matrix. Heads run on
    :func:`subquad.ops._common.over_threads` workers, one torch thread each."""
    B, H = q.shape[:2]
    out = {r: torch.empty_like(exact) for r in ranks}

    def head(i: int) -> None:
        b, h = divmod(i, H)
        u = top_left_singular_vectors(_weights(q[b, h], k[b, h], scale, causal), max(ranks), seed + i)
        for r in ranks:
            out[r][b, h] = u[:, :r] @ (u[:, :r].T @ exact[b, h])

    over_threads(head, B * H)
    return out


def block_local(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, block: int) -> Tensor:
    """Exact attention of each query over the keys of its own contiguous block of ``block``
    positions (causal: those up to itself), float64 ``(B, H, N, Dv)``; self-attention (N = M)."""
    n = q.shape[2]
    pad = -n % block

    def blocks(x: Tensor) -> Tensor:
        x = F.pad(x.double(), (0, 0, 0, pad))
        return x.reshape(*x.shape[:2], -1, block, x.shape[-1])

    pos = torch.arange(n + pad, device=q.device).reshape(-1, 1, block)  # (blocks, 1, block): key positions
    allowed = (pos < n) & ((pos <= pos.transpose(-1, -2)) if causal else True)
    logits = (blocks(q) @ blocks(k).transpose(-1, -2)) * scale
    weights = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)
    return (weights @ blocks(v)).flatten(2, 3)[:, :, :n]


def _entry(outs: list[Tensor], refs: list[Tensor]) -> dict[str, Any]:
    """A row of per-layer outputs: the entry :func:`subquad.compare.common.method_errors` makes."""
    per_head = [head_errors(out, ref) for out, ref in zip(outs, refs)]
    per_layer = [total for total, _ in per_head]
    return {"per_layer": per_layer, "per_head": [heads for _, heads in per_head],
            "mean": sum(per_layer) / len(per_layer), "failure": None, "limit": True}


def limit_rows(inputs: list[tuple], refs: list[Tensor], shares: list[float], *, scale: float | None = None,
               causal: bool = False, bar=None, seed: int = 0) -> dict[str, dict[str, Any]]:
    """The reference rows on every layer's ``(q, k, v)`` against ``refs``: :data:`UNIFORM`, and at
    each share ``F`` of the keys (``r = round(F N)`` keys, at least 1) the ``rank-r limit @ F%``
    and ``block-local @ F%`` rows: ``{label: {"per_layer", "per_head", "mean", "failure",
    "limit": True}}``, the shape of a method's row."""
    n = inputs[0][0].shape[2]
    scale = inputs[0][0].shape[-1] ** -0.5 if scale is None else scale
    keys = {share: max(1, round(share * n)) for share in shares}
    outs: dict[str, list[Tensor]] = {UNIFORM: []}
    for share in shares:
        outs[f"rank-r limit @ {100 * share:g}%"], outs[f"block-local @ {100 * share:g}%"] = [], []
    for i, ((q, k, v), ref) in enumerate(zip(inputs, refs)):
        if bar is not None:
            bar.set_postfix_str(f"layer {i + 1}: limits")
        outs[UNIFORM].append(exact_reference(torch.zeros_like(q), k, v, scale, causal=causal))
        ranks = rank_limit(q, k, ref, scale, causal, sorted(set(keys.values())), seed + 1000 * i) if keys else {}
        for share, r in keys.items():
            outs[f"rank-r limit @ {100 * share:g}%"].append(ranks[r])
            outs[f"block-local @ {100 * share:g}%"].append(block_local(q, k, v, scale, causal, r))
    return {label: _entry(out, refs) for label, out in outs.items()}


def sharpness_rows(inputs: list[tuple], *, scale: float | None = None, causal: bool = False) -> dict[str, Any]:
    """How peaked the exact attention rows are on every layer's ``(q, k, v)``:
    ``{"per_layer": [attention_sharpness(...)], "top": TOP_KEYS, <each measure>: mean over layers}``
    (entropy in nats, normalised entropy, mean largest weight, weight on the :data:`TOP_KEYS`
    largest keys)."""
    per_layer = [attention_sharpness(q, k, scale, causal=causal, top=TOP_KEYS) for q, k, _ in inputs]
    means = {name: math.fsum(s[name] for s in per_layer) / len(per_layer) for name in per_layer[0]}
    return {"per_layer": per_layer, "top": TOP_KEYS, **means}


def sharpness_table(columns: list[tuple[str, dict[str, Any]]]) -> tuple[list[str], list[list[str]]]:
    """``(headers, body)``: one column per ``(title, sharpness_rows(...))``, one row per measure."""
    top = columns[0][1]["top"]
    rows = [("entropy (nats)", "entropy"), ("normalised entropy (1 = uniform)", "normalised_entropy"),
            ("mean largest weight", "mean_max_weight"), (f"weight on the {top} largest keys", "top_mass")]
    return (["sharpness of exact attention", *(title for title, _ in columns)],
            [[label, *(f"{s[key]:.3f}" for _, s in columns)] for label, key in rows])
