"""Eager against ``torch.compile`` (inductor) for every attention method: forward and
forward+backward time on CPU.

    python benchmarks/compile.py --out benchmarks/results

For each N (default 4096 and 16384; B=1, H=8, D=64, float32, CPU) and each method with its
default options: the op called eagerly, and the same op through
``torch.compile(subquad.get_method(name).op, fullgraph=True, dynamic=False)`` (each method's op
is its own code object, so each gets its own compiled entries). Forward runs under ``no_grad``;
forward+backward returns the gradients of ``<out, g>`` for a fixed random ``g`` w.r.t. q, k, v.
Stochastic methods draw from the global RNG (a torch.Generator cannot be traced), eager too.

Times are medians of ``torch.utils.benchmark`` ``blocked_autorange`` over ``--rounds`` rounds in
which eager and compiled alternate; the ratio eager/compiled is taken per round and the table
gives its median and range. A point whose eager call takes more than ``--max-call-seconds`` is
skipped, and so is a quadratic method whose N x N float32 scores would exceed
``--max-quadratic-gib`` (randomized attention's SDPA call forms them: at N=16384 it was killed for
memory). Compile time is the first compiled call. ``--resume`` keeps the points already in
``compile.json`` and measures the rest (the commands of both runs are recorded).
The 1-minute load average is recorded around every point: on a shared machine only the ratios
from one run mean anything. Writes ``compile.json`` and ``compile.md`` under ``--out``.
"""

from __future__ import annotations

import os

# inductor compiles its kernels in a pool of worker processes by default; one keeps the
# benchmark's own load modest on a shared machine (it only changes compile time)
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import shlex  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

import subquad  # noqa: E402
from subquad.compare.timing import median_time  # noqa: E402

B, H, D = 1, 8, 64


def make_calls(op, n: int, mode: str):
    """``fn()`` for one point: forward under no_grad, or forward and the gradients of <out, g>."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, n, D, generator=gen) for _ in range(3))
    if mode == "forward":
        def fn():
            with torch.no_grad():
                return op(q, k, v)
        return fn
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    g = torch.randn(B, H, n, D, generator=gen)

    def fn():
        return torch.autograd.grad(op(q, k, v), (q, k, v), g)
    return fn


def measure(name: str, n: int, mode: str, args, done: list[dict]) -> dict:
    info = subquad.get_method(name)
    point = {"method": name, "n": n, "mode": mode, "load_before": os.getloadavg()[0]}
    scores_gib = B * H * n * n * 4 / 2**30
    if info.complexity == "quadratic" and scores_gib > args.max_quadratic_gib:
        point.update(skipped=f"quadratic: N x N scores of {scores_gib:.0f} GiB > --max-quadratic-gib")
        return point
    if any(p["method"] == name and p["mode"] == mode and p["n"] < n and "skipped" in p for p in done):
        point.update(skipped="skipped at a smaller N")
        return point
    op = info.op
    compiled_op = torch.compile(op, fullgraph=True, dynamic=False)
    eager, compiled = make_calls(op, n, mode), make_calls(compiled_op, n, mode)
    t0 = time.perf_counter()
    eager()
    first_eager = time.perf_counter() - t0
    if first_eager > args.max_call_seconds:
        point.update(skipped=f"eager call took {first_eager:.1f} s > --max-call-seconds {args.max_call_seconds}")
        return point
    t0 = time.perf_counter()
    compiled()
    point["compile_s"] = time.perf_counter() - t0
    compiled()  # warm
    rounds = []
    for _ in range(args.rounds):
        e = median_time(eager, args.min_run_time).seconds * 1e3
        c = median_time(compiled, args.min_run_time).seconds * 1e3
        rounds.append({"eager_ms": e, "compiled_ms": c, "ratio": e / c})
    ratios = [r["ratio"] for r in rounds]
    point.update(
        rounds=rounds,
        eager_ms=statistics.median(r["eager_ms"] for r in rounds),
        compiled_ms=statistics.median(r["compiled_ms"] for r in rounds),
        ratio=statistics.median(ratios),
        ratio_min=min(ratios),
        ratio_max=max(ratios),
        load_after=os.getloadavg()[0],
    )
    return point


def write_report(results: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "compile.json").write_text(json.dumps(results, indent=1) + "\n")
    lines = [
        "# Eager vs torch.compile (inductor)",
        "",
        f"B={B}, H={H}, D={D}, float32, CPU ({results['machine']}, {results['threads']} thread(s)), "
        f"torch {results['torch']}. Median of torch.utils.benchmark over {results['rounds']} interleaved rounds "
        f"in one run{' (resumed: see the command)' if 'resumed' in results['command'] else ''} "
        f"({results['wall_s']:.0f} s); eager/compiled = median of the per-round ratios (> 1: "
        "compiled is faster), with their range. Default options of every method; compiled = "
        "`torch.compile(subquad.get_method(name).op, fullgraph=True, dynamic=False)`.",
        "",
        f"Load: {results['load_note']}",
        "",
        f"Command: `{results['command']}`",
        "",
        "| method | N | mode | eager ms | compiled ms | eager/compiled (range) | compile s | load 1-min |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in results["points"]:
        if "skipped" in p:
            lines.append(f"| {p['method']} | {p['n']} | {p['mode']} | skipped: {p['skipped']} | | | | "
                         f"{p['load_before']:.1f} |")
            continue
        lines.append(
            f"| {p['method']} | {p['n']} | {p['mode']} | {p['eager_ms']:.1f} | {p['compiled_ms']:.1f} | "
            f"{p['ratio']:.2f}x ({p['ratio_min']:.2f}-{p['ratio_max']:.2f}) | {p['compile_s']:.0f} | "
            f"{p['load_before']:.1f}-{p['load_after']:.1f} |"
        )
    (out / "compile.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    names = [m.name for m in subquad.list_methods() if m.kind == "attention"]
    parser.add_argument("--methods", nargs="+", default=names, choices=names)
    parser.add_argument("--n", nargs="+", type=int, default=[4096, 16384])
    parser.add_argument("--modes", nargs="+", default=["forward", "forward+backward"],
                        choices=["forward", "forward+backward"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--min-run-time", type=float, default=0.3, help="seconds per blocked_autorange")
    parser.add_argument("--max-call-seconds", type=float, default=2.0)
    parser.add_argument("--max-quadratic-gib", type=float, default=2.0)
    parser.add_argument("--resume", action="store_true", help="keep the points already in OUT/compile.json")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1 by default: modest on a shared machine; ratios are per thread count)")
    parser.add_argument("--note", default="", help="what else runs on the machine, for the report")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    start = time.perf_counter()
    load_start = os.getloadavg()
    command = "python benchmarks/compile.py " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None
                                                                                  else argv))
    results = {
        "command": command, "torch": torch.__version__, "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "threads": args.threads, "rounds": args.rounds, "min_run_time": args.min_run_time, "points": [],
    }
    previous_wall = 0.0
    if args.resume and (args.out / "compile.json").exists():
        old = json.loads((args.out / "compile.json").read_text())
        results["points"] = old["points"]
        results["command"] = old["command"] + "; resumed with: " + command
        previous_wall = old.get("wall_s", 0.0)
        load_start = tuple(float(x) for x in old["load_note"].split(" load average ")[1].split(" ")[0].split("/"))
    for n in args.n:
        for name in args.methods:
            for mode in args.modes:
                if any((p["method"], p["n"], p["mode"]) == (name, n, mode) for p in results["points"]):
                    continue
                point = measure(name, n, mode, args, results["points"])
                results["points"].append(point)
                msg = point.get("skipped") or (
                    f"eager {point['eager_ms']:.1f} ms, compiled {point['compiled_ms']:.1f} ms, "
                    f"{point['ratio']:.2f}x, compile {point['compile_s']:.0f} s"
                )
                print(f"N={n} {name} {mode}: {msg}", flush=True)
                results["wall_s"] = previous_wall + time.perf_counter() - start
                end = os.getloadavg()
                results["load_note"] = (
                    f"1/5/15-min load average {'/'.join(f'{x:.1f}' for x in load_start)} at the start, "
                    f"{'/'.join(f'{x:.1f}' for x in end)} at the end, on {os.cpu_count()} cores"
                    + (f" ({args.note})" if args.note else "") + ": absolute times drift, compare the ratios."
                )
                write_report(results, args.out)  # after every point: a killed run keeps what it measured


if __name__ == "__main__":
    main()
