"""PNG plots of ``subquad compare`` results (matplotlib, Agg backend: no display needed), and the
helpers the other kinds' plots share (:func:`log_axis`, :func:`method_colors`, :func:`save_figure`).

- ``time_vs_n.png``: forward and forward+backward time against N on log-log axes, exact
  attention in black, with guide slopes for N and N^2.
- ``memory_vs_n.png``: peak memory against N, same layout.
- ``error_vs_time.png``: relative error against forward time, one panel per N, with the
  Pareto front (the methods that nothing beats on both) and exact attention's time; its axis
  and title name the inputs of the error (real MiniLM activations or i.i.d. inputs).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullFormatter, NullLocator  # noqa: E402

from .common import Renderer, error_inputs_label, renderer_for  # noqa: E402
from .recommend import pareto_front  # noqa: E402

__all__ = ["plot", "plot_compare", "method_colors", "log_axis", "save_figure"]

EXACT = "softmax"
_DPI = 110


def method_colors(names: list[str]) -> dict[str, Any]:
    """A fixed colour per method (exact attention black), the same in every plot of a run."""
    cmap = plt.get_cmap("tab10")
    others = [n for n in names if n != EXACT]
    colors = {n: cmap(i % 10) for i, n in enumerate(others)}
    colors[EXACT] = "black"
    return colors


def save_figure(fig, path: Path) -> Path:
    """Lay out ``fig``, write it to ``path`` (PNG, cropped to its contents) and close it."""
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI, bbox_inches="tight")
    plt.close(fig)
    return path


def _plain(x, _pos=None) -> str:
    if x == 0:
        return "0"
    if 1e-3 <= abs(x) < 1e5:
        return f"{x:g}"
    return f"{x:.0e}".replace("e-0", "e-").replace("e+0", "e")


def log_axis(ax, which: str = "y") -> None:
    """Log scale labelled with plain numbers (0.2, not 2x10^-1): ticks at 1, 2, 5 per decade, more
    when the data span less than two decades. Call it after drawing."""
    import math

    axis = ax.yaxis if which == "y" else ax.xaxis
    (ax.set_yscale if which == "y" else ax.set_xscale)("log")
    lo, hi = ax.get_ylim() if which == "y" else ax.get_xlim()
    decades = math.log10(hi / lo) if lo > 0 and hi > lo else 3.0
    if decades > 2:
        subs = (1.0, 2.0, 5.0)
    elif decades > 1:
        subs = (1.0, 2.0, 3.0, 5.0)
    else:
        subs = (1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0)
    axis.set_major_locator(LogLocator(base=10, subs=subs))
    axis.set_major_formatter(FuncFormatter(_plain))
    axis.set_minor_formatter(NullFormatter())


def _methods(rows):
    return list(dict.fromkeys(r["method"] for r in rows))


def _series(rows, method, key):
    """(N, value) of one method, positive values only (the axes are logarithmic)."""
    pts = sorted((r["n"], r[key]) for r in rows if r["method"] == method and r.get(key))
    return [p[0] for p in pts], [p[1] for p in pts]


def _label(rows, method):
    kind = next(r["kind"] for r in rows if r["method"] == method)
    if method == EXACT:
        return "exact (softmax)"
    return f"{method} (mixer)" if kind == "mixer" else method


def _n_axis(ax, ns):
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(ns))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticklabels([str(n) for n in ns])
    ax.set_xlabel("sequence length N")
    ax.grid(True, which="major", alpha=0.3)


def _guides(ax, ns, y0, scale_label=True):
    """Dotted N and N^2 slopes through (ns[0], y0), for reading the growth of each line."""
    if len(ns) < 2 or not y0:
        return
    xs = [ns[0], ns[-1]]
    for power, text in ((1, "∝ N"), (2, "∝ N²")):
        ys = [y0, y0 * (ns[-1] / ns[0]) ** power]
        ax.plot(xs, ys, ls=":", color="grey", lw=1, zorder=0)
        if scale_label:
            ax.annotate(text, (xs[-1], ys[-1]), textcoords="offset points", xytext=(4, 0), fontsize=8,
                        color="grey", va="center")


def _vs_n(res, key_pairs, ylabel, scale, title, path):
    rows = res["rows"]
    ns = sorted({r["n"] for r in rows})
    names = _methods(rows)
    colors = method_colors(names)
    fig, axes = plt.subplots(1, len(key_pairs), figsize=(6.2 * len(key_pairs), 4.8), squeeze=False)
    for ax, (key, subtitle) in zip(axes[0], key_pairs):
        drawn = False
        for name in names:
            xs, ys = _series(rows, name, key)
            if not xs:
                continue
            drawn = True
            kind = next(r["kind"] for r in rows if r["method"] == name)
            exact = name == EXACT
            ax.plot(xs, [y * scale for y in ys], marker="o", ms=4 if not exact else 5,
                    lw=3 if exact else 1.6, ls="--" if kind == "mixer" else "-", color=colors[name],
                    label=_label(rows, name), zorder=3 if exact else 2)
        log_axis(ax, "y")
        _n_axis(ax, ns)
        ax.set_ylabel(ylabel)
        ax.set_title(subtitle)
        exact_x, exact_y = _series(rows, EXACT, key)
        if exact_y:
            _guides(ax, ns, exact_y[0] * scale * (ns[0] / exact_x[0]) ** 2)
        if not drawn:
            ax.text(0.5, 0.5, "not measured", transform=ax.transAxes, ha="center", color="grey")
    handles, labels = axes[0][0].get_legend_handles_labels()
    if not handles and len(axes[0]) > 1:
        handles, labels = axes[0][1].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False)
    fig.suptitle(title, fontsize=11)
    return save_figure(fig, path)


def _subtitle(res):
    c, m = res["config"], res["machine"]
    return f"B={c['batch']}, H={c['heads']}, D={c['dim']}, {c['dtype']}, {m['device']}"


def _labels(ax, points, fontsize=8):
    """Name each point, choosing for each label the first of a few offsets where it overlaps
    no label placed before it (in display pixels; the axes' scales must be final)."""
    fig = ax.figure
    fig.canvas.draw()  # fixes the transforms
    placed = []
    pt = fig.dpi / 72  # pixels per point
    char_w, height = 0.62 * fontsize * pt, 1.2 * fontsize * pt
    offsets = [(5, 4), (5, -12), (5, 16), (5, -24), (-6, 4), (-6, -12), (5, 28), (5, -36)]
    for x, y, text in sorted(points, key=lambda p: (p[0], p[1])):
        px, py = ax.transData.transform((x, y))
        width = char_w * len(text)
        for dx, dy in offsets:
            left = px + dx * pt if dx > 0 else px + dx * pt - width
            box = (left, py + dy * pt, left + width, py + dy * pt + height)
            if not any(box[0] < b[2] and b[0] < box[2] and box[1] < b[3] and b[1] < box[3] for b in placed):
                break
        placed.append(box)
        far = (dx, dy) != offsets[0]
        ax.annotate(text, (x, y), textcoords="offset points", xytext=(dx, dy), fontsize=fontsize,
                    ha="left" if dx > 0 else "right",
                    arrowprops={"arrowstyle": "-", "lw": 0.6, "color": "grey", "shrinkA": 0, "shrinkB": 3}
                    if far else None)


def _error_vs_time(res, path):
    rows = [r for r in res["rows"] if r["kind"] == "attention"]
    ns = sorted({r["n"] for r in rows})
    names = _methods(res["rows"])
    colors = method_colors(names)
    cols = min(3, len(ns))
    nrows = -(-len(ns) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5.2 * cols, 4.4 * nrows), squeeze=False)
    budget = res["config"].get("max_error")
    recs = {r["n"]: r["method"] for r in res.get("recommendations", []) if r["max_error"] == budget}
    for i, n in enumerate(ns):
        ax = axes[i // cols][i % cols]
        at_n = [r for r in rows if r["n"] == n and r.get("forward_s") is not None]
        approx = [r for r in at_n if r["method"] != EXACT and r.get("rel_error") is not None]
        exact = next((r for r in at_n if r["method"] == EXACT), None)
        for r in approx:
            ax.scatter(r["forward_s"] * 1e3, r["rel_error"], s=46, color=colors[r["method"]], zorder=3,
                       edgecolor="white", linewidth=0.5)
        front = pareto_front([(r["forward_s"] * 1e3, r["rel_error"]) for r in approx])
        if len(front) > 1:
            xs, ys = zip(*front)
            ax.step(xs, ys, where="post", color="tab:red", alpha=0.5, lw=1.5, zorder=2,
                    label="Pareto front")
        elif front:
            ax.plot(*front[0], marker="o", ms=12, mfc="none", color="tab:red", alpha=0.5,
                    label="Pareto front")
        if exact is not None:
            s = exact["forward_s"]
            when = f"{s:.3g} s" if s >= 1 else f"{s * 1e3:.3g} ms"
            text = f"exact attention: {when}, error ≈ {exact['rel_error'] or 0:.0e}"
            ax.axvline(exact["forward_s"] * 1e3, color="black", lw=2, ls="--", label=text)
        if budget is not None:
            ax.axhline(budget, color="tab:green", lw=1, ls="-.", label=f"--max-error {budget:g}")
            best = next((r for r in at_n if r["method"] == recs.get(n)), None)
            if best is not None and best["method"] != EXACT:
                ax.scatter(best["forward_s"] * 1e3, best["rel_error"], s=220, facecolor="none",
                           edgecolor="tab:green", linewidth=2, zorder=4,
                           label=f"recommended: {best['method']}")
        ax.margins(x=0.12, y=0.12)
        log_axis(ax, "x")
        log_axis(ax, "y")
        _labels(ax, [(r["forward_s"] * 1e3, r["rel_error"], r["method"]) for r in approx])
        ax.set_xlabel("forward time (ms, log)")
        ax.set_ylabel(f"relative error vs exact (log)\non {error_inputs_label(res.get('error_inputs'))}")
        ax.set_title(f"N = {n}: faster is left, more accurate is down")
        ax.grid(True, which="both", alpha=0.25)
        if not approx:
            ax.text(0.5, 0.5, "no approximate method measured", transform=ax.transAxes, ha="center")
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False)
    for j in range(len(ns), nrows * cols):
        axes[j // cols][j % cols].axis("off")
    where = error_inputs_label(res.get("error_inputs"))
    real = (res.get("error_inputs") or {}).get("kind") == "real"
    inputs = f"time on i.i.d. N(0, 1) inputs, error on {where}" if real else f"time and error on {where}"
    fig.suptitle(f"Error against forward time ({_subtitle(res)}; {inputs})", fontsize=11)
    return save_figure(fig, path)


def plot_compare(res: dict[str, Any], out: Path) -> list[Path]:
    paths = [
        _vs_n(res, [("forward_s", "forward"), ("forward_backward_s", "forward + backward")],
              "time per call (ms, log)", 1e3, f"Time against sequence length ({_subtitle(res)})",
              out / "time_vs_n.png"),
        _vs_n(res, [("forward_bytes", "forward (no grad)"), ("forward_backward_bytes", "forward + backward")],
              "peak memory above inputs (MiB, log)", 1 / 2**20,
              f"Peak memory against sequence length ({_subtitle(res)})", out / "memory_vs_n.png"),
    ]
    if any(r["kind"] == "attention" for r in res["rows"]):
        paths.append(_error_vs_time(res, out / "error_vs_time.png"))
    return paths


def plot(res: dict[str, Any], out: Path, renderer: Renderer | None = None) -> list[Path]:
    """The plots of a results document of any kind, by ``renderer`` (default: the one registered
    for its kind); returns their paths."""
    return (renderer or renderer_for(res)).plot(res, out)
