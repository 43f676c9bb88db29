"""``subquad compare --source smollm``: every causal attention method's error on the Q, K, V of
SmolLM2-135M-Instruct at up to 8192 tokens (captured by :mod:`subquad.data.smollm` and kept on disk),
against exact causal attention in float64; with ``--perplexity``, also the model itself with each
row's attention in every layer (:func:`subquad.hf.retrofit`, zero-shot) on the same tokens: its
perplexity, the greedy next tokens it shares with the model's own attention, and its forward's
seconds. With ``--limits`` (:mod:`subquad.compare.limits`) the same tables also hold the rank-r,
block-local and uniform reference rows, and the sharpness of the exact attention.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

import torch

from ..data import smollm
from .common import (Config, Renderer, attention_methods, comparison_rows, fmt_error, is_exact, machine_info,
                     md_table, method_errors, progress_bar, register_renderer, text_table)
from .fidelity import exact_reference
from .gate import verdicts
from .limits import limit_rows, sharpness_rows, sharpness_table

__all__ = ["run", "keys_per_query", "summary_text", "markdown_smollm", "plot_smollm", "RENDERER"]


def run(config: Config, *, layers: Sequence[int] | None = None, cache_dir: str | Path = smollm.CACHE_DIR,
        show_progress: bool = True) -> dict[str, Any]:
    """Every causal attention method's error on SmolLM2's Q, K, V at each ``config.ns`` (at most
    8192): per layer over all heads against exact causal attention in float64, ``"mean"`` over the
    ``layers`` (default ``config.layers``, else :func:`subquad.data.smollm.default_layers`), captures from
    :func:`subquad.data.smollm.cached_capture`."""
    from .workload import DTYPES

    start = time.time()
    device, dtype = torch.device(config.device), DTYPES[config.dtype]
    layers = layers if layers is not None else config.layers
    layers = smollm.default_layers() if layers is None else smollm.check_request(1, layers)
    attention, notes = attention_methods(config, causal=True)
    rows = len(comparison_rows(attention, config, 1))
    steps = rows * (len(layers) + config.perplexity) + config.perplexity
    bar = progress_bar(steps * len(config.ns), "subquad compare --source smollm", show_progress)
    points, cap = [], {}
    if config.perplexity:
        from ..data.pretrained import load_smollm

        bar.set_postfix_str("loading SmolLM2-135M-Instruct for --perplexity")
        tokenizer, model = load_smollm()
        gates = verdicts([info.name for info in attention], config.gate, bar)
    try:
        for n in sorted(config.ns):
            bar.set_postfix_str(f"N={n}: SmolLM2 capture and exact attention")
            cap = smollm.cached_capture(n, layers, cache_dir=cache_dir, log=bar.write)
            inputs = [tuple(t[i].to(device, dtype) for t in (cap["q"], cap["k"], cap["v"])) for i in range(len(layers))]
            refs = [exact_reference(*x, cap["scale"], causal=True) for x in inputs]
            specs = comparison_rows(attention, config, n)
            errors = method_errors(specs, inputs, refs, config, bar, f"N={n}", call=smollm.call_arguments(cap))
            points.append({"n": n, "capture_check": cap["check"], "capture_seconds": cap["seconds"],
                           "cached_layers": cap["cached"], "errors": errors,
                           "keys_per_query": keys_per_query(specs, inputs, causal=True)})
            if config.limits:
                points[-1]["sharpness"] = sharpness_rows(inputs, scale=cap["scale"], causal=True)
                errors.update(limit_rows(inputs, refs, config.budgets, scale=cap["scale"], causal=True, bar=bar,
                                         seed=config.seed))
            del inputs, refs
            if config.perplexity:
                points[-1]["perplexity"] = perplexities(_gated(comparison_rows(attention, config, n), gates), n,
                                                       tokenizer, model, bar, config.rounds)
    finally:
        bar.close()
    return {"kind": "smollm", "config": asdict(config), "machine": machine_info(device), "model": smollm.MODEL_NAME,
            "text": cap.get("text"), "layers": layers, "heads": cap.get("heads"), "kv_heads": cap.get("kv_heads"),
            "head_dim": cap.get("head_dim"), "scale": cap.get("scale"), "cache_dir": str(cache_dir),
            "points": points, "notes": notes, "seconds": time.time() - start}


def keys_per_query(rows: list, inputs: list[tuple], causal: bool) -> dict[str, dict[str, Any]]:
    """For each ``(label, info, options)`` row whose method reports it (its registry entry's
    ``expected_keys``), the keys a query attends in expectation on every layer's ``(q, k, v)``:
    ``{label: {"per_layer", "mean", "last_quarter"}}``, means over items, heads and queries
    (``last_quarter``: the queries from 3N/4 on, which see the most keys when ``causal``)."""
    out = {}
    for label, info, options in rows:
        if info.expected_keys is None or isinstance(options, Exception):
            continue
        o = info.make_options(**options)
        try:
            counts = [info.expected_keys(q, k, causal, o) for q, k, _ in inputs]
        except NotImplementedError:  # not countable with these options (xattention's top_p)
            continue
        per_layer = [c.mean().item() for c in counts]
        late = [c[..., 3 * c.shape[-1] // 4:].mean().item() for c in counts]
        out[label] = {"per_layer": per_layer, "mean": sum(per_layer) / len(per_layer),
                      "last_quarter": sum(late) / len(late)}
    return out


def _gated(rows: list, gates: dict[str, dict[str, Any]]) -> list:
    """``rows`` with the options of a method that failed the gate replaced by the reason."""
    return [(label, info, RuntimeError(f"failed its correctness gate ({gates[info.name]['detail']}); not run")
             if gates.get(info.name, {}).get("status") == "failed" else options) for label, info, options in rows]


@contextlib.contextmanager
def _attention(model, method: str, options: dict[str, Any]):
    """``model`` with ``method`` as every layer's attention inside the block (the retrofit's
    warnings about decoding do not concern one forward and are not shown)."""
    from .. import hf

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*cannot decode from a cache", category=UserWarning)
        hf.retrofit(model, method, **options)
    try:
        yield model
    finally:
        hf.unretrofit(model)


def _time_rounds(out: dict[str, Any], rows: list, model, ids, rounds: int, bar) -> None:
    """``seconds``: the median of ``rounds`` forwards, interleaved (the model's own, then every row
    that ran, per round), ``rounds`` the times and ``speedup`` over the model's own median, into
    ``out``'s entries."""
    from .. import hf

    ran = [(label, info, options) for label, info, options in rows if out[label]["failure"] is None]
    times: dict[str, list[float]] = {label: [] for label in ["exact", *(r[0] for r in ran)]}
    for r in range(rounds):
        bar.set_postfix_str(f"N={ids.shape[1]}: timing round {r + 1} of {rounds}")
        times["exact"].append(hf.next_token_losses(model, ids)[2])
        for label, info, options in ran:
            with _attention(model, info.name, options):
                times[label].append(hf.next_token_losses(model, ids)[2])
    base = statistics.median(times["exact"])
    for label, t in times.items():
        out[label].update(seconds=statistics.median(t), rounds=t, speedup=base / statistics.median(t))


def perplexities(rows: list[tuple[str, Any, Any]], n: int, tokenizer, model, bar, rounds: int = 0) -> dict[str, Any]:
    """SmolLM2 on its first ``n`` held-out tokens (:func:`subquad.hf.eval_ids`) with its own
    attention (``"exact"``) and then with each ``(label, info, options)`` row's in every layer:
    ``{label: {ppl, ppl_last_quarter, ppl_ratio, last_quarter_ratio, same_prediction, seconds,
    speedup, failure}}`` (:func:`subquad.hf.lm_scores`; ``speedup``: the model's own forward's
    seconds over the row's, one forward each after a 64-token warm-up forward, or with ``rounds``
    the medians of that many more, interleaved: :func:`_time_rounds`). A row that raises keeps its
    message as ``failure``."""
    from .. import hf

    ids = hf.eval_ids(tokenizer, n)
    bar.set_postfix_str(f"N={n}: SmolLM2's own attention")
    hf.next_token_losses(model, ids[:, :64])
    loss, pred, seconds = hf.next_token_losses(model, ids)
    exact = {**hf.lm_scores(loss, pred), "pred": pred}
    out: dict[str, Any] = {"exact": {"ppl": exact["ppl"], "ppl_last_quarter": exact["ppl_last_quarter"],
                                     "seconds": seconds, "failure": None}}
    bar.update(1)
    for label, info, options in rows:
        bar.set_postfix_str(f"{label}: SmolLM2 perplexity N={n}")
        entry: dict[str, Any] = {"failure": None}
        try:
            if isinstance(options, Exception):
                raise options
            with _attention(model, info.name, options):
                loss, row_pred, row_seconds = hf.next_token_losses(model, ids)
            entry.update(hf.lm_scores(loss, row_pred, exact), seconds=row_seconds, speedup=seconds / row_seconds)
        except Exception as e:  # noqa: BLE001 (reported, the run goes on)
            entry["failure"] = f"{type(e).__name__}: {e}"[:300]
        out[label] = entry
        bar.update(1)
    if rounds:
        _time_rounds(out, rows, model, ids, rounds, bar)
    return out


def _perplexity_table(p: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Rows: the model's own attention, then the rows by perplexity ratio; columns: the error,
    the perplexity and its last quarter against exact, the agreeing next tokens and the forward."""
    ppl = p["perplexity"]
    own = ppl["exact"]
    body = [["SmolLM2's own attention", "", f"{own['ppl']:.3f}", "1.0000", "1.0000", "100.0", f"{own['seconds']:.1f}",
             "1.00x"]]
    ranked = sorted((label for label in ppl if label != "exact"),
                    key=lambda label: (ppl[label]["failure"] is not None, ppl[label].get("ppl_ratio", 0.0)))
    for label in ranked:
        r, e = ppl[label], p["errors"][label]
        error = fmt_error(e["mean"]) if e["failure"] is None else "failed"
        if r["failure"] is not None:
            body.append([label, error, f"FAILED: {r['failure']}", "", "", "", "", ""])
            continue
        body.append([label, error, f"{r['ppl']:.3f}", f"{r['ppl_ratio']:.4f}", f"{r['last_quarter_ratio']:.4f}",
                     f"{100 * r['same_prediction']:.1f}", f"{r['seconds']:.1f}", f"{r['speedup']:.2f}x"])
    timed = f"forward s (median of {len(own['rounds'])})" if "rounds" in own else "forward s"
    return ["method", "error", "perplexity", "vs exact", "last quarter vs exact", "same next token %",
            timed, "speed-up"], body


def _table(res: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Rows: methods, best at the longest N first; columns: the mean error over layers at each N."""
    points = res["points"]
    names = list(points[0]["errors"]) if points else []

    def last(name):
        e = points[-1]["errors"][name]["mean"]
        return (e is None, e or 0.0)

    counted = [p for p in points if p.get("keys_per_query")]  # a column for each N with a method that reports it
    body = []
    for name in sorted(names, key=last):
        cells = [fmt_error(p["errors"][name]["mean"]) if p["errors"][name]["failure"] is None
                 else f"FAILED: {p['errors'][name]['failure']}" for p in points]
        keys = [p["keys_per_query"].get(name) for p in counted]
        body.append([name, *cells, *(f"{k['mean']:.0f} ({k['last_quarter']:.0f})" if k else "" for k in keys)])
    return ["method", *(f"N = {p['n']}" for p in points),
            *(f"keys per query at N = {p['n']} (last quarter)" for p in counted)], body


def _sharpness_table(res: dict[str, Any]) -> tuple[list[str], list[list[str]]] | None:
    """``--limits``: how peaked the exact attention rows are at each N, means over layers, heads
    and queries; None without it."""
    points = [p for p in res["points"] if "sharpness" in p]
    return sharpness_table([(f"N = {p['n']}", p["sharpness"]) for p in points]) if points else None


def _per_layer_tables(res: dict[str, Any]) -> list[str]:
    """report.md's per-layer section: at each N, every row's error at each layer (and with
    ``--limits`` the entropy and top-key weight of each layer)."""
    out = []
    for p in res["points"]:
        body = [[label, fmt_error(e["mean"]), *(fmt_error(x) for x in e["per_layer"])] if e["failure"] is None
                else [label, "FAILED", *("" for _ in res["layers"])] for label, e in p["errors"].items()]
        if "sharpness" in p:
            s = p["sharpness"]
            body += [[f"sharpness: {what}", f"{s[key]:.3f}", *(f"{x[key]:.3f}" for x in s["per_layer"])]
                     for what, key in (("entropy (nats)", "entropy"), (f"weight on the {s['top']} largest keys",
                                                                       "top_mass"))]
        headers = ["row", "mean", *(f"L{layer}" for layer in res["layers"])]
        out += ["", f"### N = {p['n']}", "", md_table(headers, body)]
    return out


def _intro(res: dict[str, Any]) -> list[str]:
    checks = ", ".join(f"{p['capture_check']:.1e}" for p in res["points"])
    return [f"{res['model']} on the {res['text']}: layers {res['layers']} of 30, {res['heads']} query heads "
            f"({res['kv_heads']} key/value heads repeated over their groups), head dim {res['head_dim']}, causal, "
            f"scale {res['scale']:.4g}. q and k after the rotary embedding; exact causal attention on the capture "
            f"reproduces the model's attention output to {checks} (per N). Captures cached in {res['cache_dir']}.",
            "", "Relative error `|out - exact|_F / |exact|_F` against exact causal attention in float64, per layer "
            "over all heads, mean over the layers; every method with causal=True and its options."
            + (" A row `M @ F%`: method M with `round(F N)` exact keys a query (its registry entry's "
               "`budget_options`: the same budget for every sparse method; a budget below a method's fixed "
               "blocks fails)." if res["config"].get("budgets") else "")
            + (" Reference rows (`--limits`): `uniform`, every query's mean of the values it sees; `rank-r limit @ "
               "F%`, the best rank-r approximation of each head's exact attention matrix times V, r = round(F N) "
               "(no method whose attention matrix has rank <= r does better); `block-local @ F%`, exact attention "
               "inside the query's own block of round(F N) keys." if res["config"].get("limits") else "")
            + (" Keys per query: the keys a query attends in expectation (the method's registry "
               "`expected_keys`), mean over layers, heads and queries, and over the last quarter of the queries."
               if any(p.get("keys_per_query") for p in res["points"]) else "")]


def _perplexity_intro(res: dict[str, Any]) -> str:
    return ("SmolLM2-135M-Instruct itself (float32, dequantised from its GGUF file) on the same first N tokens, "
            "with every layer's attention replaced by the row's (`subquad.hf.retrofit`, zero-shot: no weight "
            "changes): next-token perplexity over the window and over its last quarter against the model's own "
            "attention, the share of positions whose greedy next token agrees, and one whole forward's seconds "
            f"({res['machine']['threads']} threads; speed-up: the model's own forward's seconds over the row's).")


def summary_text(res: dict[str, Any]) -> str:
    headers, body = _table(res)
    sharp = _sharpness_table(res)
    out = [*_intro(res), "", text_table(headers, body), *(["", text_table(*sharp)] if sharp else [])]
    for p in res["points"] if "perplexity" in (res["points"] or [{}])[0] else ():
        out += ["", f"SmolLM2 perplexity at N = {p['n']}:", text_table(*_perplexity_table(p))]
    return "\n".join([*out, *(f"note: {n}" for n in res["notes"])])


def markdown_smollm(res: dict[str, Any], images: list[str]) -> str:
    c = res["config"]
    headers, body = _table(res)
    out = ["# subquad compare --source smollm: fidelity on long causal attention", "", *_intro(res), "",
           f"{c['dtype']} on {res['machine']['device']}, torch {res['machine']['torch']}, {res['seconds']:.0f} s. "
           f"Command: `{c['command']}`", "", md_table(headers, body)]
    sharp = _sharpness_table(res)
    out += ["", md_table(*sharp)] if sharp else []
    out += ["", *(f"![{Path(p).stem}]({p})" for p in images)] if images else []
    if res["points"] and "perplexity" in res["points"][0]:
        out += ["", "## Perplexity", "", _perplexity_intro(res)]
        for p in res["points"]:
            out += ["", f"### N = {p['n']}", "", md_table(*_perplexity_table(p))]
    notes = [*res["notes"], *(f"{m} options: {', '.join(f'{k}={v}' for k, v in o.items())}"
                              for m, o in c["options"].items() if o)]
    out += ["", "## Notes", "", *(f"- {n}" for n in notes)] if notes else []
    out += ["", "## Per layer", "", "Each row's error at each captured layer (all heads; results.json has each "
            "head's)."] + _per_layer_tables(res) if res["points"] else []
    return "\n".join(out) + "\n"


def plot_smollm(res: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib.pyplot as plt

    from .plots import log_axis, method_colors, save_figure

    names = [name for name in (res["points"][0]["errors"] if res["points"] else [])
             if not is_exact(name) and " @ " not in name]
    colors = method_colors(names)
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    ns = [p["n"] for p in res["points"]]
    for name in names:
        errors = [p["errors"][name]["mean"] for p in res["points"]]
        ax.plot(ns, [math.nan if e is None else e for e in errors], marker="o", color=colors[name], label=name)
    log_axis(ax, "x")
    log_axis(ax, "y")
    ax.set_xlabel("N (tokens)")
    ax.set_ylabel("relative error, mean over layers (log)")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8, frameon=False)
    ax.set_title(f"{res['model']}: causal attention, layers {res['layers']}", fontsize=9)
    paths = [save_figure(fig, out / "smollm_error.png")]
    if res["config"].get("budgets") and res["points"]:
        paths.append(_plot_budgets(res, out))
    return paths


def _plot_budgets(res: dict[str, Any], out: Path) -> Path:
    """Error against the share of keys, one panel per N, one line per method with a budget."""
    import matplotlib.pyplot as plt

    from .plots import log_axis, method_colors, save_figure

    shares = res["config"]["budgets"]
    methods = sorted({name.split(" @ ")[0] for name in res["points"][0]["errors"] if " @ " in name})
    colors = method_colors(methods)
    fig, axes = plt.subplots(1, len(res["points"]), figsize=(4 * len(res["points"]), 3.6), squeeze=False)
    for ax, p in zip(axes[0], res["points"]):
        for m in methods:
            errors = [p["errors"].get(f"{m} @ {100 * f:g}%", {}).get("mean") for f in shares]
            ax.plot([100 * f for f in shares], [math.nan if e is None else e for e in errors], marker="o",
                    color=colors[m], label=m)
        log_axis(ax, "x")
        log_axis(ax, "y")
        ax.set_title(f"N = {p['n']}", fontsize=9)
        ax.set_xlabel("exact keys a query (% of N)")
        ax.grid(True, which="major", alpha=0.3)
    axes[0][0].set_ylabel("relative error, mean over layers (log)")
    axes[0][-1].legend(fontsize=8, frameon=False)
    fig.suptitle(f"{res['model']}: sparse methods at equal budgets", fontsize=9)
    return save_figure(fig, out / "smollm_budgets.png")


#: the console summary, report.md and the plot of a ``"smollm"`` document
RENDERER = register_renderer(Renderer("smollm", summary=summary_text, markdown=markdown_smollm, plot=plot_smollm))
