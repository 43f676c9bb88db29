"""Reports of ``subquad compare``: the console leaderboard, report.md and results.json.

One results document per run (``kind``: ``"compare"``, ``"minilm"``, ``"smollm"`` or ``"peers"``); the same
document makes the console table, the markdown report and the plots. This module renders the
``"compare"`` kind and writes the files of any kind through that kind's
:class:`~subquad.compare.common.Renderer` (each result module has its ``RENDERER``); it imports none
of the result modules. The number formats and tables live in :mod:`subquad.compare.common`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable

from .common import (Renderer, error_inputs_label, exact_method, fmt_bytes, fmt_error, fmt_rate, fmt_ratio,
                     fmt_seconds, is_exact, md_table, renderer_for, text_table)
from .timing import MIN_RUNS

__all__ = ["timing_warnings", "leaderboard_text", "markdown_compare", "markdown", "write_report", "text_table",
           "md_table", "fmt_seconds", "fmt_bytes", "fmt_ratio", "fmt_error"]


# ---------------------------------------------------------------------------------------------
# compare
# ---------------------------------------------------------------------------------------------

COLUMNS = ["method", "forward ms", "vs exact", "fwd+bwd ms", "vs exact", "peak MiB fwd",
           "peak MiB fwd+bwd", "rel. error", "GFLOP/s (% matmul)", "status"]


#: the time a recommendation minimises, in words
OBJECTIVE_WORDS = {"forward": "forward", "training": "forward+backward", "decode": "decode (one token's attention)"}


def _extra_columns(res: dict[str, Any]) -> list[tuple[str, Callable[[dict[str, Any]], str]]]:
    """The columns a run's settings add before the status: the decode time (``--objective
    decode``), the first call (``--compile``: compiling), and the speed-up ceiling at the matmul roof
    (not with ``--causal``, whose rows have no FLOP count)."""
    c = res["config"]
    extra = []
    if c.get("objective") == "decode":
        extra += [("decode ms/token", lambda r: fmt_seconds(r.get("decode_s"))),
                  ("vs exact", lambda r: fmt_ratio(r.get("speedup_decode"))),
                  ("cache MiB", lambda r: fmt_bytes(r.get("cache_bytes")))]
    if c.get("compile"):
        extra += [("first call ms", lambda r: fmt_seconds(r.get("forward_first_s")))]
    if not c.get("causal") and any(r.get("speedup_ceiling") for r in res["rows"]):
        extra += [("ceiling vs exact", lambda r: fmt_ratio(r.get("speedup_ceiling")))]
    return extra


def _columns(res: dict[str, Any], markdown: bool) -> list[str]:
    """:data:`COLUMNS` with the error column named by its inputs: "error on real MiniLM activations
    (N = 418)" in report.md, "rel. error (MiniLM)" on the console; and the run's extra columns."""
    label = error_inputs_label(res.get("error_inputs"), short=not markdown)
    error = f"error on {label}" if markdown else f"rel. error ({label})"
    names = [error if c == "rel. error" else c for c in COLUMNS]
    return names[:-1] + [name for name, _ in _extra_columns(res)] + names[-1:]


def _error_inputs_text(res: dict[str, Any]) -> str:
    """What the errors were measured on, in a sentence (the time and memory inputs with it)."""
    e = res.get("error_inputs")
    label = error_inputs_label(e)
    if not e or e.get("kind") != "real":
        return (f"Errors on {label} at each N, the inputs of the times: relative error against exact attention "
                "in float64.")
    return (f"Errors on {label}: the Q, K, V of all {e['layers']} layers x {e['heads']} heads (head dim "
            f"{e['head_dim']}) of {e['model']} on the {e['text']}, captured once; relative error against exact "
            "attention in float64 per layer, mean over layers (the numbers of `subquad compare --source "
            "minilm`). Times and memory on i.i.d. N(0, 1) inputs at each N.")


def _real(res: dict[str, Any]) -> bool:
    return (res.get("error_inputs") or {}).get("kind") == "real"


def _error_where(res: dict[str, Any]) -> str:
    if _real(res):
        return ("on each layer's captured Q, K, V (all heads), mean over layers: one number per method, the "
                "same at every N")
    return "on the same inputs as the times"


def _why_error_inputs(res: dict[str, Any]) -> str:
    if _real(res):
        return ("The errors are not taken on those random inputs: there attention is nearly uniform, the exact "
                "output a small average, and sparse and random-feature methods look worse than they are on a "
                "trained model's sharp attention (`--error-inputs iid` measures there).")
    return ("On such inputs attention is nearly uniform, so the exact output is a small average and relative "
            "errors are large; on real activations they differ (`--error-inputs real`, the default with "
            "`pip install 'subquad[real]'`, or `subquad compare --source minilm`).")


def _status(r: dict[str, Any], short: bool) -> str:
    if r["status"] == "ok":
        return "ok"
    parts = [f"{stage}: {msg}" for stage, msg in r["errors"].items()]
    parts += [n for n in r["notes"] if not n.startswith("token mixer")]
    if short:
        word = {"failed": "FAILED", "skipped": "skipped", "partial": "partial"}[r["status"]]
        return word if not parts else f"{word} ({len(parts)} note{'s' if len(parts) > 1 else ''})"
    return "; ".join(parts) if parts else r["status"]


def _sorted_rows(rows: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    at_n = [r for r in rows if r["n"] == n]
    timed = sorted((r for r in at_n if r.get("forward_s") is not None), key=lambda r: r["forward_s"])
    return timed + [r for r in at_n if r.get("forward_s") is None]


def _cells(res: dict[str, Any], r: dict[str, Any], short: bool) -> list[str]:  # in the order of _columns
    name = r["method"] + (" (mixer)" if r["kind"] == "mixer" else "")
    return [name, fmt_seconds(r["forward_s"]), fmt_ratio(r.get("speedup_forward")),
            fmt_seconds(r["forward_backward_s"]), fmt_ratio(r.get("speedup_forward_backward")),
            fmt_bytes(r["forward_bytes"]), fmt_bytes(r["forward_backward_bytes"]), fmt_error(r["rel_error"]),
            fmt_rate(r), *(cell(r) for _, cell in _extra_columns(res)), _status(r, short)]


def _shape_line(res: dict[str, Any]) -> str:
    c, m = res["config"], res["machine"]
    where = m.get("gpu") or f"{m['cpu']}, {m['threads']} threads"
    return (f"B={c['batch']}, H={c['heads']}, D={c['dim']}, {c['dtype']} on {m['device']} ({where}), "
            f"torch {m['torch']}")


def _recommendation_lines(res: dict[str, Any]) -> list[str]:
    """One sentence per N for --max-error."""
    what = OBJECTIVE_WORDS[res["config"]["objective"]]
    lines = []
    for rec in res["recommendations"]:
        if rec["method"] is None:
            lines.append(f"At N={rec['n']} no method stays within relative error {rec['max_error']:g}.")
        else:
            lines.append(
                f"At N={rec['n']} with relative error <= {rec['max_error']:g}, use **{rec['method']}**: "
                f"{fmt_seconds(rec['seconds'])} ms {what}, {fmt_ratio(rec['speedup'])} vs exact "
                f"attention, error {fmt_error(rec['rel_error'])}.")
    return lines


def _budget_table(res: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Per N, the fastest method for every range of error budgets (the Pareto front)."""
    what = {"forward": "forward", "training": "fwd+bwd", "decode": "decode per token"}[res["config"]["objective"]]
    headers = ["N", "error budget E", "fastest method", f"{what} ms", "vs exact", "its error"]
    body = []
    for b in res["budgets"]:
        low, high = fmt_error(b["from_error"]), fmt_error(b["to_error"])
        if is_exact(b["method"]):  # its error is float rounding: any budget above it
            budget = "any E" if b["to_error"] is None else f"E < {high}"
        else:
            budget = f"E >= {low}" if b["to_error"] is None else f"{low} <= E < {high}"
        body.append([str(b["n"]), budget, b["method"], fmt_seconds(b["seconds"]), fmt_ratio(b["speedup"]),
                     fmt_error(b["rel_error"])])
    return headers, body


#: a timed point whose blocks' (slowest - fastest) / median exceeds this is listed as unsteady
WIDE_SPREAD = 0.5


def timing_warnings(res: dict[str, Any]) -> list[str]:
    """What makes this run's times doubtful: a machine loaded by other processes (1-minute load
    average above the cores this run leaves idle, before or after it) and points whose timed
    blocks spread wider than :data:`WIDE_SPREAD`."""
    out = []
    threads = res["machine"]["threads"]
    for when, load in (res["machine"].get("load") or {}).items():
        if load and load["load_1min"] > load["cores"] - threads + 0.5:
            out.append(f"the machine was loaded {when} the run (load average {load['load_1min']:.1f} on "
                       f"{load['cores']} cores, {threads} threads used): times may be inflated")
    for r in res["rows"]:
        if (r.get("matmul_fraction") or 0.0) > 1.0:
            out.append(f"N={r['n']} {r['method']}: {100 * r['matmul_fraction']:.0f} % of the matmul roof, which "
                       "was measured low (or the method's FLOP formula counts work it does not do)")
        for what, key in (("forward", "forward_spread"), ("fwd+bwd", "forward_backward_spread")):
            if (r.get(key) or 0.0) > WIDE_SPREAD:
                out.append(f"N={r['n']} {r['method']}: {what} runs spread {100 * r[key]:.0f} % of their median")
    return out


def leaderboard_text(res: dict[str, Any]) -> str:
    """The console leaderboard: one table per N, fastest forward first, and the recommendation."""
    c = res["config"]
    out = [f"subquad compare: {_shape_line(res)}; times are medians", _error_inputs_text(res)]
    for n in sorted({r["n"] for r in res["rows"]}):
        rows = _sorted_rows(res["rows"], n)
        out += ["", f"N = {n}", text_table(_columns(res, markdown=False), [_cells(res, r, short=True) for r in rows])]
    problems = [(r, _status(r, short=False)) for r in res["rows"] if r["status"] != "ok"]
    if problems:
        out += ["", "Notes:"] + [f"  N={r['n']} {r['method']}: {text}" for r, text in problems]
    warnings = timing_warnings(res)
    if warnings:
        out += ["", "Timing warnings:"] + [f"  {w}" for w in warnings]
    what = OBJECTIVE_WORDS[c["objective"]]
    headers, body = _budget_table(res)
    label = error_inputs_label(res.get("error_inputs"))
    out += ["", f"Fastest {what} for each range of error budgets E (relative error vs exact on {label}):",
            text_table(headers, body)]
    if c.get("max_error") is not None:
        out += [""] + [line.replace("**", "") for line in _recommendation_lines(res)]
    else:
        out += ["Pass --max-error E for a single recommendation."]
    return "\n".join(out)


def _columns_explained(res: dict[str, Any]) -> list[str]:
    c = res["config"]
    cpu = res["machine"]["device"].startswith("cpu")
    mem = ("the rise of the process's peak resident memory over its inputs, in a fresh process per point"
           if cpu else "`torch.cuda.max_memory_allocated` over the inputs")
    if not c["memory"]:
        mem = "not measured (--no-memory)"
    return [
        "## Columns",
        "",
        f"- **forward ms**, **fwd+bwd ms**: median over at least {MIN_RUNS} timed blocks of calls "
        f"(`subquad.compare.timing`: at least {c['min_run_time']:g} s, after one untimed call, "
        f"{res['machine']['threads']} threads; each block's spread is in results.json)"
        + (f", then the median over {c['rounds']} rounds, every row of an N timed once per round (`--rounds`; "
           "each round's time is in results.json)" if c.get("rounds", 0) > 1 else "")
        + "; fwd+bwd computes the "
        "gradients of q, k, v for a fixed random output gradient. **vs exact**: exact attention's time "
        "divided by the method's, both from this run (quote these ratios; absolute times drift on a "
        "shared machine).",
        f"- **peak MiB**: {mem}; forward under `torch.no_grad`.",
        f"- **{_columns(res, markdown=True)[7]}**: `|out - exact|_F / |exact|_F` over the whole output, against "
        f"exact softmax attention computed in float64 {_error_where(res)}; stochastic methods use one seeded "
        "draw.",
        "- **GFLOP/s**: the forward's matmul FLOPs (formulas in `subquad.compare.flops`, checked against "
        "`torch.utils.flop_counter` in the tests; softmaxes and other elementwise work are not counted) "
        "over its time, and that as a share of this machine's matmul rate (the fastest measured block of "
        "a large square matmul, the faster of its measurements at the start and at the end of the run, "
        "and of float32's and the run's dtype's). "
        "Methods dominated by elementwise work or small matmuls sit far below 100%.",
        *_extra_explained(res),
        f"- **status**: `skipped` when a call was predicted to take over --max-call-seconds "
        f"({c['max_call_seconds']:g} s); `partial` or `FAILED` with the error below.",
        f"- **correctness gate**: {_gate_text(res)}",
    ]


def _extra_explained(res: dict[str, Any]) -> list[str]:
    """What the run's extra columns (:func:`_extra_columns`) mean."""
    names = [name for name, _ in _extra_columns(res)]
    c = res["config"]
    out = []
    if "decode ms/token" in names:
        out.append(f"- **decode ms/token**: one generated token's attention after a prefill of N tokens, the median "
                   f"of {c.get('decode_steps')} single-token calls (`subquad.compare.decode`: a method's decoding "
                   "state, or the new query against every cached key); **cache MiB**: what the cache holds after.")
    if "first call ms" in names:
        out.append("- **first call ms**: the untimed first forward (for a `compiled` row: tracing and compiling "
                   "it, with whatever the compile caches already held).")
    if "ceiling vs exact" in names:
        out.append("- **ceiling vs exact**: exact attention's forward time over the method's FLOPs at the "
                   "matmul rate: the speed-up the method would reach if all its FLOPs ran at that rate and "
                   "nothing else took time; below the target speed-up, no kernel reaches it at this FLOP count.")
    return out


def _gate_text(res: dict[str, Any]) -> str:
    """What the correctness gate (:mod:`subquad.compare.gate`) decided, in one sentence."""
    gates = res.get("gate")
    if not gates:
        return "off (--no-gate): the methods were timed without their tests." if gates == {} else "not recorded."
    by = {s: sorted(m for m, g in gates.items() if g["status"] == s) for s in ("passed", "failed", "untested")}
    tests = sum(int(g["tests"]) for g in gates.values())
    parts = [f"before timing, {tests} tests against the naive references "
             f"(`tests/ops/test_*.py -k 'naive or reference'`) ran; "
             f"passed: {', '.join(by['passed']) or 'none'}"]
    parts += [f"FAILED, not timed: {', '.join(by['failed'])}"] if by["failed"] else []
    parts += [f"not gated: {', '.join(by['untested'])}"] if by["untested"] else []
    return "; ".join(parts) + "."


def least_memory_lines(res: dict[str, Any]) -> list[str]:
    """Which method's forward peaks lowest at each N, said plainly: on CPU exact attention (SDPA,
    which never forms the N x N matrix there) often does."""
    exact_name = exact_method()
    lines = []
    for n in sorted({r["n"] for r in res["rows"]}):
        rows = [r for r in res["rows"] if r["n"] == n and r.get("forward_bytes") is not None]
        if not rows:
            continue
        best = min(rows, key=lambda r: r["forward_bytes"])
        exact = next((r for r in rows if r["method"] == exact_name), None)
        text = f"- N={n}: least forward peak memory: {best['method']} ({fmt_bytes(best['forward_bytes'])} MiB)"
        if exact is not None and exact is not best:
            text += f"; exact attention {fmt_bytes(exact['forward_bytes'])} MiB"
        elif exact is best:
            text += ": exact attention uses less memory than every approximation here"
        lines.append(text)
    return ["## Memory", "", *lines] if lines else []


def markdown_compare(res: dict[str, Any], images: list[str]) -> str:
    c, m = res["config"], res["machine"]
    rate = m["matmul_flops_per_s"]
    default = 2048 if m["device"].startswith("cpu") else 8192  # results written before matmul_size was recorded
    size = m.get("matmul_size") or {"float32": default, "run_dtype": default}

    def roof(key: str, dtype: str) -> str:
        if not rate.get(key):
            return f"not measured in {dtype} (see the notes)"
        return f"{rate[key] / 1e9:.0f} GFLOP/s in {dtype} ({size[key]} x {size[key]})"

    rate_text = roof("float32", "float32")
    if "run_dtype" in rate:
        rate_text += f", {roof('run_dtype', c['dtype'])}"
    out = [
        "# subquad compare: every method against exact attention",
        "",
        f"{_shape_line(res)}; N = {', '.join(str(n) for n in c['ns'])}; times and memory on i.i.d. N(0, 1) "
        f"q, k, v (seed {c['seed']}). This machine's matmul: {rate_text}. The run took {res['seconds']:.0f} s.",
        "",
        f"{_error_inputs_text(res)} {_why_error_inputs(res)}",
        "",
        f"Command: `{c['command']}`",
        "",
        *[f"**Timing warning**: {w}." for w in timing_warnings(res)],
        "",
        "## Recommendation",
        "",
    ]
    what = OBJECTIVE_WORDS[c["objective"]]
    if c.get("max_error") is not None:
        out += _recommendation_lines(res) + [""]
    headers, body = _budget_table(res)
    label = error_inputs_label(res.get("error_inputs"))
    out += [f"For each range of error budgets E, the fastest method ({what} time) whose relative error on "
            f"{label} stays within E, with its speed-up over exact attention: the methods on the time/error "
            "Pareto front. `subquad compare --n N --max-error E` answers for your own length and budget.", "",
            md_table(headers, body)]
    out += ["", *least_memory_lines(res)]
    if images:
        out += ["", "## Plots"]
        for p in images:
            out += ["", f"![{Path(p).stem}]({p})"]
    for n in sorted({r["n"] for r in res["rows"]}):
        rows = _sorted_rows(res["rows"], n)
        table = md_table(_columns(res, markdown=True), [_cells(res, r, short=True) for r in rows])
        out += ["", f"## N = {n}", "", table]
    problems = [(r, _status(r, short=False)) for r in res["rows"] if r["status"] != "ok"]
    mixers = sorted({r["method"] for r in res["rows"] if r["kind"] == "mixer"})
    options = {r["method"]: r["options"] for r in res["rows"] if r["options"]}
    out += ["", "## Notes", ""]
    out += [f"- N={r['n']} {r['method']}: {text}" for r, text in problems]
    out += [f"- {name}: a token mixer on x (B, N, H*D) with no q, k, v; timed for reference, no error "
            "against attention; its time includes its own input and output projections." for name in mixers]
    out += [f"- {name} options: {', '.join(f'{k}={v}' for k, v in opts.items())}"
            for name, opts in options.items()]
    out += [f"- {note}" for note in res.get("notes", [])]
    out += ["- Methods run with their default options unless listed above (`subquad.list_methods()` "
            "gives them)."]
    out += ["", *_columns_explained(res), ""]
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# any kind
# ---------------------------------------------------------------------------------------------


def markdown(res: dict[str, Any], images: list[str], renderer: Renderer | None = None) -> str:
    """report.md of a results document, by ``renderer`` (default: the one registered for its kind)."""
    return (renderer or renderer_for(res)).markdown(res, images)


def _json_safe(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)


def write_report(res: dict[str, Any], out: Path, *, renderer: Renderer | None = None, plots: bool = True,
                 log: Callable[[str], None] = print) -> list[Path]:
    """Write results.json, the PNG plots (when matplotlib is installed) and report.md into
    ``out`` with ``renderer`` (default: the one registered for the document's kind); returns the
    paths written."""
    renderer = renderer or renderer_for(res)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    images: list[str] = []
    if plots:
        try:
            from . import plots as _  # noqa: F401 (matplotlib, with the Agg backend)
        except ImportError:
            res.setdefault("notes", []).append(
                "No plots: matplotlib is not installed (pip install 'subquad[bench]').")
        else:
            paths = renderer.plot(res, out)
            written += paths
            images = [p.name for p in paths]
    path = out / "results.json"
    path.write_text(json.dumps(_json_safe(res), indent=1) + "\n")
    written.append(path)
    path = out / "report.md"
    path.write_text(renderer.markdown(res, images))
    written.append(path)
    for p in written:
        log(f"wrote {p}")
    return written
