"""hybrid's forward at this checkout against another revision: which change made it faster.

    python benchmarks/kernel_ab.py --base 667041e --out benchmarks/results

B=1, H=8, D=64, float32, i.i.d. inputs, default options, no autograd (the compiled kernel), 2 torch
threads; a run ``cold`` times a fresh process's first call at N = 4096 with an empty numba cache
(the kernel's compile). Each revision runs in its own processes (a git worktree of ``--base`` beside this
checkout's ``src``), the two alternating, their order swapped every round; per process one warm-up
call and ``--calls`` timed calls, of which the median; per revision the median over ``--rounds``
processes. Separate processes because two copies of the kernel in one process do not run alike:
the one imported second measured 6-12 % slower with the very same code.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from subquad.compare.common import md_table, source_state

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import statistics, sys, time, torch, subquad
torch.set_num_threads(2)
n, causal, calls = int(sys.argv[1]), sys.argv[2] == "1", int(sys.argv[3])
q, k, v = (torch.randn(1, 8, n, 64, generator=torch.Generator().manual_seed(s)) for s in range(3))
t = time.perf_counter()
subquad.attention(q, k, v, method="hybrid", causal=causal)
times = [time.perf_counter() - t] if calls == 0 else []
for _ in range(calls):
    t = time.perf_counter()
    subquad.attention(q, k, v, method="hybrid", causal=causal)
    times.append(time.perf_counter() - t)
print(statistics.median(times))
"""


def one(src: Path, n: int, causal: bool, calls: int) -> float:
    """Median seconds of ``calls`` forwards in a fresh process importing subquad from ``src``;
    ``calls = 0``: the first call's, with an empty numba cache."""
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, PYTHONPATH=str(src), **({"NUMBA_CACHE_DIR": cache} if calls == 0 else {}))
        out = subprocess.run([sys.executable, "-c", CHILD, str(n), str(int(causal)), str(calls)], env=env,
                             capture_output=True, text=True, check=True)
    return float(out.stdout.split()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="git revision to compare against")
    ap.add_argument("--runs", nargs="+", default=["1024", "4096", "16384", "65536", "16384c"],
                    help="N, with a trailing c for causal; cold: the first call's compile")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--note", default="")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base), args.base], check=True,
                       capture_output=True)
        try:
            trees = {"base": base / "src", "this": ROOT / "src"}
            rows = []
            for run in args.runs:
                cold = run == "cold"
                n, causal = (4096, False) if cold else (int(run.rstrip("c")), run.endswith("c"))
                times = {name: [] for name in trees}
                for r in range(args.rounds):
                    for name in (("base", "this") if r % 2 == 0 else ("this", "base")):
                        times[name].append(one(trees[name], n, causal, 0 if cold else args.calls))
                b, t = (statistics.median(times[name]) for name in ("base", "this"))
                call = "first call, empty cache" if cold else "causal" if causal else "non-causal"
                rows.append([str(n), call, f"{b:.4f}", f"{t:.4f}", f"{t / b:.3f}"])
                print(rows[-1], flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=False)
    command = "python benchmarks/kernel_ab.py " + " ".join(sys.argv[1:])
    text = "\n".join([f"# hybrid's forward: this checkout against {args.base}", "",
                      f"{__doc__.split(chr(10) + chr(10))[2].strip()} subquad at {source_state(ROOT)}; "
                      f"{datetime.date.today()}. Command: `{command}`. {args.note}", "",
                      md_table(["N", "call", f"{args.base} (s)", "this (s)", "this / base"], rows), ""])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kernel_ab.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
