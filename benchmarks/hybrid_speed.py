"""Forward time of ``hybrid`` against exact attention (SDPA) as N grows.

    python benchmarks/hybrid_speed.py --out benchmarks/results            # N = 4k .. 64k
    python benchmarks/hybrid_speed.py --n 1024 2048 --out /tmp/hs          # smoke run
    python benchmarks/hybrid_speed.py --variant candidates=256 --out DIR   # also time a variant

B=1, H=8, D=64, float32, i.i.d. N(0, 1) inputs, forward only, no grad. Each time is the median of
``torch.utils.benchmark`` blocks (``subquad.bench.timing.median_time``); SDPA is timed up to
``--sdpa-max`` (it is quadratic: at 64k one call takes minutes on this CPU). The growth column is
the exponent of N between consecutive lengths (1 = linear, 2 = quadratic). ``--variant`` times
hybrid with some options changed as well, at each N right after the defaults, in the same run.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import platform
import time
from pathlib import Path

import torch

import subquad
from subquad.bench.timing import median_time


def _inputs(n: int):
    g = torch.Generator().manual_seed(n)
    return [torch.randn(1, 8, n, 64, generator=g) for _ in range(3)]


def _time(method: str, n: int, options: dict, min_run_time: float) -> float:
    q, k, v = _inputs(n)
    with torch.no_grad():
        return median_time(lambda: subquad.attention(q, k, v, method=method, **options), min_run_time).seconds


def run(ns: list[int], sdpa_max: int, options: dict, min_run_time: float, variant: dict | None = None) -> list[dict]:
    rows = []
    for n in ns:
        row = {"n": n, "hybrid_s": _time("hybrid", n, options, min_run_time)}
        if variant:
            row["variant_s"] = _time("hybrid", n, {**options, **variant}, min_run_time)
        row["sdpa_s"] = _time("softmax", n, {}, min_run_time) if n <= sdpa_max else None
        rows.append(row)
        print(row, flush=True)
    for prev, row in zip(rows, rows[1:]):
        row["growth"] = math.log(row["hybrid_s"] / prev["hybrid_s"]) / math.log(row["n"] / prev["n"])
    return rows


def markdown(rows: list[dict], meta: dict) -> str:
    name = ", ".join(f"{key}={value}" for key, value in meta["variant"].items())
    variant = (f" hybrid, {name} (s) | SDPA / that |", "---|---|") if meta["variant"] else ("", "")
    lines = [
        "# hybrid: forward time against exact attention (SDPA)",
        "",
        f"B=1, H=8, D=64, float32, i.i.d. inputs, forward without grad; hybrid options {meta['options'] or 'defaults'} "
        f"(budget 64). {meta['threads']} torch thread(s), {meta['machine']}, torch {meta['torch']}, {meta['date']}. "
        f"Command: `{meta['command']}`. {meta['note']}",
        "",
        "| N | hybrid (s) | SDPA (s) | SDPA / hybrid | growth of hybrid (exponent of N) |" + variant[0],
        "|---|---|---|---|---|" + variant[1],
    ]
    for r in rows:
        sdpa = f"{r['sdpa_s']:.3f}" if r["sdpa_s"] is not None else "not run"
        ratio = f"{r['sdpa_s'] / r['hybrid_s']:.2f}x" if r["sdpa_s"] is not None else ""
        growth = f"{r['growth']:.2f}" if "growth" in r else ""
        extra = ""
        if meta["variant"]:
            vs = r["variant_s"]
            extra = f" {vs:.3f} | {r['sdpa_s'] / vs:.2f}x |" if r["sdpa_s"] is not None else f" {vs:.3f} | |"
        lines.append(f"| {r['n']} | {r['hybrid_s']:.3f} | {sdpa} | {ratio} | {growth} |" + extra)
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, nargs="+", default=[4096, 8192, 16384, 32768, 65536])
    ap.add_argument("--sdpa-max", type=int, default=16384)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--min-run-time", type=float, default=1.0)
    ap.add_argument("--variant", nargs="*", default=[], metavar="KEY=VALUE",
                    help="hybrid options of a variant timed beside the defaults (values as Python literals)")
    ap.add_argument("--note", default="")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    options: dict = {}
    variant = {key: ast.literal_eval(value) for key, value in (item.split("=", 1) for item in args.variant)}
    rows = run(args.n, args.sdpa_max, options, args.min_run_time, variant)
    meta = {"options": options, "variant": variant, "threads": args.threads,
            "machine": platform.processor() or platform.machine(),
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "note": args.note,
            "command": "python benchmarks/hybrid_speed.py " + " ".join(
                f"--n {' '.join(map(str, args.n))} --threads {args.threads} --out {args.out}".split()
                + (["--variant", *args.variant] if args.variant else []))}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "hybrid_speed.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (args.out / "hybrid_speed.md").write_text(markdown(rows, meta))
    print(markdown(rows, meta))


if __name__ == "__main__":
    main()
