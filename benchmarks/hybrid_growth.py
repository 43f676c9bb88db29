"""How hybrid's forward time grows with N: the exponent ``log(t(N1) / t(N0)) / log(N1 / N0)``.

    python benchmarks/hybrid_growth.py --out benchmarks/results        # 4096 -> 65536, causal and not

B=1, H=8, D=64, float32, i.i.d. inputs, default options, no autograd (the compiled kernel), 2 torch
threads; per N the median of ``--rounds`` calls, causal and non-causal calls interleaved.
"""

from __future__ import annotations

import argparse
import datetime
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from subquad.compare.common import md_table, source_state
from subquad.ops.hybrid import hybrid_attention

ROOT = Path(__file__).resolve().parents[1]


def medians(n: int, rounds: int) -> dict[bool, float]:
    """Median seconds of one causal and one non-causal forward at ``n`` (one warm-up call each)."""
    q, k, v = (torch.randn(1, 8, n, 64, generator=torch.Generator().manual_seed(s)) for s in range(3))
    times = {True: [], False: []}
    with torch.no_grad():
        for r in range(rounds + 1):
            for causal in times:
                start = time.perf_counter()
                hybrid_attention(q, k, v, causal=causal)
                if r:
                    times[causal].append(time.perf_counter() - start)
    return {c: statistics.median(t) for c, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, nargs=2, default=[4096, 65536], metavar=("N0", "N1"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.set_num_threads(2)
    t = {n: medians(n, args.rounds) for n in args.n}
    n0, n1 = args.n
    rows = [[name, f"{t[n0][c]:.3f}", f"{t[n1][c]:.3f}", f"{math.log(t[n1][c] / t[n0][c]) / math.log(n1 / n0):.3f}"]
            for name, c in (("non-causal", False), ("causal", True))]
    command = "python benchmarks/hybrid_growth.py " + " ".join(sys.argv[1:])
    text = "\n".join(["# hybrid: growth of the forward time with N", "",
                      f"{__doc__.split(chr(10) + chr(10))[2].strip()} subquad at {source_state(ROOT)}; "
                      f"{datetime.date.today()}. Command: `{command}`.", "",
                      md_table(["call", f"N = {n0} (s)", f"N = {n1} (s)", "exponent"], rows), ""])
    (args.out / "hybrid_growth.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
