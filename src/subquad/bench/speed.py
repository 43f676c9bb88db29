"""Forward time of every registered attention method against exact attention.

    python -m subquad.bench.speed                      # N in {1024, 4096, 16384}, B=1, H=8, D=64
    python -m subquad.bench.speed --n 1024 --methods softmax nystrom --out benchmarks/results

The forward-only predecessor of ``subquad compare``, which adds backward time, memory, FLOP
rates, plots and a recommendation.

Times are medians of ``torch.utils.benchmark.Timer.blocked_autorange`` using all of torch's
threads, measured in interleaved rounds in one run; the ratios to ``softmax`` (median of the
per-round ratios) are the numbers to quote (this machine is shared and absolute times drift).
The error column is the relative Frobenius error of the float32 output to exact attention on
the same inputs (i.i.d. N(0, 1) q, k, v).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

import subquad
from subquad.bench.timing import median_time


def time_forward(method: str, q, k, v, min_run_time: float) -> float:
    """Median seconds of one forward call."""
    return median_time(lambda: subquad.attention(q, k, v, method=method), min_run_time).seconds


def run(ns, methods, batch=1, heads=8, dim=64, min_run_time=0.5, rounds=3, seed=0, log=print) -> list[dict]:
    """Time every method in ``rounds`` interleaved rounds (each round times every method once),
    so a slow spell of the shared machine hits all methods alike. ``seconds`` is the median
    over rounds, ``speedup_vs_softmax`` the median of the per-round ratios and
    ``speedup_rounds`` those ratios (their spread shows how much the machine drifted)."""
    rows = []
    for n in ns:
        gen = torch.Generator().manual_seed(seed)
        q, k, v = (torch.randn(batch, heads, n, dim, generator=gen) for _ in range(3))
        with torch.no_grad():
            exact = subquad.attention(q, k, v, method="softmax")
            errors = {}
            for method in methods:
                out = subquad.attention(q, k, v, method=method)
                errors[method] = ((out - exact).norm() / exact.norm()).item()
            times = {method: [] for method in methods}
            for r in range(rounds):
                for method in methods:
                    times[method].append(time_forward(method, q, k, v, min_run_time))
                log(f"N={n:6d} round {r + 1}/{rounds}: "
                    + ", ".join(f"{m} {t[-1] * 1e3:.1f} ms" for m, t in times.items()))
        base = torch.tensor(times["softmax"], dtype=torch.float64)
        for method in methods:
            t = torch.tensor(times[method], dtype=torch.float64)
            ratios = base / t
            rows.append({"n": n, "method": method, "seconds": t.median().item(), "rounds": times[method],
                         "speedup_vs_softmax": ratios.median().item(), "speedup_rounds": ratios.tolist(),
                         "rel_error": errors[method]})
    return rows


def markdown(rows, header: str) -> str:
    ns = sorted({r["n"] for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    lines = [header, "", "| method | " + " | ".join(f"N={n}: ms (x vs softmax; range over rounds), rel.err"
                                                    for n in ns) + " |",
             "|---|" + "---|" * len(ns)]
    for m in methods:
        cells = []
        for n in ns:
            r = next(r for r in rows if r["n"] == n and r["method"] == m)
            spread = ""
            if len(r["speedup_rounds"]) > 1:
                spread = f"; {min(r['speedup_rounds']):.1f}-{max(r['speedup_rounds']):.1f}x"
            cells.append(f"{r['seconds'] * 1e3:.1f} ({r['speedup_vs_softmax']:.1f}x{spread}), {r['rel_error']:.3f}")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m subquad.bench.speed", description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, nargs="+", default=[1024, 4096, 16384], help="sequence lengths")
    p.add_argument("--methods", nargs="+", default=None, help="methods (default: every attention method)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=64, help="head dim")
    p.add_argument("--min-run-time", type=float, default=0.5, help="seconds per Timer measurement")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (ratios are their median)")
    p.add_argument("--out", type=Path, default=None, help="directory for speed.md and speed.json")
    args = p.parse_args(argv)
    known = [m.name for m in subquad.list_methods() if m.kind == "attention"]
    methods = args.methods or known
    for m in methods:
        if m not in known:
            p.error(f"unknown method {m!r}; known attention methods are {known}")
    if "softmax" not in methods:
        methods = ["softmax", *methods]
    if min(args.n) < 1:
        p.error("--n values must be >= 1")
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if args.out is not None:
        try:
            args.out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            p.error(f"cannot create --out {args.out}: {e}")
    start = time.time()
    rows = run(args.n, methods, args.batch, args.heads, args.dim, args.min_run_time, args.rounds)
    cmd = "python -m subquad.bench.speed " + " ".join(argv if argv is not None else sys.argv[1:])
    header = (f"# Forward time vs exact attention\n\nB={args.batch}, H={args.heads}, D={args.dim}, float32, "
              f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads), "
              f"torch {torch.__version__}. Median of torch.utils.benchmark over {args.rounds} interleaved rounds "
              f"in one run ({time.time() - start:.0f} s); speed-up = median of the per-round ratios.\n"
              f"Command: `{cmd.strip()}`")
    table = markdown(rows, header)
    print(table)
    if args.out is not None:
        (args.out / "speed.md").write_text(table)
        (args.out / "speed.json").write_text(json.dumps(
            {"batch": args.batch, "heads": args.heads, "dim": args.dim, "torch": torch.__version__,
             "threads": torch.get_num_threads(), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
