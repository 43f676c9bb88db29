"""Forward time with the machine quiet and with one busy neighbour, in the same run.

    python benchmarks/busy_cores.py --out benchmarks/results          # N = 4096, 5 rounds
    python benchmarks/busy_cores.py --n 512 --rounds 1 --out /tmp/bc   # smoke run

B=1, H=8, D=64, float32, forward without grad, torch's default threads, each method with its
registry defaults (as ``benchmarks/results/speed.md``). The neighbour is a separate process that
spins on the CPU (a pure-Python loop: what a data loader or a second job does to a core); it is
started for the busy half of every round and stopped for the quiet half, so quiet and busy
alternate. A time is the median over rounds of ``torch.utils.benchmark`` medians
(``subquad.compare.timing.median_time``).

Columns: quiet and busy milliseconds, busy / quiet (how much the neighbour slows the method),
that slow-down relative to SDPA's, and the speed-up over SDPA when busy.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import subquad
from subquad.compare.timing import median_time


def _spin(stop) -> None:
    x = 0
    while not stop.is_set():
        for _ in range(100_000):
            x += 1


class Neighbour:
    """``with Neighbour():`` one process spinning on the CPU for the duration of the block."""

    def __enter__(self):
        ctx = mp.get_context("spawn")
        self.stop = ctx.Event()
        self.proc = ctx.Process(target=_spin, args=(self.stop,), daemon=True)
        self.proc.start()
        time.sleep(0.5)  # let it start spinning
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.proc.join(5)


def methods() -> list[str]:
    """Every linear-cost attention method of the registry."""
    return [m.name for m in subquad.list_methods() if m.kind == "attention" and m.complexity == "linear"]


def measure(n: int, rounds: int, min_run_time: float) -> dict[str, dict[str, list[float]]]:
    g = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(1, 8, n, 64, generator=g) for _ in range(3))
    calls = {"sdpa": lambda: F.scaled_dot_product_attention(q, k, v)}
    calls.update({m: (lambda m=m: subquad.attention(q, k, v, method=m)) for m in methods()})
    times: dict[str, dict[str, list[float]]] = {name: {"quiet": [], "busy": []} for name in calls}
    with torch.no_grad():
        for r in range(rounds):
            for state in ("quiet", "busy"):
                with Neighbour() if state == "busy" else contextlib.nullcontext():
                    for name, fn in calls.items():
                        times[name][state].append(median_time(fn, min_run_time).seconds)
            done = [f"{name} {t['quiet'][-1] * 1e3:.1f}/{t['busy'][-1] * 1e3:.1f} ms" for name, t in times.items()]
            print(f"round {r + 1}/{rounds} (quiet/busy): " + ", ".join(done), flush=True)
    return times


def table(times: dict[str, dict[str, list[float]]]) -> list[dict]:
    med = {name: {s: statistics.median(ts) for s, ts in t.items()} for name, t in times.items()}
    sdpa = med["sdpa"]
    rows = []
    for name, m in med.items():
        slow = m["busy"] / m["quiet"]
        rows.append({"method": name, "quiet_ms": m["quiet"] * 1e3, "busy_ms": m["busy"] * 1e3, "busy_over_quiet": slow,
                     "slowdown_vs_sdpa": slow / (sdpa["busy"] / sdpa["quiet"]),
                     "speedup_over_sdpa_busy": sdpa["busy"] / m["busy"]})
    return rows


def markdown(rows: list[dict], meta: dict) -> str:
    out = ["# Quiet and with one busy neighbour", "",
           f"N = {meta['n']}, B=1, H=8, D=64, float32, forward without grad, {meta['threads']} torch threads, "
           f"registry defaults; neighbour: one process spinning on the CPU. Median over {meta['rounds']} rounds, "
           f"quiet and busy alternating. {meta['machine']}, torch {meta['torch']}, {meta['date']}. "
           f"Command: `{meta['command']}`", "",
           "| method | quiet ms | busy ms | busy / quiet | slow-down relative to SDPA's | speed-up over SDPA, busy |",
           "|---|---|---|---|---|---|"]
    out += [f"| {r['method']} | {r['quiet_ms']:.1f} | {r['busy_ms']:.1f} | {r['busy_over_quiet']:.2f}x | "
            f"{r['slowdown_vs_sdpa']:.2f}x | {r['speedup_over_sdpa_busy']:.1f}x |" for r in rows]
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--min-run-time", type=float, default=0.5)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    start = time.time()
    rows = table(measure(args.n, args.rounds, args.min_run_time))
    meta = {"n": args.n, "rounds": args.rounds, "threads": torch.get_num_threads(),
            "machine": f"{platform.machine()}, {torch.get_num_threads()} threads", "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d"), "seconds": round(time.time() - start),
            "command": f"python benchmarks/busy_cores.py --n {args.n} --rounds {args.rounds} --out {args.out}"}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "busy_cores.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (args.out / "busy_cores.md").write_text(markdown(rows, meta))
    print(markdown(rows, meta))


if __name__ == "__main__":
    main()
