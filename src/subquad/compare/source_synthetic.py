"""``subquad compare --source synthetic``: every attention method's error on synthetic inputs whose
structure is known, mean and standard deviation over ``--seeds`` draws, against exact attention in
float64. Inputs ``(B, H, N, D)`` (``--batch``, ``--heads``, each ``--n``, ``--dim``) are drawn in
float64 and the methods run in the run's ``--dtype``; each ``--families`` entry is one kind:

- ``gaussian``: q, k, v i.i.d. N(0, 1) (logits of standard deviation 1 at scale D^-1/2: no structure).
- ``clustered``: :data:`CLUSTERS` centres ``c ~ N(0, I)`` per head; token n belongs to a random
  cluster ``a_n``, ``q_n = c_{a_n} + SPREAD eps``, ``k_n = c_{a_n} + SPREAD eps'`` (fresh noise),
  v i.i.d.; tokens in random order, so contiguous segments mix clusters.
- ``clustered-local``: the same with the tokens sorted by cluster (contiguous runs: the locality of
  images and text, which segment-mean landmarks assume).

Seed ``s`` of ``--seeds S`` draws the inputs from ``--seed + s`` and seeds stochastic methods with
``--seed + s`` too. With ``--limits`` the reference rows of :mod:`subquad.compare.limits` join the
table (the ``uniform`` row: the error of ignoring q and k).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .common import (Config, Renderer, attention_methods, comparison_rows, fmt_error, machine_info, md_table,
                     method_errors, progress_bar, register_renderer, text_table)
from .fidelity import exact_reference
from .limits import limit_rows, sharpness_rows, sharpness_table
from .workload import DTYPES

__all__ = ["FAMILIES", "CLUSTERS", "SPREAD", "synthetic_qkv", "run", "summary_text", "markdown_synthetic",
           "plot_synthetic", "RENDERER"]

#: the input families, in the order a run reports them
FAMILIES = ("gaussian", "clustered", "clustered-local")
#: clusters per head of the clustered families
CLUSTERS = 16
#: standard deviation of a clustered token's q and k around its centre
SPREAD = 0.5


def synthetic_qkv(family: str, batch: int, heads: int, n: int, dim: int, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    """Float64 q, k, v ``(batch, heads, n, dim)`` of one family (the module docstring), on the CPU."""
    if family not in FAMILIES:
        raise ValueError(f"unknown input family {family!r}; the families are {list(FAMILIES)}")
    g = torch.Generator().manual_seed(seed)
    shape = (batch, heads, n, dim)
    if family == "gaussian":
        return tuple(torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(3))
    centres = torch.randn(batch, heads, CLUSTERS, dim, generator=g, dtype=torch.float64)
    assign = torch.randint(0, CLUSTERS, (batch, heads, n), generator=g)
    if family == "clustered-local":
        assign = assign.sort(-1).values
    c = centres.gather(2, assign[..., None].expand(-1, -1, -1, dim))
    q = c + SPREAD * torch.randn(shape, generator=g, dtype=torch.float64)
    k = c + SPREAD * torch.randn(shape, generator=g, dtype=torch.float64)
    return q, k, torch.randn(shape, generator=g, dtype=torch.float64)


def _with_spread(errors: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each entry's ``per_layer`` (here: per seed) also as ``per_seed`` and its sample ``std``."""
    for e in errors.values():
        x = e["per_layer"]
        mean = sum(x) / len(x) if x else 0.0
        e["per_seed"] = x
        e["std"] = math.sqrt(sum((a - mean) ** 2 for a in x) / (len(x) - 1)) if len(x) > 1 else 0.0
    return errors


def _point(family: str, n: int, attention: list, config: Config, bar) -> dict[str, Any]:
    """Every row's error on ``config.seeds`` draws of ``family`` at length ``n``."""
    device = torch.device(config.device)
    draws = [synthetic_qkv(family, config.batch, config.heads, n, config.dim, config.seed + s)
             for s in range(config.seeds)]
    bar.set_postfix_str(f"{family} N={n}: exact float64 reference")
    refs = [exact_reference(*(t.to(device) for t in x)) for x in draws]
    inputs = [tuple(t.to(device, DTYPES[config.dtype]) for t in x) for x in draws]
    errors = method_errors(comparison_rows(attention, config, n), inputs, refs, config, bar, f"{family} N={n}")
    point = {"family": family, "n": n, "exact_rms": sum(r.square().mean().sqrt().item() for r in refs) / len(refs)}
    if config.limits:
        exact = [tuple(t.to(device) for t in x) for x in draws]
        point["sharpness"] = sharpness_rows(exact)
        errors.update(limit_rows(exact, refs, config.budgets, bar=bar, seed=config.seed))
    return {**point, "errors": _with_spread(errors)}


def run(config: Config, *, show_progress: bool = True) -> dict[str, Any]:
    """Every attention method's error on each family of ``config.families`` at each ``config.ns``,
    ``config.seeds`` draws each: ``"points"``, one per (family, N), with ``"errors"``:
    ``{row: {"per_seed", "per_head", "mean", "std", "failure"}}`` (and ``"limit": True`` for a
    reference row)."""
    start = time.time()
    families = list(config.families or FAMILIES)
    attention, notes = attention_methods(config)
    steps = len(comparison_rows(attention, config, 1)) * config.seeds * len(families) * len(config.ns)
    bar = progress_bar(steps, "subquad compare --source synthetic", show_progress)
    try:
        points = [_point(family, n, attention, config, bar) for family in families for n in sorted(config.ns)]
    finally:
        bar.close()
    return {"kind": "synthetic", "config": asdict(config), "machine": machine_info(torch.device(config.device)),
            "families": families, "clusters": CLUSTERS, "spread": SPREAD, "points": points, "notes": notes,
            "seconds": time.time() - start}


def _cell(e: dict[str, Any]) -> str:
    if e["failure"] is not None:
        return f"FAILED: {e['failure']}"
    return fmt_error(e["mean"]) + (f" ({fmt_error(e['std'])})" if len(e["per_seed"]) > 1 else "")


def _table(res: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Rows in the order run (methods, budget rows, sweep rows, reference rows); a column per
    (family, N): the mean error over seeds (its standard deviation)."""
    points = res["points"]
    names = list(points[0]["errors"]) if points else []
    headers = ["method", *(f"{p['family']} N = {p['n']}" for p in points)]
    return headers, [[name, *(_cell(p["errors"][name]) for p in points)] for name in names]


def _intro(res: dict[str, Any]) -> list[str]:
    c = res["config"]
    rms = ", ".join(f"{p['family']} N = {p['n']}: {p['exact_rms']:.3f}" for p in res["points"])
    return [f"Synthetic inputs B={c['batch']}, H={c['heads']}, D={c['dim']}, families {', '.join(res['families'])} "
            f"({res['clusters']} clusters, spread {res['spread']}; `subquad.compare.source_synthetic`), drawn in "
            f"float64, methods in {c['dtype']}. Relative error `|out - exact|_F / |exact|_F` against exact attention "
            f"in float64, mean (standard deviation) over {c['seeds']} seeds. RMS of the exact output: {rms}."]


def summary_text(res: dict[str, Any]) -> str:
    sharp = [(f"{p['family']} N = {p['n']}", p["sharpness"]) for p in res["points"] if "sharpness" in p]
    out = [*_intro(res), "", text_table(*_table(res)), *(["", text_table(*sharpness_table(sharp))] if sharp else [])]
    return "\n".join([*out, *(f"note: {n}" for n in res["notes"])])


def markdown_synthetic(res: dict[str, Any], images: list[str]) -> str:
    c = res["config"]
    sharp = [(f"{p['family']} N = {p['n']}", p["sharpness"]) for p in res["points"] if "sharpness" in p]
    out = ["# subquad compare --source synthetic: fidelity on inputs of known structure", "", *_intro(res), "",
           f"On {res['machine']['device']}, torch {res['machine']['torch']}, {res['seconds']:.0f} s. "
           f"Command: `{c['command']}`", "", md_table(*_table(res))]
    out += ["", md_table(*sharpness_table(sharp))] if sharp else []
    out += ["", *(f"![{Path(p).stem}]({p})" for p in images)] if images else []
    notes = [*res["notes"], *(f"{m} options: {', '.join(f'{k}={v}' for k, v in o.items())}"
                              for m, o in c["options"].items() if o)]
    out += ["", "## Notes", "", *(f"- {n}" for n in notes)] if notes else []
    return "\n".join(out) + "\n"


def plot_synthetic(res: dict[str, Any], out: Path) -> list[Path]:
    """One panel per N: each row's mean error (log), a marker per family."""
    import matplotlib.pyplot as plt

    from .plots import log_axis, method_colors, save_figure

    ns = sorted({p["n"] for p in res["points"]})
    names = list(res["points"][0]["errors"]) if res["points"] else []
    colors = method_colors(res["families"])
    fig, axes = plt.subplots(1, len(ns), figsize=(6 * len(ns), 0.32 * max(len(names), 6) + 1.8), squeeze=False)
    for ax, n in zip(axes[0], ns):
        for p in (p for p in res["points"] if p["n"] == n):
            errors = [p["errors"][name]["mean"] for name in names]
            ax.scatter([math.nan if e is None else e for e in errors], range(len(names)), color=colors[p["family"]],
                       label=p["family"], s=30)
        ax.set_yticks(list(range(len(names))))
        ax.set_yticklabels(names, fontsize=8)
        ax.set_ylim(len(names) - 0.5, -0.5)
        log_axis(ax, "x")
        ax.set_xlabel("relative error vs exact attention (log; left is better)")
        ax.grid(True, axis="x", which="major", alpha=0.3)
        ax.set_title(f"N = {n}", fontsize=9)
    axes[0][-1].legend(fontsize=8, frameon=False)
    return [save_figure(fig, out / "synthetic_error.png")]


#: the console summary, report.md and the plot of a ``"synthetic"`` document
RENDERER = register_renderer(Renderer("synthetic", summary=summary_text, markdown=markdown_synthetic,
                                      plot=plot_synthetic))
