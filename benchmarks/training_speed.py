"""Forward + backward speed of every method against exact attention, and bfloat16 against float32.

    python benchmarks/training_speed.py --out benchmarks/results            # N = 1024 4096 16384
    python benchmarks/training_speed.py --reuse --out benchmarks/results    # the compare run kept

Runs ``subquad compare --objective training`` in float32 (B=1, H=8, D=64, i.i.d. inputs, each point
the median of at least five timed blocks, a point predicted over ``--max-call-seconds`` skipped)
into ``OUT/training_speed/float32/`` and writes ``OUT/training_speed.md``: per method and N the
seconds of one forward + backward call and the speed-up over exact attention (SDPA, the fastest
dense kernel on this CPU at these lengths: ``tree_hybrid/hybrid_speed.md``) in the same run. Then, per method
and N in ``--bf16-n``, one forward + backward with bfloat16 inputs over one with float32 inputs
(what a layer under ``torch.autocast(dtype=torch.bfloat16)`` hands attention), medians of
interleaved rounds in this process. Exact attention is left out of that table: without native
bfloat16 matrix products (about 1 GFLOP/s on this CPU, against 200 in float32) its bfloat16 path
is hundreds of times slower, while subquad's methods compute in float32 whatever the input.
``--reuse``: take the compare run already in ``OUT/training_speed/float32/``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import subquad
from subquad.compare.common import md_table, source_state

ROOT = Path(__file__).resolve().parents[1]


def run_compare(ns: list[int], out: Path, max_call: float) -> dict:
    """One float32 ``subquad compare --objective training`` run; its results.json."""
    cmd = [sys.executable, "-m", "subquad", "compare", "--objective", "training", "--n", *map(str, ns),
           "--max-call-seconds", str(max_call), "--no-memory", "--out", str(out)]
    subprocess.run(cmd, check=True)
    return json.loads((out / "results.json").read_text())


def _step(method: str, n: int, dtype: torch.dtype) -> float:
    """Seconds of one forward + backward of ``method`` on fresh i.i.d. inputs of ``dtype``."""
    q, k, v = (torch.randn(1, 8, n, 64).to(dtype).requires_grad_() for _ in range(3))
    extra = {"generator": torch.Generator().manual_seed(0)} if subquad.get_method(method).stochastic else {}
    start = time.perf_counter()
    subquad.attention(q, k, v, method=method, **extra).float().sum().backward()
    return time.perf_counter() - start


def bf16_ratios(methods: list[str], ns: list[int], rounds: int) -> dict[tuple[str, int], float]:
    """Median bfloat16-input time over median float32-input time, rounds interleaved."""
    out = {}
    for n in ns:
        times = {(m, d): [] for m in methods for d in (torch.float32, torch.bfloat16)}
        for _ in range(rounds + 1):  # the first round warms up
            for key in times:
                times[key].append(_step(key[0], n, key[1]))
        for m in methods:
            out[m, n] = statistics.median(times[m, torch.bfloat16][1:]) / statistics.median(times[m, torch.float32][1:])
    return out


def _cell(row: dict | None) -> str:
    if row is None or row.get("status") != "ok" or not row.get("forward_backward_s"):
        return "skipped"
    return f"{row['forward_backward_s']:.3f} s ({row['speedup_forward_backward']:.2f}x)"


def markdown(result: dict, ratios: dict[tuple[str, int], float], command: str, note: str) -> str:
    """The float32 table (methods x N) and the bfloat16 / float32 one."""
    ns = result["config"]["ns"]
    by = {(r["method"], r["n"]): r for r in result["rows"]}
    methods = list(dict.fromkeys(r["method"] for r in result["rows"]))
    out = ["# Training speed: forward + backward against exact attention", "",
           f"B=1, H=8, D=64, i.i.d. inputs, 2 torch threads. {note} Command: `{command}`.", "",
           "## float32", "", "One forward + backward call, the median of at least five timed blocks "
           "(`subquad compare --objective training`; its run and report in `training_speed/float32/`); in brackets "
           "the speed-up over exact attention (`softmax`: SDPA) in the same run.", "",
           md_table(["method"] + [f"N = {n}" for n in ns],
                    [[m] + [_cell(by.get((m, n))) for n in ns] for m in methods]), ""]
    rns = sorted({n for _, n in ratios})
    rms = list(dict.fromkeys(m for m, _ in ratios))
    out += ["## bfloat16 inputs / float32 inputs", "", "Time of one forward + backward with bfloat16 q, k, v over "
            "the same with float32 (below 1: bfloat16 is faster), medians of interleaved rounds in one process.", "",
            md_table(["method"] + [f"N = {n}" for n in rns], [[m] + [f"{ratios[m, n]:.2f}" for n in rns] for m in rms]),
            "", "Every method computes in float32 whatever its inputs (a CPU without native bfloat16 matrix products "
            "multiplies them at ~1 GFLOP/s), so bfloat16 inputs add their conversions to float32 and back "
            "(q, k, v, the output and the three gradients) and change nothing else; under torch.profiler "
            "(linear, N = 4096, 2 threads) the op's own kernels take the same time in both (within 3 %). Where "
            "that work is a large share of the step, a ratio above 1 is those conversions.", ""]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--bf16-n", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reuse", action="store_true", help="read the compare run in OUT/training_speed/float32/")
    ap.add_argument("--max-call-seconds", type=float, default=20.0)
    ap.add_argument("--note", default="")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.set_num_threads(2)
    where = args.out / "training_speed" / "float32"
    result = json.loads((where / "results.json").read_text()) if args.reuse else \
        run_compare(args.n, where, args.max_call_seconds)
    methods = [m.name for m in subquad.list_methods() if m.kind == "attention" and not m.exact and
               m.complexity != "quadratic"]
    ratios = bf16_ratios(methods, args.bf16_n, args.rounds)
    note = f"subquad at {source_state(ROOT)}; {datetime.date.today()}. {args.note}".strip()
    command = "python benchmarks/training_speed.py " + " ".join(sys.argv[1:])
    (args.out / "training_speed.md").write_text(markdown(result, ratios, command, note))
    print((args.out / "training_speed.md").read_text())


if __name__ == "__main__":
    main()
