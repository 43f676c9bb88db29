"""Which method to use: the fastest one whose error stays under a budget at a given length."""

from __future__ import annotations

from typing import Any, Iterable

__all__ = ["OBJECTIVES", "recommend", "budget_table", "pareto_front"]

# objective -> the row's time field
OBJECTIVES = {"forward": "forward_s", "training": "forward_backward_s", "decode": "decode_s"}


def recommend(rows: Iterable[dict[str, Any]], n: int, max_error: float,
              objective: str = "forward") -> dict[str, Any] | None:
    """The row at length ``n`` with the smallest time (``objective``: ``"forward"``,
    ``"training"``, forward+backward, or ``"decode"``, one generated token's attention) among
    those whose ``rel_error`` is at most ``max_error``; ties go to the smaller error. Rows without
    an error (token mixers, failed points) or without that time are never chosen. None when no row qualifies."""
    key = OBJECTIVES[objective]
    candidates = [
        r for r in rows
        if r.get("n") == n and r.get("rel_error") is not None and r.get(key) is not None
        and r["rel_error"] <= max_error
    ]
    if not candidates:
        return None
    return min(candidates, key=lambda r: (r[key], r["rel_error"]))


def pareto_front(points: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The (time, error) points that no other point beats on both, sorted by time."""
    front: list[tuple[float, float]] = []
    for t, e in sorted(points):
        if not front or e < front[-1][1]:
            front.append((t, e))
    return front


def budget_table(rows: Iterable[dict[str, Any]], n: int, objective: str = "forward") -> list[dict[str, Any]]:
    """The answer of :func:`recommend` for every error budget at length ``n``, as ranges.

    The methods on the time/error Pareto front, fastest first; entry i is what
    ``recommend(rows, n, E)`` returns for ``from_error <= E < to_error`` (``to_error`` None: any
    larger budget). Each entry is ``{"row", "from_error", "to_error"}``.
    """
    key = OBJECTIVES[objective]
    usable = [r for r in rows
              if r.get("n") == n and r.get("rel_error") is not None and r.get(key) is not None]
    usable.sort(key=lambda r: (r[key], r["rel_error"]))
    front: list[dict[str, Any]] = []
    for r in usable:
        if not front or r["rel_error"] < front[-1]["rel_error"]:
            front.append(r)
    return [{"row": r, "from_error": r["rel_error"], "to_error": front[i - 1]["rel_error"] if i else None}
            for i, r in enumerate(front)]
