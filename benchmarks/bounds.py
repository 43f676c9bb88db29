"""What bounds each linear-cost method on this CPU, and what a given speed-up over exact attention
would need.

    python benchmarks/bounds.py --out benchmarks/results             # N = 16384, 5 rounds, 50x
    python benchmarks/bounds.py --n 1024 --rounds 1 --out /tmp/bd     # smoke run

B=1, H=8, D=64, float32, i.i.d. N(0, 1) inputs, forward without grad, torch's default threads,
registry defaults. Every round times, in one process: the machine's roofs (a 2048 x 2048 matmul; a
batched ``(8, N, 64) @ (8, 64, 64)`` product, the shape most linear-cost methods' products have;
a copy of 256 MiB into a preallocated tensor), exact attention (``scaled_dot_product_attention``)
and every method. A time is the median over rounds of ``torch.utils.benchmark`` medians
(``subquad.compare.timing.median_time``); a speed-up is the median of the per-round ratios.

Work is the matrix-multiply FLOPs of each method's registry formula (``subquad.compare.flops``; exact
attention: ``4 N^2 D`` per head). Bytes are the compulsory traffic: reading q, k, v and writing the
output once. A speed-up ``S`` over exact attention needs the method to run its FLOPs at
``S * F / T_exact`` FLOP/s; where that exceeds both product rates, ``S`` is out of reach at this method's
FLOP count on this machine, however its kernels are written.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import subquad
from subquad.compare.flops import forward_flops
from subquad.compare.timing import median_time


def methods() -> list[str]:
    """Every linear-cost attention method of the registry."""
    return [m.name for m in subquad.list_methods() if m.kind == "attention" and m.complexity == "linear"]


def method_flops(name: str, n: int) -> int:
    info = next(m for m in subquad.list_methods() if m.name == name)
    defaults = {f.name: f.default for f in dataclasses.fields(info.options)}
    return forward_flops(name, 1, 8, n, n, 64, 64, defaults)


def roofs(n: int) -> dict:
    """Calls timing this machine's roofs, with the work of one call: (call, FLOPs or bytes)."""
    a = torch.randn(2048, 2048)
    x, w = torch.randn(8, n, 64), torch.randn(8, 64, 64)
    out = torch.empty(8, n, 64)
    src = torch.randn(64 << 20)
    dst = torch.empty_like(src)
    return {"matmul 2048^3": (lambda: a @ a, 2 * 2048**3),
            f"(8, {n}, 64) @ (8, 64, 64)": (lambda: torch.bmm(x, w, out=out), 2 * 8 * n * 64 * 64),
            "copy 256 MiB": (lambda: dst.copy_(src), 2 * src.numel() * 4)}


def measure(n: int, names: list[str], rounds: int, min_run_time: float) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(1, 8, n, 64, generator=g) for _ in range(3))
    calls = {"sdpa": lambda: F.scaled_dot_product_attention(q, k, v)}
    calls.update({m: (lambda m=m: subquad.attention(q, k, v, method=m)) for m in names})
    roof_calls = roofs(n)
    times = {name: [] for name in [*roof_calls, *calls]}
    with torch.no_grad():
        for r in range(rounds):
            for name, (fn, _) in roof_calls.items():
                times[name].append(median_time(fn, min_run_time).fastest)  # a roof: the best block
            for name, fn in calls.items():
                times[name].append(median_time(fn, min_run_time).seconds)
            print(f"round {r + 1}/{rounds}: " + ", ".join(f"{k} {t[-1] * 1e3:.1f} ms" for k, t in times.items()),
                  flush=True)
    return times, {name: work for name, (_, work) in roof_calls.items()}


def table(times: dict, roof_work: dict, n: int, target: float) -> tuple[dict, list[dict]]:
    roof = {name: statistics.median(w / t for t in times[name]) for name, w in roof_work.items()}
    matmul, skinny = (roof[name] for name in list(roof_work)[:2])
    sdpa = times["sdpa"]
    t_sdpa = statistics.median(sdpa)
    compulsory = 4 * 8 * n * 64 * 4  # q, k, v read and the output written once, float32
    rows = []
    for name in times:
        if name in roof_work:
            continue
        flop = 4 * 8 * n * n * 64 if name == "sdpa" else method_flops(name, n)
        t = statistics.median(times[name])
        need = target * flop / t_sdpa
        if need > max(matmul, skinny):
            bound = f"out of reach: {target:g}x needs more than either product rate"
        elif need > min(matmul, skinny):
            bound = f"{target:g}x needs more than the slower product rate"
        else:
            bound = f"{target:g}x within both product rates"
        rows.append({"method": name, "ms": t * 1e3, "gflop": flop / 1e9,
                     "speedup": statistics.median(s / m for s, m in zip(sdpa, times[name])),
                     "gflops": flop / t / 1e9, "pct_matmul": 100 * flop / t / matmul,
                     "gbs": compulsory / t / 1e9, "need_gflops": need / 1e9,
                     "ceiling_matmul": t_sdpa * matmul / flop, "ceiling_skinny": t_sdpa * skinny / flop,
                     "bound": "-" if name == "sdpa" else bound})
    return {k: v / 1e9 for k, v in roof.items()}, rows


def markdown(roof: dict, rows: list[dict], meta: dict) -> str:
    names = list(roof)
    out = ["# What bounds each method", "",
           f"N = {meta['n']}, B=1, H=8, D=64, float32, forward without grad, {meta['threads']} torch threads, "
           f"registry defaults, i.i.d. N(0, 1) inputs. Median over {meta['rounds']} interleaved rounds. "
           f"{meta['machine']}, torch {meta['torch']}, {meta['date']}, {meta['seconds']} s. "
           f"Command: `{meta['command']}`", "",
           f"Roofs measured in the same run: {names[0]} at {roof[names[0]]:.0f} GFLOP/s, {names[1]} at "
           f"{roof[names[1]]:.0f} GFLOP/s, {names[2]} at {roof[names[2]]:.1f} GB/s (read + write).", "",
           f"| method | ms | speed-up over SDPA | GFLOP | GFLOP/s (% of the matmul rate) | GB/s, compulsory | "
           f"{meta['target']:g}x needs GFLOP/s | ceiling at the {names[0]} rate | ceiling at the {names[1]} rate | "
           "verdict |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    out += [f"| {r['method']} | {r['ms']:.1f} | {r['speedup']:.1f}x | {r['gflop']:.2f} | {r['gflops']:.0f} "
            f"({r['pct_matmul']:.0f}%) | {r['gbs']:.1f} | {r['need_gflops']:.0f} | {r['ceiling_matmul']:.0f}x | "
            f"{r['ceiling_skinny']:.0f}x | {r['bound']} |" for r in rows]
    out += ["", "Ceilings: the speed-up over SDPA (its time in this run) if the method ran all its FLOPs at the "
            "product rate, ignoring every non-matmul pass. Compulsory bytes (q, k, v in, output out) move at a small "
            "fraction of the copy roof for every method: none is bound by them; the passes over each "
            "method's own intermediates are part of what separates its GFLOP/s from the roofs."]
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--target", type=float, default=50.0, help="speed-up over SDPA to test (default 50)")
    ap.add_argument("--methods", nargs="+", default=None)
    ap.add_argument("--min-run-time", type=float, default=0.5)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    start = time.time()
    times, roof_work = measure(args.n, args.methods or methods(), args.rounds, args.min_run_time)
    roof, rows = table(times, roof_work, args.n, args.target)
    meta = {"n": args.n, "rounds": args.rounds, "target": args.target, "threads": torch.get_num_threads(),
            "machine": f"{platform.machine()}, {torch.get_num_threads()} threads", "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d"), "seconds": round(time.time() - start),
            "command": f"python benchmarks/bounds.py --n {args.n} --rounds {args.rounds} --out {args.out}"}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bounds.json").write_text(json.dumps({"meta": meta, "roofs": roof, "rows": rows}, indent=1))
    (args.out / "bounds.md").write_text(markdown(roof, rows, meta))
    print(markdown(roof, rows, meta))


if __name__ == "__main__":
    main()
