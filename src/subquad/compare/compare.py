"""``subquad compare``: every registered method against exact attention on one workload.

For each length N and method: forward and forward+backward time (median of
``torch.utils.benchmark``), peak memory (a fresh process per point on CPU), relative error to
exact attention computed in float64, speed-up over exact attention, and the achieved matmul
rate against this machine's. A method that raises at some stage is reported with its error;
the run goes on.

Time, FLOPs and memory are measured on i.i.d. N(0, 1) inputs at each N. The error is measured
either on those inputs (``Config.error_inputs = "iid"``) or, once per run, on the Q, K, V of a
real model (``"real"``: :func:`subquad.compare.source_minilm.capture_errors`, handed to :func:`run`
as ``real_errors``; every row of a method then carries that one error). On i.i.d. inputs attention
is nearly uniform and the exact output a small average, so sparse and random-feature methods
look worse there than on the sharp attention of trained models.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor

import subquad

from . import flops as flop_counts
from .common import (Config, Renderer, comparison_rows, error_inputs_label, is_exact, machine_info, machine_load,
                     progress_bar,
                     random_inputs, register_renderer)
from .decode import WARMUP_TOKENS, decode_time
from .fidelity import relative_error
from .gate import verdicts
from .memory import measure, measure_in_subprocess
from .recommend import OBJECTIVES, budget_table, recommend
from .report import leaderboard_text, markdown_compare, write_report
from .timing import BusyNeighbours, median_time
from .workload import DTYPES, forward_backward_call, forward_call, full_options, make_qkv, mixer_module

__all__ = ["Config", "run", "write", "RENDERER", "progress_bar", "machine_info"]

# a forward+backward is assumed to cost this many forwards before one has been measured
_BACKWARD_FACTOR = 3.0


def _message(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    return text if len(text) <= 300 else text[:297] + "..."


def _growth(info, n: int, n_prev: int) -> float:
    ratio = n / n_prev
    return ratio * ratio if info.complexity == "quadratic" else ratio


def _predict(history: dict[int, dict[str, Any]], info, n: int, key: str) -> tuple[float, int] | None:
    """``key`` (seconds or bytes) predicted at ``n`` from the largest smaller length measured
    (or probed), with the method's complexity (N or N^2), and that length."""
    known = [m for m, r in history.items() if m < n and r.get(key) is not None]
    if not known:
        return None
    m = max(known)
    return history[m][key] * _growth(info, n, m), m


@dataclass
class _Point:
    """One (method, N) point while it is measured: its inputs, the method's earlier points, the
    row being filled in and the progress bar that shows the current stage."""

    info: Any
    n: int
    q: Tensor
    k: Tensor
    v: Tensor
    config: Config
    history: dict[int, dict[str, Any]]
    bar: Any
    user_options: dict[str, Any]
    row: dict[str, Any]
    module: Any = None  # a token mixer's module, shared by the forward and the backward
    real_error: dict[str, Any] | None = None  # the method's error on real inputs, measured once
    compiled: bool = False  # a --compile row: the op through torch.compile
    # the timed calls by their row key ("forward_s", "forward_backward_s"), for --rounds' later rounds
    timed: dict[str, Callable[[], object]] = field(default_factory=dict)

    def calls(self) -> dict[str, Any]:
        """The keyword arguments of :func:`forward_call` and :func:`forward_backward_call` here."""
        return {"seed": self.config.seed, "module": self.module, "causal": self.config.causal,
                "compiled": self.compiled}

    def stage(self, what: str) -> None:
        self.bar.set_postfix_str(f"N={self.n} {self.row['method']}: {what}")


def _new_row(info, n: int, user_options: dict[str, Any], label: str | None = None) -> dict[str, Any]:
    """An empty row of ``info``'s method at ``n`` (``label``: its name in the results, the method's
    own unless a ``--sweep`` row)."""
    return {
        "n": n, "method": label or info.name, "kind": info.kind, "complexity": info.complexity,
        "stochastic": info.stochastic, "options": user_options, "status": "ok", "errors": {}, "notes": [],
        "forward_s": None, "forward_runs": None, "forward_spread": None, "forward_first_s": None,
        "forward_backward_s": None, "forward_backward_runs": None, "forward_backward_spread": None,
        "forward_bytes": None, "forward_backward_bytes": None, "rel_error": None,
        "flops": None, "flops_source": None, "decode_s": None, "decode_spread": None, "cache_bytes": None,
    }


#: the length a method is probed at, once, before its first point when that point is longer, so
#: that the time and memory guards have something to scale up from
PROBE_N = 1024
#: share of the available memory a point's predicted forward peak may take
MEMORY_SHARE = 0.8


def _probe(p: _Point) -> None:
    """Before a method's first point, when it is longer than :data:`PROBE_N`: one timed forward
    at that length (after a warm-up) and, with memory measured on CPU, its peak memory in a fresh
    process, into the method's history (not the results). A failing probe leaves the history
    empty; the point itself then reports the failure."""
    config = p.config
    if p.history or p.n <= PROBE_N:
        return
    p.stage(f"probe at N={PROBE_N}")
    entry: dict[str, Any] = {}
    try:
        q, k, v = make_qkv(config.batch, config.heads, PROBE_N, config.dim, dtype=p.q.dtype, device=p.q.device,
                           seed=config.seed)
        module = (mixer_module(p.info, config.heads, config.dim, p.user_options, dtype=q.dtype, device=q.device)
                  if p.info.kind == "mixer" else None)
        fwd = forward_call(p.info, q, k, v, p.user_options, **{**p.calls(), "module": module})
        with torch.no_grad():
            entry["forward_s"] = median_time(fwd, 0.0, min_runs=1).seconds
    except Exception:  # noqa: BLE001
        return
    if config.memory and p.q.device.type == "cpu":
        spec = _memory_spec(p, PROBE_N, backward=False)
        entry["forward_bytes"] = measure_in_subprocess(spec, timeout=120 + 10 * entry["forward_s"]).get("forward_bytes")
    p.history[PROBE_N] = entry


def available_memory(device: torch.device) -> int | None:
    """Bytes a new allocation can take: free GPU memory, or the kernel's MemAvailable (Linux);
    None where unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _skip_large_forward(p: _Point) -> bool:
    """Mark the point skipped when its forward's peak memory, scaled from a shorter length with
    the method's complexity, is predicted over :data:`MEMORY_SHARE` of the available memory."""
    predicted = _predict(p.history, p.info, p.n, "forward_bytes")
    free = available_memory(p.q.device)
    if predicted is None or free is None or predicted[0] <= MEMORY_SHARE * free:
        return False
    return _skip(p, predicted[1], f"need about {predicted[0] / 2**30:.1f} GiB",
                 f"{100 * MEMORY_SHARE:.0f} % of the {free / 2**30:.1f} GiB available")


def _skip_slow_forward(p: _Point) -> bool:
    """Mark the point skipped when its forward is predicted over --max-call-seconds."""
    cap = p.config.max_call_seconds
    predicted = _predict(p.history, p.info, p.n, "forward_s")
    if predicted is None or predicted[0] <= cap:
        return False
    return _skip(p, predicted[1], f"take about {predicted[0]:.0f} s", f"--max-call-seconds {cap:g}")


def _skip(p: _Point, shorter: int, would: str, limit: str) -> bool:
    """Mark the point skipped: its forward would ``would`` (scaled from length ``shorter``), over ``limit``."""
    p.row["status"] = "skipped"
    p.row["notes"].append(f"skipped: a forward would {would} ({p.info.complexity} growth from N={shorter}), "
                          f"over {limit}")
    return True


def _time_forward(p: _Point) -> tuple[Callable[[], Tensor], Tensor, dict[str, Any]] | None:
    """Time the forward under no_grad; returns the call, its last output and the full options,
    or None (the point failed) when building or calling the method raised."""
    config = p.config
    try:
        options = full_options(p.info, p.user_options)
        if p.info.kind == "mixer":
            p.module = mixer_module(p.info, config.heads, config.dim, p.user_options, dtype=p.q.dtype,
                                    device=p.q.device)
        fwd = forward_call(p.info, p.q, p.k, p.v, p.user_options, **p.calls())
        holder: list = [None]

        def keep_output():
            holder[0] = fwd()

        p.stage("forward")
        with torch.no_grad():
            timing = median_time(keep_output, config.min_run_time)
        p.timed["forward_s"] = torch.no_grad()(fwd)
        p.row["forward_s"], p.row["forward_runs"], p.row["forward_spread"] = timing.seconds, timing.runs, timing.spread
        p.row["forward_first_s"] = timing.first
    except Exception as e:  # noqa: BLE001 (a failing method is reported, not fatal)
        p.row["status"] = "failed"
        p.row["errors"]["forward"] = _message(e)
        return None
    return fwd, holder[0], options


def _record_error(p: _Point, output: Tensor, reference: Tensor | None) -> None:
    """The relative error of an attention method's output on these inputs, or its error on the
    real inputs (``p.real_error``, the same at every N); a note for a token mixer."""
    if p.info.kind != "attention":
        p.row["notes"].append("token mixer on x (B, N, H*D): no error against attention; its time "
                              "includes its own input and output projections")
        return
    if p.real_error is not None:
        if p.real_error.get("failure"):
            p.row["errors"]["error"] = f"on the real inputs: {p.real_error['failure']}"
        else:
            p.row["rel_error"] = p.real_error["mean"]
        return
    try:
        p.row["rel_error"] = relative_error(output, reference)
    except Exception as e:  # noqa: BLE001
        p.row["errors"]["error"] = _message(e)


def _record_flops(p: _Point, fwd: Callable[[], Tensor], options: dict[str, Any]) -> None:
    """The forward's matmul FLOPs: from the method's formula, else counted on one call."""
    formula = None
    if p.info.kind == "attention":
        q, k, v = p.q, p.k, p.v
        formula = flop_counts.forward_flops(p.info.name, q.shape[0], q.shape[1], p.n, k.shape[2], q.shape[3],
                                            v.shape[3], options)
    if formula is not None:
        p.row["flops"], p.row["flops_source"] = formula, "formula"
        return
    try:
        p.stage("counting FLOPs")
        with torch.no_grad():
            p.row["flops"], p.row["flops_source"] = flop_counts.counted_flops(fwd), "counted"
    except Exception as e:  # noqa: BLE001
        p.row["errors"]["flops"] = _message(e)


def _time_backward(p: _Point) -> bool:
    """Time forward+backward unless --no-backward or predicted over --max-call-seconds; returns
    whether it ran (the memory measurement then includes it)."""
    if not p.config.backward:
        return False
    cap = p.config.max_call_seconds
    predicted = _predict(p.history, p.info, p.n, "forward_backward_s")
    guess = predicted[0] if predicted else _BACKWARD_FACTOR * p.row["forward_s"]
    if guess > cap:
        p.row["status"] = "partial"
        p.row["notes"].append(f"forward+backward skipped: it would take about {guess:.0f} s, over "
                              f"--max-call-seconds {cap:g}")
        return False
    try:
        p.stage("forward+backward")
        step = forward_backward_call(p.info, p.q, p.k, p.v, p.user_options, **p.calls())
        timing = median_time(step, p.config.min_run_time)
        p.timed["forward_backward_s"] = step
        p.row["forward_backward_s"], p.row["forward_backward_runs"] = timing.seconds, timing.runs
        p.row["forward_backward_spread"] = timing.spread
    except Exception as e:  # noqa: BLE001
        p.row["errors"]["forward_backward"] = _message(e)
        return False
    return True


def _time_decode(p: _Point) -> None:
    """The per-token decode time after a prefill of N tokens (:mod:`.decode`), on inputs of N plus
    the warm-up and timed tokens drawn as the point's are."""
    c = p.config
    try:
        p.stage("decoding")
        extra = WARMUP_TOKENS + c.decode_steps
        q, k, v = make_qkv(c.batch, c.heads, p.n + extra, c.dim, dtype=p.q.dtype, device=p.q.device,
                           seed=c.seed + p.n)
        p.row.update(decode_time(p.info, p.user_options, q, k, v, c.decode_steps))
    except Exception as e:  # noqa: BLE001
        p.row["errors"]["decode"] = _message(e)


def _memory_spec(p: _Point, n: int, backward: bool) -> dict[str, Any]:
    """What :func:`.memory.measure` runs for this point's method at length ``n``."""
    c = p.config
    return {"method": p.info.name, "options": p.user_options, "batch": c.batch, "heads": c.heads, "n": n,
            "dim": c.dim, "dtype": c.dtype, "device": c.device, "seed": c.seed, "backward": backward,
            "threads": torch.get_num_threads(), "causal": c.causal, "compiled": p.compiled}


def _record_memory(p: _Point, backward: bool) -> None:
    """Peak memory of the forward (and of forward+backward when ``backward``): in a fresh process
    on CPU, in this one on GPU."""
    row = p.row
    p.stage("peak memory")
    spec = _memory_spec(p, p.n, backward)
    if p.q.device.type == "cpu":
        budget = 120 + 10 * (row["forward_s"] + (row["forward_backward_s"] or 0.0))
        mem = measure_in_subprocess(spec, timeout=budget)
    else:
        mem = measure(spec)
    row["forward_bytes"] = mem.get("forward_bytes")
    row["forward_backward_bytes"] = mem.get("forward_backward_bytes")
    for stage in ("forward", "backward"):
        if mem.get(f"{stage}_error"):
            row["errors"][f"memory_{stage}"] = mem[f"{stage}_error"]


def _measure_point(row: tuple[str, Any, dict[str, Any]], n: int, q, k, v, reference, config: Config, history, bar,
                   real_error: dict[str, Any] | None = None, compiled: bool = False,
                   timed: dict[str, Callable[[], object]] | None = None) -> dict[str, Any]:
    """Every measurement of one (method, N) point, in order: forward time (or a skip), error
    (against ``reference``, or ``real_error``), FLOPs, forward+backward time, the decode time
    (``--objective decode``), peak memory. ``row``: ``(label, info, options)``
    (:func:`~subquad.compare.common.comparison_rows`); ``compiled``: the op through torch.compile;
    ``timed``: filled with the calls whose times :func:`_more_rounds` measures again."""
    label, info, user_options = row
    p = _Point(info, n, q, k, v, config, history, bar, user_options, _new_row(info, n, user_options, label),
               real_error=real_error, compiled=compiled, timed={} if timed is None else timed)
    _probe(p)
    if _skip_slow_forward(p) or _skip_large_forward(p):
        return p.row
    measured = _time_forward(p)
    if measured is None:
        return p.row
    fwd, output, options = measured
    _record_error(p, output, reference)
    del measured, output  # the output is not kept through the slower stages
    if config.causal:
        p.row["notes"].append("causal: no FLOP count (the formulas count every logit)")
    else:
        _record_flops(p, fwd, options)
    backward = _time_backward(p)
    if config.objective == "decode":
        _time_decode(p)
    if config.memory:
        _record_memory(p, backward)
    if p.row["errors"]:
        p.row["status"] = "partial"
    return p.row


def _more_rounds(rows: list[dict[str, Any]], timed: list[dict[str, Callable[[], object]]], rounds: int,
                 min_run_time: float, bar) -> None:
    """``--rounds R`` (R > 1): the forward and forward+backward times of the rows of one N measured
    ``R - 1`` more times, row after row within a round (exact attention's among them), so that a
    change of the machine's speed during the run reaches every row alike; each time becomes the
    median over the rounds, which ``rounds`` keeps in the row."""
    for row in rows:
        row["rounds"] = {key: [row[key]] for key in ("forward_s", "forward_backward_s") if row.get(key)}
    for r in range(1, rounds):
        for row, calls in zip(rows, timed):
            for key, fn in calls.items():
                if key in row["rounds"]:
                    bar.set_postfix_str(f"N={row['n']} {row['method']}: round {r + 1}/{rounds}")
                    row["rounds"][key].append(median_time(fn, min_run_time, min_runs=1).seconds)
    for row in rows:
        for key, times in row["rounds"].items():
            row[key] = statistics.median(times)


def _derived(rows: list[dict[str, Any]], rates: dict[str, float]) -> None:
    """Speed-ups over exact attention at the same N and the achieved FLOP rate, against the faster
    of the float32 and the run's dtype's matmul rates (half-precision inputs are computed in float32
    by most ops, so on a device without fast half-precision products float32's is their roof)."""
    exact = {r["n"]: r for r in rows if is_exact(r["method"])}
    roof = max((rate for rate in rates.values() if rate), default=None)
    for r in rows:
        base = exact.get(r["n"])
        pairs = (("forward_s", "speedup_forward"), ("forward_backward_s", "speedup_forward_backward"),
                 ("decode_s", "speedup_decode"))
        for key, out in pairs:
            ok = base is not None and base.get(key) and r.get(key)
            r[out] = base[key] / r[key] if ok else None
        ok = r.get("flops") and r.get("forward_s")
        r["gflops"] = r["flops"] / r["forward_s"] / 1e9 if ok else None
        r["matmul_fraction"] = r["flops"] / r["forward_s"] / roof if ok and roof else None
        # the speed-up over exact attention if every FLOP ran at the matmul roof (no other pass)
        ok = r.get("flops") and roof and base is not None and base.get("forward_s")
        r["speedup_ceiling"] = base["forward_s"] / (r["flops"] / roof) if ok else None


#: a dtype whose square product runs this many times slower than float32's is called out up front
SLOW_DTYPE = 2.0


def _matmul_rates(device: torch.device, dtype: torch.dtype, config: Config, bar,
                  sizes: dict[str, int] | None = None) -> dict[str, Any]:
    """The :class:`~subquad.compare.flops.Roof` of this machine's matmul in float32, and in the
    run's dtype when that differs (as ``run_dtype``; its rate None when even a 256 x 256 product
    would not fit), each measured within ``--max-call-seconds`` at the largest square size that fits
    (:func:`~subquad.compare.flops.bounded_matmul_rate`; at most ``sizes[key]``, an earlier
    measurement's), announced on ``bar``."""
    roofs = {}
    for key, dt in (("float32", torch.float32), ("run_dtype", dtype)):
        if key == "run_dtype" and dtype == torch.float32:
            break
        bar.set_postfix_str(f"this machine's {str(dt).removeprefix('torch.')} matmul rate")
        roofs[key] = flop_counts.bounded_matmul_rate(device, dt, max_seconds=config.max_call_seconds,
                                                     size=(sizes or {}).get(key),
                                                     min_run_time=2 * config.min_run_time)
    return roofs


def _roof_notes(config: Config, roofs: dict) -> list[str]:
    """What the run's dtype costs here: a note when its products are :data:`SLOW_DTYPE` times slower
    than float32's at the same size (no fast path on this device), and for each roof measured
    smaller than the default or not at all (``--max-call-seconds``)."""
    notes = []
    roof, base = roofs.get("run_dtype"), roofs["float32"]
    same = max(set(roof.probes) & set(base.probes), default=None) if roof is not None else None
    slower = roof.probes[same] / base.probes[same] if same else 0.0
    if slower >= SLOW_DTYPE:
        notes.append(f"{config.dtype} has no fast path on this {config.device}: a {same} x {same} matrix product "
                     f"takes {slower:.0f}x as long as in float32, so the {config.dtype} times here measure that "
                     "slow path (float32, or a device with fast float16/bfloat16, compares the methods' own work)")
    limit = f"within --max-call-seconds {config.max_call_seconds:g}"
    for key, r in roofs.items():
        name = config.dtype if key == "run_dtype" else key
        if r.rate is None:
            notes.append(f"no {name} matmul roof: even a {r.size} x {r.size} product would not be measured {limit}; "
                         "achieved fractions of it are left out")
        elif r.size < flop_counts.matmul_size(config.device):
            notes.append(f"the {name} matmul roof is a {r.size} x {r.size} product (a larger one would not be "
                         f"measured {limit})")
    return notes


def _recommendations(rows: list[dict[str, Any]], config: Config) -> tuple[list[dict], list[dict]]:
    """Per N, the budget table (the Pareto front as ranges of error budgets) and, with
    --max-error, the recommended method."""
    speedup = {"forward": "speedup_forward", "training": "speedup_forward_backward",
               "decode": "speedup_decode"}[config.objective]

    def summary(r):
        return {"method": r["method"], "seconds": r[OBJECTIVES[config.objective]],
                "rel_error": r["rel_error"], "speedup": r[speedup]}

    budgets, recommendations = [], []
    for n in sorted(config.ns):
        for entry in budget_table(rows, n, config.objective):
            budgets.append({"n": n, **summary(entry["row"]), "from_error": entry["from_error"],
                            "to_error": entry["to_error"]})
        if config.max_error is not None:
            best = recommend(rows, n, config.max_error, config.objective)
            recommendations.append({"n": n, "max_error": config.max_error, "objective": config.objective,
                                    **(summary(best) if best else {"method": None})})
    return budgets, recommendations


def _error_inputs(config: Config, real_errors: dict[str, Any] | None) -> dict[str, Any]:
    """The results' ``"error_inputs"``: what the error column was measured on, with its label."""
    if config.error_inputs == "iid":
        if real_errors is not None:
            raise ValueError("real_errors given, but config.error_inputs is 'iid'")
        return {"kind": "iid", "label": error_inputs_label(None), "seed": config.seed}
    if config.error_inputs != "real":
        raise ValueError(f"config.error_inputs must be 'real' or 'iid', not {config.error_inputs!r}")
    if real_errors is None or real_errors.get("kind") != "real":
        raise ValueError("config.error_inputs 'real' needs real_errors: the result of "
                         "subquad.compare.source_minilm.capture_errors(config)")
    return {**real_errors, "label": error_inputs_label(real_errors)}


def _real_error(errors: dict[str, Any], info, label: str) -> dict[str, Any] | None:
    """A row's entry in the real-input errors; None for i.i.d. errors and for token mixers."""
    if errors["kind"] != "real" or info.kind != "attention":
        return None
    return errors["errors"].get(label) or {"mean": None, "failure": "not measured on them"}


def _unmeasured_row(spec: tuple[str, Any, Any], n: int, gates: dict[str, dict[str, Any]]) -> dict | None:
    """A failed row without measurements for a method that failed the gate or options the method
    refuses (else None)."""
    label, info, options = spec
    gate = gates.get(info.name)
    if isinstance(options, Exception):
        row = _new_row(info, n, {}, label)
        row["status"], row["errors"]["options"] = "failed", _message(options)
        return row
    if gate is None or gate["status"] != "failed":
        return None
    row = _new_row(info, n, options, label)
    row["status"], row["errors"]["gate"] = "failed", str(gate["detail"])
    return row


#: the label suffix of a --compile row
COMPILED = " compiled"


def _measured_methods(config: Config) -> tuple[list, list[str]]:
    """The registry entries the run measures and a note for each one left out: with
    ``config.causal``, the attention methods that take ``causal=True``; with ``--objective decode``
    every method is measured (a row without a decoding form says so)."""
    infos = [subquad.get_method(m) for m in config.methods]
    if not config.causal:
        return infos, []
    kept = [i for i in infos if i.kind == "attention" and i.causal]
    return kept, [f"{i.name}: {'a token mixer' if i.kind != 'attention' else 'not causal'}; not measured with "
                  "--causal" for i in infos if i not in kept]


def _run_notes(config: Config) -> list[str]:
    """What the run's settings change in its numbers."""
    notes = []
    if config.causal:
        notes.append("causal attention: every method with causal=True, exact attention SDPA's causal kernel, the "
                     "error against causal exact attention")
    if config.compile:
        notes.append("each row beside its twin through torch.compile(fullgraph=True, dynamic=False) ('compiled'): "
                     "a compiled row's first call (compiling) is in its first-call column, not its time; stochastic "
                     "methods compiled draw from the global RNG")
    if config.busy:
        notes.append(f"{config.busy} busy neighbour process(es) spun on the CPU while the points were measured "
                     "(not during the matmul roofs or the memory subprocesses)")
    if config.objective == "decode":
        notes.append(f"decode: {config.decode_steps} single-token calls after a prefill of N tokens (and "
                     f"{WARMUP_TOKENS} untimed), the median per token; exact attention with its keys in buffers "
                     "allocated once")
    return notes


def run(config: Config, *, show_progress: bool = True, real_errors: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run the comparison: time, FLOPs and memory on i.i.d. N(0, 1) inputs at each N, the error
    on them too (``config.error_inputs == "iid"``) or ``real_errors`` (``"real"``: the result of
    :func:`subquad.compare.source_minilm.capture_errors` for this config). Returns the results
    document."""
    errors = _error_inputs(config, real_errors)
    device = torch.device(config.device)
    dtype = DTYPES[config.dtype]
    start = time.time()
    infos, skipped = _measured_methods(config)
    specs = comparison_rows(infos, config, 0)  # each method, and each --sweep row
    if config.compile:  # each row, then the same through torch.compile
        specs = [(f"{label}{suffix}", info, options) for label, info, options in specs for suffix in ("", COMPILED)]
    load_before = machine_load()
    rows: list[dict[str, Any]] = []
    history: dict[str, dict[int, dict[str, Any]]] = {label: {} for label, _, _ in specs}
    bar = progress_bar(len(config.ns) * len(specs), "subquad compare", show_progress)  # shown before any work
    try:
        roofs = _matmul_rates(device, dtype, config, bar)
        notes = skipped + _roof_notes(config, roofs) + _run_notes(config)
        for note in notes:  # up front, before the points
            bar.write(f"subquad compare: {note}", file=sys.stderr)
        gates = verdicts([i.name for i in infos], config.gate, bar)
        with BusyNeighbours(config.busy):
            for n, q, k, v, reference in random_inputs(config, dtype, device, bar, reference=errors["kind"] == "iid"):
                at_n, timed = [], []
                for spec in specs:
                    label, info, _ = spec
                    timed.append({})
                    row = _unmeasured_row(spec, n, gates) or _measure_point(
                        spec, n, q, k, v, reference, config, history[label], bar,
                        real_error=_real_error(errors, info, label.removesuffix(COMPILED)),
                        compiled=label.endswith(COMPILED), timed=timed[-1])
                    if gates.get(info.name, {}).get("status") == "untested":
                        row["notes"].append(f"not gated: {gates[info.name]['detail']}")
                    history[label][n] = row
                    at_n.append(row)
                    bar.update(1)
                if config.rounds > 1:
                    _more_rounds(at_n, timed, config.rounds, config.min_run_time, bar)
                rows += at_n
                del reference, timed
        # the roof again after the points, at the same sizes: one measured while something else ran
        # reads low, and every achieved rate would then read high against it
        again = _matmul_rates(device, dtype, config, bar, sizes={k: r.size for k, r in roofs.items() if r.rate})
        rates = {k: None if r.rate is None else max(r.rate, again[k].rate or 0.0) if again[k].size == r.size
                 else r.rate for k, r in roofs.items()}
    finally:
        bar.close()
    _derived(rows, rates)
    budgets, recommendations = _recommendations(rows, config)
    return {
        "kind": "compare",
        "config": asdict(config),
        "machine": {**machine_info(device), "matmul_flops_per_s": rates,
                    "matmul_size": {key: roof.size for key, roof in roofs.items()},
                    "load": {"before": load_before, "after": machine_load()}},
        "error_inputs": errors,
        "gate": gates,
        "rows": rows,
        "budgets": budgets,
        "recommendations": recommendations,
        "notes": notes,
        "seconds": time.time() - start + errors.get("seconds", 0.0),  # with the real inputs' capture
    }


def _plot(res: dict[str, Any], out: Path) -> list[Path]:
    from .plots import plot_compare  # matplotlib, only when plotting

    return plot_compare(res, out)


#: the console leaderboard, report.md and the plots of a ``"compare"`` document
RENDERER = register_renderer(Renderer("compare", summary=leaderboard_text, markdown=markdown_compare, plot=_plot))


def write(results: dict[str, Any], out: Path | str, *, plots: bool = True,
          log: Callable[[str], None] = print) -> list[Path]:
    """results.json, report.md and the plots under ``out``; returns the files written."""
    return write_report(results, Path(out), renderer=RENDERER, plots=plots, log=log)
