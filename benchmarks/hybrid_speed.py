"""hybrid against the best dense kernel on this machine: forward (non-causal and causal), forward +
backward, with one busy neighbour, peak memory, and the compiled kernel's cold start.

    python benchmarks/hybrid_speed.py --out benchmarks/results            # the committed table
    python benchmarks/hybrid_speed.py --n 512 1024 --backward-n 512 --busy-n 512 --memory-n 1024 \\
        --rounds 1 --out /tmp/hs                                          # smoke run

B=1, H=8, D=64, float32, i.i.d. N(0, 1) inputs, default options, torch's threads. Dense kernels:
SDPA and a plain blocked ``softmax(q k^T) v`` (1024 queries at a time, fp32 matmuls), the faster
per N is "best dense". Every time is the median over ``--rounds`` rounds, the calls of a round
interleaved (each call of a round: the median of repeated calls for at least 0.2 s, or one call
when that is longer). Forward + backward: ``(out * w).sum().backward()`` with gradients for q, k
and v (hybrid runs its torch path there). Busy: one process spinning on a core during the busy
half of each round (``busy_cores.py``). Peak memory: the growth of the peak resident set of a
fresh process over one call, after a warm-up call at N = 512. Cold start: a fresh process's
first hybrid call at N = 4096 with an empty numba cache (compiles) and with a filled one.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from busy_cores import Neighbour
from subquad.ops.hybrid import hybrid_attention


def blocked(q, k, v, causal=False, block: int = 1024):
    """Exact attention, ``block`` queries at a time (plain matmuls and softmax)."""
    s = q.shape[-1] ** -0.5
    outs = []
    for i in range(0, q.shape[2], block):
        logits = q[:, :, i: i + block] @ k.mT * s
        if causal:
            rows = torch.arange(i, min(i + block, q.shape[2]))[:, None]
            logits = logits.masked_fill(torch.arange(k.shape[2]) > rows, -torch.inf)
        outs.append(torch.softmax(logits, -1) @ v)
    return torch.cat(outs, 2)


KERNELS = {
    "hybrid": lambda q, k, v, causal: hybrid_attention(q, k, v, causal=causal),
    "sdpa": lambda q, k, v, causal: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
    "blocked": blocked,
}


def inputs(n: int, grad: bool = False):
    g = torch.Generator().manual_seed(n)
    return [torch.randn(1, 8, n, 64, generator=g).requires_grad_(grad) for _ in range(3)]


def seconds(fn) -> float:
    """Median of repeated calls for at least 0.2 s (one call when it takes longer)."""
    times: list[float] = []
    while not times or (sum(times) < 0.2 and len(times) < 50):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _call(name: str, n: int, causal: bool, backward: bool):
    q, k, v = inputs(n, backward)
    w = torch.randn(1, 8, n, 64)
    if not backward:
        def run():
            with torch.no_grad():
                KERNELS[name](q, k, v, causal)
        return run

    def run_backward():
        (KERNELS[name](q, k, v, causal) * w).sum().backward()
    return run_backward


def measure(points: list[tuple], rounds: int, busy: bool) -> dict[tuple, dict[str, float]]:
    """Median seconds of each point ``(name, n, causal, backward)``, quiet (and busy), rounds
    interleaved."""
    calls = {pt: _call(*pt) for pt in points}
    for fn in calls.values():
        fn()  # warm-up: the kernel's compile or cache load, first-touch memory
    states = ("quiet", "busy") if busy else ("quiet",)
    times = {pt: {s: [] for s in states} for pt in points}
    for r in range(rounds):
        for state in states:
            with Neighbour() if state == "busy" else contextlib.nullcontext():
                for pt, fn in calls.items():
                    times[pt][state].append(seconds(fn))
        print(f"  round {r + 1}/{rounds} done", flush=True)
    return {pt: {s: statistics.median(ts) for s, ts in t.items()} for pt, t in times.items()}


def _high_water_mib() -> float:
    """This process's peak resident set (``VmHWM``; ``ru_maxrss`` would start from the parent's
    peak, which Linux keeps across ``execve``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _peak(name: str, n: int, causal: bool, queue) -> None:
    _call(name, 512, causal, False)()
    before = _high_water_mib()
    _call(name, n, causal, False)()
    queue.put(_high_water_mib() - before)


def peak_mib(name: str, n: int, causal: bool = False) -> float:
    """Growth of the peak RSS (MiB) of a fresh process over one forward call at ``n`` (inputs
    included)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_peak, args=(name, n, causal, queue))
    proc.start()
    value = queue.get()
    proc.join()
    return value


def cold_start() -> dict[str, float]:
    """Seconds of a fresh process's first hybrid call (N = 4096), numba cache empty and filled, and
    of the same process's second call (the work itself: the first call's excess is the compile, or
    the cache's load with numba's and scipy's imports)."""
    code = ("import time, torch; from subquad.ops.hybrid import hybrid_attention; q = torch.randn(1, 8, 4096, 64)\n"
            "for _ in range(2):\n t = time.perf_counter(); hybrid_attention(q, q, q); print(time.perf_counter() - t)")
    out = {}
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "NUMBA_CACHE_DIR": cache}
        for label in ("empty_cache", "filled_cache"):
            done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
            first, second = (float(x) for x in done.stdout.split()[-2:])
            out[f"first_call_{label}_s"], out[f"second_call_{label}_s"] = first, second
    return out


def forward_rows(ns: list[int], dense_max: int, blocked_max: int, rounds: int) -> list[dict]:
    rows = []
    for n in ns:
        names = ["hybrid"] + (["sdpa"] if n <= dense_max else []) + (["blocked"] if n <= blocked_max else [])
        print(f"forward N={n}: {', '.join(names)}", flush=True)
        t = measure([(name, n, causal, False) for name in names for causal in (False, True)], rounds, False)
        row = {"n": n}
        for (name, _, causal, _), s in t.items():
            row[f"{name}{'_causal' if causal else ''}_s"] = s["quiet"]
        rows.append(row)
        print(" ", row, flush=True)
    return rows


def backward_rows(ns: list[int], blocked_max: int, rounds: int) -> list[dict]:
    rows = []
    for n in ns:
        names = [name for name in KERNELS if name != "blocked" or n <= blocked_max]
        print(f"forward+backward N={n}: {', '.join(names)}", flush=True)
        t = measure([(name, n, False, True) for name in names], rounds, False)
        rows.append({"n": n, **{f"{name}_s": t[name, n, False, True]["quiet"] for name in names}})
        print(" ", rows[-1], flush=True)
    return rows


def busy_rows(ns: list[int], rounds: int) -> list[dict]:
    rows = []
    for n in ns:
        print(f"busy N={n}", flush=True)
        t = measure([(name, n, False, False) for name in ("hybrid", "sdpa")], rounds, True)
        rows.append({"n": n, **{f"{name}_{s}_s": t[name, n, False, False][s] for name in ("hybrid", "sdpa")
                                for s in ("quiet", "busy")}})
        print(" ", rows[-1], flush=True)
    return rows


def _best(row: dict, suffix: str = "") -> float | None:
    dense = [row[key] for key in (f"sdpa{suffix}_s", f"blocked{suffix}_s") if key in row]
    return min(dense) if dense else None


def _cell(x: float | None, fmt: str = "{:.3f}") -> str:
    return "not run" if x is None else fmt.format(x)


def markdown(res: dict) -> str:
    m = res["meta"]
    out = ["# hybrid against the best dense kernel", "",
           f"B=1, H=8, D=64, float32, i.i.d. inputs, default options (budget 64), {m['threads']} torch threads, "
           f"{m['machine']}, torch {m['torch']}, numba {m['numba']}, {m['date']}. Medians of {m['rounds']} rounds, "
           f"calls interleaved within each N. Command: `{m['command']}`. {m['note']}", "",
           "## Forward (no grad), seconds", "",
           "| N | hybrid | SDPA | blocked | best dense / hybrid | hybrid causal | SDPA causal | blocked causal | "
           "best dense / hybrid, causal | hybrid causal / non-causal |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["forward"]:
        best, best_c = _best(r), _best(r, "_causal")
        ratio = _cell(best and best / r["hybrid_s"], "{:.2f}x")
        ratio_c = _cell(best_c and best_c / r["hybrid_causal_s"], "{:.2f}x")
        out.append(f"| {r['n']} | {r['hybrid_s']:.3f} | {_cell(r.get('sdpa_s'))} | {_cell(r.get('blocked_s'))} | "
                   f"{ratio} | {r['hybrid_causal_s']:.3f} | {_cell(r.get('sdpa_causal_s'))} | "
                   f"{_cell(r.get('blocked_causal_s'))} | {ratio_c} | {r['hybrid_causal_s'] / r['hybrid_s']:.2f} |")
    out += ["", "## Forward + backward, seconds", "", "| N | hybrid | SDPA | blocked | best dense / hybrid |",
            "|---|---|---|---|---|"]
    out += [f"| {r['n']} | {r['hybrid_s']:.3f} | {r['sdpa_s']:.3f} | {_cell(r.get('blocked_s'))} | "
            f"{_best(r) / r['hybrid_s']:.2f}x |" for r in res["backward"]]
    out += ["", "## One busy neighbour (forward), seconds", "",
            "| N | hybrid quiet | hybrid busy | busy / quiet | SDPA quiet | SDPA busy | busy / quiet | "
            "hybrid's slow-down / SDPA's |", "|---|---|---|---|---|---|---|---|"]
    for r in res["busy"]:
        h, s = r["hybrid_busy_s"] / r["hybrid_quiet_s"], r["sdpa_busy_s"] / r["sdpa_quiet_s"]
        out.append(f"| {r['n']} | {r['hybrid_quiet_s']:.3f} | {r['hybrid_busy_s']:.3f} | {h:.2f}x | "
                   f"{r['sdpa_quiet_s']:.3f} | {r['sdpa_busy_s']:.3f} | {s:.2f}x | {h / s:.2f} |")
    out += ["", "## Peak memory of one forward call (MiB, growth of the peak RSS, inputs included)", "",
            "| N | hybrid | SDPA |", "|---|---|---|"]
    out += [f"| {r['n']} | {r['hybrid_mib']:.0f} | {r['sdpa_mib']:.0f} |" for r in res["memory"]]
    c = res["cold_start"]
    out += ["", f"Cold start (a fresh process's first hybrid call at N = 4096, which compiles or loads the kernel): "
            f"{c['first_call_empty_cache_s']:.1f} s with an empty numba cache, "
            f"{c['first_call_filled_cache_s']:.2f} s with a filled one, where the process's second call took "
            f"{c['second_call_filled_cache_s']:.2f} s (the first call's excess, "
            f"{c['first_call_filled_cache_s'] - c['second_call_filled_cache_s']:.2f} s, is the cache's load with "
            "numba's and scipy's imports)."]
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384, 32768, 65536])
    ap.add_argument("--dense-max", type=int, default=65536, help="largest N for SDPA")
    ap.add_argument("--blocked-max", type=int, default=8192, help="largest N for the blocked kernel (it is 4x "
                    "slower than SDPA at 16k here)")
    ap.add_argument("--backward-n", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--busy-n", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--memory-n", type=int, nargs="+", default=[16384, 65536])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--note", default="")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    import numba

    res = {"forward": forward_rows(args.n, args.dense_max, args.blocked_max, args.rounds),
           "backward": backward_rows(args.backward_n, args.blocked_max, args.rounds),
           "busy": busy_rows(args.busy_n, args.rounds),
           "memory": [{"n": n, "hybrid_mib": peak_mib("hybrid", n), "sdpa_mib": peak_mib("sdpa", n)}
                      for n in args.memory_n],
           "cold_start": cold_start()}
    res["meta"] = {"threads": torch.get_num_threads(), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
                   "torch": torch.__version__, "numba": numba.__version__, "date": time.strftime("%Y-%m-%d"),
                   "rounds": args.rounds, "note": args.note,
                   "command": "python benchmarks/hybrid_speed.py " + " ".join(sys.argv[1:])}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "hybrid_speed.json").write_text(json.dumps(res, indent=1))
    (args.out / "hybrid_speed.md").write_text(markdown(res))
    print(markdown(res))


if __name__ == "__main__":
    main()
