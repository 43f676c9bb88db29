"""``subquad compare``: every registered method against exact attention on one workload.

For each length N and method: forward and forward+backward time (median of
``torch.utils.benchmark``), peak memory (a fresh process per point on CPU), relative error to
exact attention computed in float64, speed-up over exact attention, and the achieved matmul
rate against this machine's. A method that raises at some stage is reported with its error;
the run goes on.
"""

from __future__ import annotations

import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

import subquad

from . import flops as flop_counts
from .fidelity import exact_reference, relative_error
from .memory import measure, measure_in_subprocess
from .recommend import OBJECTIVES, budget_table, recommend
from .timing import median_time
from .workload import DTYPES, forward_backward_call, forward_call, full_options, make_qkv, mixer_module

__all__ = ["Config", "run", "progress_bar", "machine_info"]

# a forward+backward is assumed to cost this many forwards before one has been measured
_BACKWARD_FACTOR = 3.0


@dataclass
class Config:
    """One comparison run (the parsed command line)."""

    ns: list[int] = field(default_factory=lambda: [1024, 4096, 16384])
    batch: int = 1
    heads: int = 8
    dim: int = 64
    methods: list[str] = field(default_factory=list)
    options: dict[str, dict[str, Any]] = field(default_factory=dict)
    device: str = "cpu"
    dtype: str = "float32"
    min_run_time: float = 0.3
    max_call_seconds: float = 20.0
    memory: bool = True
    backward: bool = True
    seed: int = 0
    max_error: float | None = None
    objective: str = "forward"
    source: str = "random"
    text: str | None = None
    peers: bool = False
    out: str | None = None
    command: str = ""


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(device: torch.device) -> dict[str, Any]:
    info = {"device": str(device), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "python": platform.python_version(), "platform": platform.platform(terse=True),
            "cpu": _cpu_name()}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


class _Lines:
    """A stand-in for tqdm when it is not installed: one line per point on stderr."""

    def __init__(self, total: int, desc: str):
        self.total, self.done, self.desc = total, 0, desc

    def set_postfix_str(self, text: str) -> None:
        print(f"[{self.done + 1}/{self.total}] {text}", file=sys.stderr, flush=True)

    def update(self, k: int = 1) -> None:
        self.done += k

    def write(self, text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        pass


def progress_bar(total: int, desc: str, enabled: bool = True):
    """A tqdm bar on stderr (the ``bench`` extra), or plain lines without tqdm."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _Lines(total, desc)
    return tqdm(total=total, desc=desc, unit="point", disable=not enabled, file=sys.stderr,
                dynamic_ncols=True)


def _message(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    return text if len(text) <= 300 else text[:297] + "..."


def _growth(info, n: int, n_prev: int) -> float:
    ratio = n / n_prev
    return ratio * ratio if info.complexity == "quadratic" else ratio


def _predict(history: dict[int, dict[str, Any]], info, n: int, key: str) -> tuple[float, int] | None:
    """Seconds predicted for ``key`` at ``n`` from the largest smaller length measured, with the
    method's complexity (N or N^2), and that length."""
    known = [m for m, r in history.items() if m < n and r.get(key) is not None]
    if not known:
        return None
    m = max(known)
    return history[m][key] * _growth(info, n, m), m


def _measure_point(info, n: int, q, k, v, reference, config: Config, history, bar) -> dict[str, Any]:
    """Every measurement of one (method, N) point."""
    user_options = config.options.get(info.name, {})
    row: dict[str, Any] = {
        "n": n, "method": info.name, "kind": info.kind, "complexity": info.complexity,
        "stochastic": info.stochastic, "options": user_options, "status": "ok", "errors": {}, "notes": [],
        "forward_s": None, "forward_runs": None, "forward_backward_s": None, "forward_backward_runs": None,
        "forward_bytes": None, "forward_backward_bytes": None, "rel_error": None,
        "flops": None, "flops_source": None,
    }
    label = f"N={n} {info.name}"
    cap = config.max_call_seconds

    predicted = _predict(history, info, n, "forward_s")
    if predicted is not None and predicted[0] > cap:
        row["status"] = "skipped"
        row["notes"].append(
            f"skipped: a forward would take about {predicted[0]:.0f} s ({info.complexity} growth from "
            f"N={predicted[1]}), over --max-call-seconds {cap:g}")
        return row

    module = None
    try:
        options = full_options(info, user_options)
        if info.kind == "mixer":
            module = mixer_module(info, config.heads, config.dim, user_options, dtype=q.dtype,
                                  device=q.device)
        fwd = forward_call(info, q, k, v, user_options, seed=config.seed, module=module)
        holder: list = [None]

        def keep_output():
            holder[0] = fwd()

        bar.set_postfix_str(f"{label}: forward")
        with torch.no_grad():
            timing = median_time(keep_output, config.min_run_time)
        row["forward_s"], row["forward_runs"] = timing.seconds, timing.runs
    except Exception as e:  # noqa: BLE001 (a failing method is reported, not fatal)
        row["status"] = "failed"
        row["errors"]["forward"] = _message(e)
        return row

    if info.kind == "attention":
        try:
            row["rel_error"] = relative_error(holder[0], reference)
        except Exception as e:  # noqa: BLE001
            row["errors"]["error"] = _message(e)
    else:
        row["notes"].append("token mixer on x (B, N, H*D): no error against attention; its time "
                            "includes its own input and output projections")
    holder[0] = None

    formula = None
    if info.kind == "attention":
        formula = flop_counts.forward_flops(info.name, q.shape[0], q.shape[1], n, k.shape[2], q.shape[3],
                                            v.shape[3], options)
    if formula is not None:
        row["flops"], row["flops_source"] = formula, "formula"
    else:
        try:
            bar.set_postfix_str(f"{label}: counting FLOPs")
            with torch.no_grad():
                row["flops"], row["flops_source"] = flop_counts.counted_flops(fwd), "counted"
        except Exception as e:  # noqa: BLE001
            row["errors"]["flops"] = _message(e)

    do_backward = config.backward
    if do_backward:
        predicted = _predict(history, info, n, "forward_backward_s")
        guess = predicted[0] if predicted else _BACKWARD_FACTOR * row["forward_s"]
        if guess > cap:
            do_backward = False
            row["status"] = "partial"
            row["notes"].append(f"forward+backward skipped: it would take about {guess:.0f} s, over "
                                f"--max-call-seconds {cap:g}")
    if do_backward:
        try:
            bar.set_postfix_str(f"{label}: forward+backward")
            step = forward_backward_call(info, q, k, v, user_options, seed=config.seed, module=module)
            timing = median_time(step, config.min_run_time)
            row["forward_backward_s"], row["forward_backward_runs"] = timing.seconds, timing.runs
        except Exception as e:  # noqa: BLE001
            do_backward = False
            row["errors"]["forward_backward"] = _message(e)

    if config.memory:
        bar.set_postfix_str(f"{label}: peak memory")
        spec = {"method": info.name, "options": user_options, "batch": config.batch, "heads": config.heads,
                "n": n, "dim": config.dim, "dtype": config.dtype, "device": config.device,
                "seed": config.seed, "backward": do_backward, "threads": torch.get_num_threads()}
        if q.device.type == "cpu":
            budget = 120 + 10 * (row["forward_s"] + (row["forward_backward_s"] or 0.0))
            mem = measure_in_subprocess(spec, timeout=budget)
        else:
            mem = measure(spec)
        row["forward_bytes"] = mem.get("forward_bytes")
        row["forward_backward_bytes"] = mem.get("forward_backward_bytes")
        for stage in ("forward", "backward"):
            if mem.get(f"{stage}_error"):
                row["errors"][f"memory_{stage}"] = mem[f"{stage}_error"]
    if row["errors"]:
        row["status"] = "partial"
    return row


def _derived(rows: list[dict[str, Any]], rates: dict[str, float]) -> None:
    """Speed-ups over exact attention at the same N and the achieved FLOP rate."""
    exact = {r["n"]: r for r in rows if r["method"] == "softmax"}
    roof = rates.get("run_dtype") or rates.get("float32")
    for r in rows:
        base = exact.get(r["n"])
        pairs = (("forward_s", "speedup_forward"), ("forward_backward_s", "speedup_forward_backward"))
        for key, out in pairs:
            ok = base is not None and base.get(key) and r.get(key)
            r[out] = base[key] / r[key] if ok else None
        ok = r.get("flops") and r.get("forward_s")
        r["gflops"] = r["flops"] / r["forward_s"] / 1e9 if ok else None
        r["matmul_fraction"] = r["flops"] / r["forward_s"] / roof if ok and roof else None


def run(config: Config, *, show_progress: bool = True) -> dict[str, Any]:
    """Run the comparison on i.i.d. N(0, 1) inputs; returns the results document."""
    device = torch.device(config.device)
    dtype = DTYPES[config.dtype]
    start = time.time()
    infos = [subquad.get_method(m) for m in config.methods]
    notes: list[str] = []

    roof_time = 2 * config.min_run_time
    rates = {"float32": flop_counts.matmul_rate(device, torch.float32, min_run_time=roof_time)}
    if dtype != torch.float32:
        rates["run_dtype"] = flop_counts.matmul_rate(device, dtype, min_run_time=roof_time)

    rows: list[dict[str, Any]] = []
    history: dict[str, dict[int, dict[str, Any]]] = {i.name: {} for i in infos}
    bar = progress_bar(len(config.ns) * len(infos), "subquad compare", show_progress)
    try:
        for n in sorted(config.ns):
            q, k, v = make_qkv(config.batch, config.heads, n, config.dim, dtype=dtype, device=device,
                               seed=config.seed + n)
            bar.set_postfix_str(f"N={n}: exact float64 reference")
            reference = exact_reference(q, k, v)
            for info in infos:
                row = _measure_point(info, n, q, k, v, reference, config, history[info.name], bar)
                history[info.name][n] = row
                rows.append(row)
                bar.update(1)
            del reference
    finally:
        bar.close()
    _derived(rows, rates)

    speedup = "speedup_forward" if config.objective == "forward" else "speedup_forward_backward"

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
    return {
        "kind": "compare",
        "config": asdict(config),
        "machine": {**machine_info(device), "matmul_flops_per_s": rates},
        "rows": rows,
        "budgets": budgets,
        "recommendations": recommendations,
        "notes": notes,
        "seconds": time.time() - start,
    }


def write(results: dict[str, Any], out: Path | str, *, plots: bool = True,
          log: Callable[[str], None] = print) -> list[Path]:
    """results.json, report.md and the plots under ``out``; returns the files written."""
    from .report import write_report

    return write_report(results, Path(out), plots=plots, log=log)
