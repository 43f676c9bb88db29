"""hybrid's speed and error against its candidate count: the forward time of hybrid at each
``--candidates`` (the leaves one block of 64 queries scores exactly; 128 by default at budget 64)
against the best dense kernel, non-causal and causal, beside the long-context error of the same
settings on SmolLM2 (``long_fidelity.py``'s JSON, ``--fidelity``).

    python benchmarks/long_fidelity.py --n 2048 8192 --no-limits --methods hybrid --budgets 64 \\
        --rows hybrid:candidates=64 hybrid:candidates=32 --out benchmarks/results/hybrid_candidates
    python benchmarks/hybrid_candidates.py --fidelity benchmarks/results/hybrid_candidates/long_fidelity.json \\
        --out benchmarks/results                                          # the committed table
    python benchmarks/hybrid_candidates.py --n 1024 --rounds 1 --out /tmp/hc   # smoke run

B=1, H=8, D=64, float32, i.i.d. N(0, 1) inputs, torch's threads, every other option at its
default. Each time is the median over ``--rounds`` rounds, the calls of a round interleaved (each
call: ``hybrid_speed.seconds``). The dense kernels are ``hybrid_speed``'s: SDPA, and the plain
blocked kernel up to ``--blocked-max``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import subquad
from hybrid_speed import blocked, inputs, seconds
from subquad.compare.common import machine_info, md_table, source_state
from subquad.ops.hybrid.options import HybridOptions, candidate_count


def _kernels(n: int, candidates: list[int], blocked_max: int) -> dict[str, object]:
    """The calls timed at ``n``: (name, causal) -> a no-grad forward."""
    q, k, v = inputs(n)
    calls = {}
    for causal in (False, True):
        calls["sdpa", causal] = lambda c=causal: F.scaled_dot_product_attention(q, k, v, is_causal=c)
        if n <= blocked_max:
            calls["blocked", causal] = lambda c=causal: blocked(q, k, v, c)
        for cand in candidates:
            calls[f"hybrid c={cand}", causal] = (
                lambda c=causal, m=cand: subquad.attention(q, k, v, method="hybrid", causal=c, candidates=m))
    return calls


def measure(n: int, candidates: list[int], blocked_max: int, rounds: int) -> dict[str, float]:
    """Median seconds per call at ``n``, keyed ``"name"`` or ``"name causal"``."""
    calls = _kernels(n, candidates, blocked_max)
    with torch.no_grad():
        for fn in calls.values():
            fn()  # warm-up: compile or cache load, first-touch memory
        times = {key: [] for key in calls}
        for r in range(rounds):
            order = list(calls) if r % 2 == 0 else list(calls)[::-1]
            for key in order:
                times[key].append(seconds(calls[key]))
    return {f"{name}{' causal' if causal else ''}": statistics.median(t) for (name, causal), t in times.items()}


def _errors(path: Path | None) -> dict[tuple[int, int], float]:
    """(N, candidates) -> mean error over the layers of ``long_fidelity.py``'s hybrid rows."""
    if path is None:
        return {}
    found = {}
    for n, res in json.loads(path.read_text())["results"].items():
        for row, r in res["rows"].items():
            if row == "hybrid (defaults)":
                found[int(n), candidate_count(HybridOptions())] = statistics.mean(r["per_layer"])
            elif row.startswith("hybrid (candidates="):
                found[int(n), int(row[len("hybrid (candidates="):-1])] = statistics.mean(r["per_layer"])
    return found


def markdown(res: dict) -> str:
    m = res["meta"]
    out = ["# hybrid's speed and error against its candidate count", "",
           f"Forward, B=1, H=8, D=64, float32, i.i.d. inputs, budget 64 (every option but `candidates` at its "
           f"default), {m['threads']} torch threads, {m['cpu']}, torch {m['torch']}, subquad at {m['source']}, "
           f"{m['date']}. Medians of {m['rounds']} rounds, calls interleaved within each N. Command: "
           f"`{m['command']}`. {m['note']}", "",
           "Speed: best dense kernel (SDPA or the blocked kernel, the faster) / hybrid. Error: "
           "`|out - exact|_F / |exact|_F` on SmolLM2-135M's causal attention, mean over 10 layers "
           f"(`{m['fidelity'] or 'not given'}`).", ""]
    for causal in (False, True):
        suffix = " causal" if causal else ""
        headers = ["N", "best dense (s)"] + [f"c={c}: s, speed" for c in res["candidates"]]
        rows = []
        for n, t in res["times"].items():
            best = min(t[f"{name}{suffix}"] for name in ("sdpa", "blocked") if f"{name}{suffix}" in t)
            cells = [f"{t[f'hybrid c={c}{suffix}']:.3f}, {best / t[f'hybrid c={c}{suffix}']:.2f}x"
                     for c in res["candidates"]]
            rows.append([n, f"{best:.3f}"] + cells)
        out += [f"## {'Causal' if causal else 'Non-causal'}", "", md_table(headers, rows), ""]
    if res["errors"]:
        out += ["## Error on SmolLM2 (causal)", "",
                md_table(["N"] + [f"c={c}" for c in res["candidates"]],
                         [[n] + [f"{res['errors'][n][str(c)]:.3f}" if str(c) in res["errors"][n] else "-"
                                 for c in res["candidates"]] for n in res["errors"]]), ""]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--candidates", type=int, nargs="+", default=[128, 64, 32])
    ap.add_argument("--blocked-max", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--fidelity", type=Path, default=None, help="long_fidelity.py's JSON with candidates rows")
    ap.add_argument("--note", default="")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    res = {"candidates": args.candidates, "times": {}, "errors": {}}
    for n in args.n:
        res["times"][n] = measure(n, args.candidates, args.blocked_max, args.rounds)
        print(n, res["times"][n], flush=True)
    for (n, c), err in sorted(_errors(args.fidelity).items()):
        res["errors"].setdefault(n, {})[str(c)] = err
    info = machine_info(torch.device("cpu"))
    res["meta"] = {"threads": info["threads"], "cpu": info["cpu"], "torch": info["torch"],
                   "source": source_state(Path(__file__).resolve().parent), "date": time.strftime("%Y-%m-%d"),
                   "rounds": args.rounds, "note": args.note, "fidelity": str(args.fidelity or ""),
                   "command": "python benchmarks/hybrid_candidates.py " + " ".join(sys.argv[1:])}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "hybrid_candidates.json").write_text(json.dumps(res, indent=1))
    (args.out / "hybrid_candidates.md").write_text(markdown(res))
    print(markdown(res))


if __name__ == "__main__":
    main()
