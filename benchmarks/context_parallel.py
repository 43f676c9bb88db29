"""Context parallelism on one machine: 2 processes x 1 thread (torchrun, gloo) against 1 process x
2 threads, causal attention forward and forward+backward, per method: peak memory per process
(the op's: the resident-set peak above the inputs, the most of any process), time (the slowest
process; median of ``--reps`` calls after one warm-up call), and what a process hands the
collectives per call (subquad.distributed.traffic; the most of any process).

    python benchmarks/context_parallel.py --out benchmarks/results/context_parallel
    python benchmarks/context_parallel.py --fit-mib 2048 --methods linear hybrid --n 32768 --out ...
    (the largest N under a memory limit)
    python benchmarks/context_parallel.py --methods softmax --layouts contiguous zigzag --out ...
    (ring attention's causal work balanced by the zig-zag layout)

Each measurement is a fresh process (or pair of processes), so one's memory peak cannot hide
another's; the single and the sharded runs of a method alternate. B = 1, H = 8, D = 64, float32.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

SHAPE = {"B": 1, "H": 8, "D": 64}
DEFAULT_N = {"linear": 131072, "hybrid": 131072, "softmax": 32768}


def _kib(field: str) -> int:
    """A field of /proc/self/status in KiB (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
    """Set VmHWM (the resident-set peak) to the current resident set (Linux: clear_refs 5)."""
    Path("/proc/self/clear_refs").write_text("5")


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    import subquad
    import subquad.distributed as sqd

    torch.set_num_threads(args.threads)
    sharded = "WORLD_SIZE" in os.environ
    if sharded:
        dist.init_process_group("gloo")
    rank, size = (dist.get_rank(), dist.get_world_size()) if sharded else (0, 1)
    n = len(range(args.length)[rank::size])  # the first N % size ranks one token more
    B, H, D = SHAPE["B"], SHAPE["H"], SHAPE["D"]
    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(B, H, n, D, generator=g).requires_grad_() for _ in range(3))
    grad = torch.randn(B, H, n, D, generator=g)
    options = json.loads(args.options)
    op = sqd.attention if sharded else subquad.attention

    layout = {"layout": args.layout} if sharded else {}

    def call():
        return op(q, k, v, method=args.method, causal=True, **layout, **options)

    def sync():
        if sharded:
            dist.barrier()

    _reset_peak()
    base = _kib("VmRSS")
    with sqd.traffic() as sent_forward:
        out = call()
    with sqd.traffic() as sent_backward:
        out.backward(grad)
    peak = _kib("VmHWM") - base
    fwd, both = [], []
    for _ in range(args.reps):
        q.grad = k.grad = v.grad = out = None
        sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            call()
        sync()
        t1 = time.perf_counter()
        call().backward(grad)
        sync()
        both.append(time.perf_counter() - t1)
        fwd.append(t1 - t0)
    row = {"peak_mib": peak / 1024, "forward_s": statistics.median(fwd) if fwd else None,
           "forward_backward_s": statistics.median(both) if both else None,
           "forward_bytes": sent_forward["bytes"], "backward_bytes": sent_backward["bytes"]}
    rows = [row]
    if sharded:
        rows = [None] * size
        dist.all_gather_object(rows, row)
        dist.destroy_process_group()
    if rank == 0:
        print("RESULT " + json.dumps(rows), flush=True)


def _run(method: str, n: int, sharded: bool, options: dict, reps: int, layout: str = "contiguous") -> dict:
    script = [str(Path(__file__).resolve()), "worker", "--method", method, "--length", str(n), "--reps", str(reps),
              "--options", json.dumps(options), "--layout", layout]
    if sharded:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *script,
               "--threads", "1"]
    else:
        cmd = [sys.executable, *script, "--threads", "2"]
    env = dict(os.environ, OMP_NUM_THREADS="1" if sharded else "2")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        return {"error": (done.stderr or done.stdout)[-400:]}
    ranks = json.loads(lines[-1][len("RESULT "):])
    slowest = (lambda key: None if ranks[0][key] is None else max(r[key] for r in ranks))  # noqa: E731
    return {"peak_mib": max(r["peak_mib"] for r in ranks), "forward_s": slowest("forward_s"),
            "forward_backward_s": slowest("forward_backward_s"),
            "forward_bytes": max(r["forward_bytes"] for r in ranks),
            "backward_bytes": max(r["backward_bytes"] for r in ranks),
            "ranks": ranks}


def _table(rows: list[dict]) -> str:
    out = ["| method | N | processes x threads | peak MiB per process | ratio | forward s | forward+backward s "
           "| sent per call, most of any rank (fwd / bwd) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['method']} | {r['n']} | {r['config']} | failed: {r['error'][-80:]!r} | | | | |")
            continue
        ratio = f"{r['peak_mib'] / r['single_peak_mib']:.2f}" if r.get("single_peak_mib") else ""
        sent = f"{r['forward_bytes']:,} / {r['backward_bytes']:,} B" if r["config"] != "1 x 2" else ""
        out.append(f"| {r['method']} | {r['n']} | {r['config']} | {r['peak_mib']:.0f} | {ratio} | "
                   f"{r['forward_s']:.2f} | {r['forward_backward_s']:.2f} | {sent} |")
    return "\n".join(out)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command")
    w = sub.add_parser("worker")
    w.add_argument("--method", required=True)
    w.add_argument("--length", type=int, required=True)  # not --n: torchrun reads that as its own --nnodes
    w.add_argument("--threads", type=int, required=True)
    w.add_argument("--reps", type=int, default=3)
    w.add_argument("--options", default="{}")
    w.add_argument("--layout", default="contiguous")
    p.add_argument("--methods", nargs="+", default=list(DEFAULT_N))
    p.add_argument("--n", type=int, nargs="+", help="sequence lengths (default: 131072; softmax 32768)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--layouts", nargs="+", default=["contiguous"], choices=("contiguous", "zigzag"),
                   help="the sharded runs' layouts (subquad.distributed.shard); default: contiguous")
    p.add_argument("--fit-mib", type=int, help="instead: the largest N (doubling from 65536) whose peak fits")
    p.add_argument("--out", type=Path)
    p.add_argument("--name", help="file name of the results (default: context_parallel, or fit with --fit-mib)")
    args = p.parse_args(argv)
    if args.command == "worker":
        return worker(args)
    if args.out is None:
        p.error("--out is required")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for method in args.methods:
        for n in args.n or [DEFAULT_N.get(method, 131072)]:
            if args.fit_mib:
                rows += _fit(method, n, args.fit_mib)
                continue
            single = _run(method, n, False, {}, args.reps)
            rows.append({"method": method, "n": n, "config": "1 x 2", **single})
            for layout in args.layouts:
                config = "2 x 1" + ("" if layout == "contiguous" else f", {layout}")
                rows.append({"method": method, "n": n, "config": config,
                             **_run(method, n, True, {}, args.reps, layout), "single_peak_mib": single.get("peak_mib")})
            print(_table(rows[-1 - len(args.layouts):]), flush=True)
    name = args.name or ("fit" if args.fit_mib else "context_parallel")
    (args.out / f"{name}.json").write_text(json.dumps(rows, indent=1))
    cmd = "python benchmarks/context_parallel.py " + " ".join(argv if argv is not None else sys.argv[1:])
    head = f"Command: `{cmd}`\n\nB = {SHAPE['B']}, H = {SHAPE['H']}, D = {SHAPE['D']}, float32, causal.\n\n"
    (args.out / f"{name}.md").write_text(head + (_fit_table(rows, args.fit_mib) if args.fit_mib else _table(rows))
                                         + "\n")


def _fit(method: str, n: int, limit: int) -> list[dict]:
    """The largest N, doubling from ``n``, whose peak per process stays under ``limit`` MiB, for
    each configuration (one forward+backward each, not timed)."""
    rows = []
    for sharded, config in ((False, "1 x 2"), (True, "2 x 1")):
        fits, size = None, n
        while True:
            r = _run(method, size, sharded, {}, 0)
            print(method, config, size, r.get("peak_mib", r.get("error")), flush=True)
            if "error" in r or r["peak_mib"] > limit:
                break
            fits, size = (size, r["peak_mib"]), size * 2
        rows.append({"method": method, "config": config, "largest_n": fits and fits[0], "peak_mib": fits and fits[1],
                     "limit_mib": limit})
    return rows


def _fit_table(rows: list[dict], limit: int) -> str:
    out = [f"| method | processes x threads | largest N under {limit} MiB per process (doubling) | its peak MiB |",
           "|---|---|---|---|"]
    out += [f"| {r['method']} | {r['config']} | {r['largest_n']} | {r['peak_mib'] or 0:.0f} |" for r in rows]
    return "\n".join(out)


if __name__ == "__main__":
    main()
