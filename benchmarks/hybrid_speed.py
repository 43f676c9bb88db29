"""hybrid against SDPA with the same mask: forward and forward + backward, on the CPU or a GPU.

    python benchmarks/hybrid_speed.py --out benchmarks/results                      # CPU, float32
    python benchmarks/hybrid_speed.py --device cuda --dtype bfloat16 --n 16384 65536 \\
        --out benchmarks/results --name hybrid_speed_cuda                           # a GPU, bf16
    python benchmarks/hybrid_speed.py --first-call --out benchmarks/results          # cold and warm starts

B=1, H=8, D=64, i.i.d. N(0, 1) inputs, hybrid's default options unless ``-o NAME=VALUE``.
Each time is the median over ``--rounds`` rounds whose calls are interleaved (hybrid, then
SDPA, per round); a call's time is the median of repeated calls for at least ``--min-time``
seconds (CUDA: synchronised). The first call (compile) is excluded and reported. Forward +
backward: ``(out * w).sum().backward()`` with gradients for q, k and v (on the CPU causal
self-attention runs torch's flash kernel per query block either way; non-causal, the backward
runs the gathered form: torch's CPU FlexAttention has no backward). Also the relative error of
the forward output against SDPA's in float32 on the same inputs.

``--first-call``: instead, the seconds of a new process's first hybrid call (after importing
subquad and making the inputs), once with empty compile caches (a fresh ``TORCHINDUCTOR_CACHE_DIR``)
and once more in a new process with the caches that run left, per case (``--n``, each mask and pass).
"""

from __future__ import annotations

import argparse
import ast
import datetime
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import subquad
from subquad.compare.common import machine_info, md_table, source_state


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _time(fn, device, min_time):
    """Median seconds of repeated calls for at least ``min_time`` s (at least one)."""
    times, start = [], time.perf_counter()
    while not times or time.perf_counter() - start < min_time:
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _calls(n, causal, backward, args, options):
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(1, args.heads, n, args.dim, generator=g).to(device, dtype).requires_grad_(backward)
               for _ in range(3))
    w = torch.randn(1, args.heads, n, args.dim, generator=g).to(device, dtype)

    def run(fn):
        def call():
            if backward:
                (fn() * w).sum().backward()
            else:
                with torch.no_grad():
                    fn()
        return call

    ours = run(lambda: subquad.attention(q, k, v, method="hybrid", causal=causal, **options))
    sdpa = run(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
    return ours, sdpa, (q, k, v)


def measure(args, options):
    device = torch.device(args.device)
    rows = []
    for n in args.n:
        for causal in [m == "causal" for m in args.masks]:
            for backward in [pass_ == "fwd+bwd" for pass_ in args.passes]:
                ours, sdpa, (q, k, v) = _calls(n, causal, backward, args, options)
                t = time.perf_counter()
                ours()
                _sync(device)
                first = time.perf_counter() - t
                sdpa()
                a, b = [], []
                for _ in range(args.rounds):
                    a.append(_time(ours, device, args.min_time))
                    b.append(_time(sdpa, device, args.min_time))
                with torch.no_grad():
                    out = subquad.attention(q, k, v, method="hybrid", causal=causal, **options).float()
                    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
                err = ((out - ref).norm() / ref.norm()).item()
                row = {"n": n, "causal": causal, "backward": backward, "hybrid_s": statistics.median(a),
                       "sdpa_s": statistics.median(b), "first_call_s": first, "error_iid": err,
                       "rounds": {"hybrid": a, "sdpa": b}}
                row["speedup"] = row["sdpa_s"] / row["hybrid_s"]
                rows.append(row)
                print(f"N={n} causal={causal} backward={backward}: hybrid {row['hybrid_s'] * 1e3:.2f} ms, "
                      f"SDPA {row['sdpa_s'] * 1e3:.2f} ms, {row['speedup']:.2f}x (first call {first:.1f} s, "
                      f"error on i.i.d. inputs {err:.3f})", flush=True)
                del q, k, v
    return rows


FIRST_CALL = """
import sys, time, torch, subquad
n, causal, backward = int(sys.argv[1]), sys.argv[2] == "causal", sys.argv[3] == "fwd+bwd"
q, k, v = (torch.randn(1, 8, n, 64, requires_grad=backward) for _ in range(3))
start = time.perf_counter()
out = subquad.attention(q, k, v, method="hybrid", causal=causal)
if backward:
    out.sum().backward()
print(time.perf_counter() - start)
"""


def first_calls(args) -> list[dict]:
    """Per case, a new process's first call with empty compile caches, then with warm ones."""
    import os
    import subprocess
    import sys
    import tempfile

    rows = []
    for n in args.n:
        for mask in args.masks:
            for pass_ in args.passes:
                with tempfile.TemporaryDirectory() as cache:
                    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
                    seconds = [float(subprocess.run([sys.executable, "-c", FIRST_CALL, str(n), mask, pass_], env=env,
                                                    check=True, capture_output=True, text=True).stdout.split()[-1])
                               for _ in range(2)]
                rows.append({"n": n, "mask": mask, "pass": pass_, "cold_s": seconds[0], "warm_s": seconds[1]})
                print(rows[-1], flush=True)
    return rows


def write_first_calls(rows, args, out: Path):
    out.mkdir(parents=True, exist_ok=True)
    info = machine_info(torch.device("cpu"))
    text = ["# hybrid's first call in a new process (CPU, float32)", "",
            f"B=1, H=8, D=64, default options; {info['cpu']}, torch {info['torch']}, "
            f"{datetime.date.today().isoformat()}, {source_state(Path(__file__).parent)}. Command: `{args.command}`",
            "", md_table(["N", "mask", "pass", "empty caches (s)", "warm caches, new process (s)"],
                         [[r["n"], r["mask"], r["pass"], f"{r['cold_s']:.1f}", f"{r['warm_s']:.1f}"] for r in rows]),
            ""]
    (out / f"{args.name}.md").write_text("\n".join(text))


def write(rows, args, options, out: Path):
    out.mkdir(parents=True, exist_ok=True)
    info = machine_info(torch.device(args.device))
    meta = {"date": datetime.date.today().isoformat(), "machine": info, "options": options,
            "source": source_state(Path(__file__).parent), "command": args.command, "note": args.note}
    (out / f"{args.name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    table = md_table(["N", "mask", "pass", "hybrid (ms)", "SDPA (ms)", "speed-up", "first call (s)"],
                     [[r["n"], "causal" if r["causal"] else "none", "fwd+bwd" if r["backward"] else "forward",
                       f"{r['hybrid_s'] * 1e3:.2f}", f"{r['sdpa_s'] * 1e3:.2f}", f"{r['speedup']:.2f}x",
                       f"{r['first_call_s']:.1f}"] for r in rows])
    text = [f"# hybrid against SDPA ({args.device}, {args.dtype})", "",
            f"B=1, H={args.heads}, D={args.dim}, i.i.d. N(0, 1) inputs, options {options or 'default'}; "
            f"median of {args.rounds} interleaved rounds. {info.get('gpu', info['cpu'])}, torch {info['torch']}, "
            f"{info['threads']} threads, {meta['date']}, {meta['source']}.", "",
            f"Command: `{args.command}`", ""]
    if args.note:
        text += [f"Conditions: {args.note}", ""]
    text += [table, ""]
    (out / f"{args.name}.md").write_text("\n".join(text))


def main(argv=None):
    import sys

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, nargs="+", default=[4096, 8192, 16384])
    p.add_argument("--masks", nargs="+", choices=("causal", "none"), default=["causal", "none"])
    p.add_argument("--passes", nargs="+", choices=("forward", "fwd+bwd"), default=["forward", "fwd+bwd"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--min-time", type=float, default=0.5)
    p.add_argument("-o", "--option", action="append", default=[], metavar="NAME=VALUE")
    p.add_argument("--out", default=None)
    p.add_argument("--name", default="hybrid_speed")
    p.add_argument("--note", default="")
    p.add_argument("--first-call", action="store_true", help="a new process's first call, cold and warm caches")
    args = p.parse_args(argv)
    args.command = "python benchmarks/hybrid_speed.py " + " ".join(sys.argv[1:] if argv is None else argv)
    options = {}
    for item in args.option:
        name, _, value = item.partition("=")
        try:
            options[name] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            options[name] = value
    if args.first_call:
        args.name = "hybrid_first_call" if args.name == "hybrid_speed" else args.name
        rows = first_calls(args)
        if args.out:
            write_first_calls(rows, args, Path(args.out))
        return rows
    rows = measure(args, options)
    if args.out:
        write(rows, args, options, Path(args.out))


if __name__ == "__main__":
    main()
