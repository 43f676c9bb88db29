"""Where the forward time of ``hybrid``'s torch path goes, and how it scales from one thread to two.

The torch path is what runs with gradients, on other devices and under ``torch.compile``; a CPU
call without autograd runs the compiled kernel instead (``hybrid_speed.md``), which this script
switches off.

    python benchmarks/hybrid_profile.py --out benchmarks/results        # N = 16384
    python benchmarks/hybrid_profile.py --n 2048 --rounds 2 --out /tmp/hp   # smoke run

Three measurements, B=1, D=64, float32, i.i.d. N(0, 1) inputs, default options, no grad:

1. **Stages** of one head on one thread (the unit the CPU path runs per worker thread): the
   time of each stage the op names for ``torch.profiler`` (``hybrid.index``: the key tree;
   ``hybrid.descend``: the descent; ``hybrid.summaries``; ``hybrid.attend``: per run of query
   blocks, the gathers, logits, leaf scores, top-k and softmax), median over ``--rounds``
   profiled calls, with the whole call's time unprofiled.
2. **Kernels** of the same call from ``torch.profiler``: the self time of the matrix products
   (``aten::bmm``, ``aten::mm``) against every op's, i.e. how much of the call is arithmetic the
   method must do and how much is selection, layout and elementwise work around it.
3. **Threads**: 8 heads on one thread and on two (heads spread over threads, as the op does), with
   SDPA timed the same way in the same rounds; the speed-ups are medians of interleaved rounds.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import subquad
import subquad.ops.hybrid as hybrid

#: the stages hybrid names with torch.profiler.record_function
STAGES = ["hybrid.index", "hybrid.descend", "hybrid.summaries", "hybrid.attend"]


def _inputs(heads: int, n: int):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, heads, n, 64, generator=g) for _ in range(3)]


def _call(q, k, v):
    with torch.no_grad():
        return subquad.attention(q, k, v, method="hybrid")


def stages(n: int, rounds: int) -> dict:
    """Seconds per stage (median over profiled rounds) and of the whole call (unprofiled), one
    head, one thread."""
    q, k, v = _inputs(1, n)
    per_round, totals = [], []
    torch.set_num_threads(1)
    _call(q, k, v)
    for _ in range(rounds):
        start = time.perf_counter()
        _call(q, k, v)
        totals.append(time.perf_counter() - start)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            _call(q, k, v)
        events = {e.key: e.cpu_time_total * 1e-6 for e in prof.key_averages() if e.key in STAGES}
        per_round.append(events)
    return {"total_s": statistics.median(totals),
            "stages_s": {name: statistics.median(r.get(name, 0.0) for r in per_round) for name in STAGES}}


def kernels(n: int) -> dict:
    """Self time of matrix products and of all ops in one profiled call (one head, one thread)."""
    q, k, v = _inputs(1, n)
    torch.set_num_threads(1)
    _call(q, k, v)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _call(q, k, v)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    products = sum(e.self_cpu_time_total for e in events if e.key in ("aten::bmm", "aten::mm"))
    ops = sum(e.count for e in events if e.key.startswith("aten::"))
    return {"products_fraction": products / total, "aten_calls": ops}


def threads(n: int, rounds: int) -> dict:
    """Seconds of 8 heads (hybrid and SDPA) on one and on two threads, interleaved rounds."""
    q, k, v = _inputs(8, n)
    times: dict[str, list[float]] = {}
    with torch.no_grad():
        for _ in range(rounds):
            for t in (1, 2):
                torch.set_num_threads(t)
                for name, fn in (("hybrid", lambda: subquad.attention(q, k, v, method="hybrid")),
                                 ("sdpa", lambda: F.scaled_dot_product_attention(q, k, v))):
                    fn()
                    start = time.perf_counter()
                    fn()
                    times.setdefault(f"{name}_{t}", []).append(time.perf_counter() - start)
    return {key: statistics.median(ts) for key, ts in times.items()}


def markdown(res: dict, meta: dict) -> str:
    st = res["stages"]
    lines = [
        "# hybrid: where the forward time goes",
        "",
        f"N = {meta['n']}, D = 64, float32, i.i.d. inputs, default options (budget 64), no grad; "
        f"{meta['machine']}, torch {meta['torch']}, {meta['date']}. Command: `{meta['command']}`. {meta['note']}",
        "",
        f"## Stages of one head on one thread ({1e3 * st['total_s']:.1f} ms per call)",
        "",
        "Stage times are from torch.profiler (its overhead included), the call's without it.",
        "",
        "| stage | ms | share of the call |",
        "|---|---|---|",
    ]
    for name in STAGES:
        s = st["stages_s"][name]
        lines.append(f"| `{name}` | {1e3 * s:.1f} | {100 * s / st['total_s']:.0f}% |")
    kr = res["kernels"]
    th = res["threads"]
    lines += [
        "",
        f"Matrix products (`aten::bmm`, `aten::mm`) are **{100 * kr['products_fraction']:.0f}%** of the profiled "
        f"self time; the call runs {kr['aten_calls']} aten ops.",
        "",
        "## 8 heads, one and two threads",
        "",
        "| threads | hybrid (s) | SDPA (s) | SDPA / hybrid |",
        "|---|---|---|---|",
    ]
    for t in (1, 2):
        h, s = th[f"hybrid_{t}"], th[f"sdpa_{t}"]
        lines.append(f"| {t} | {h:.3f} | {s:.3f} | {s / h:.2f}x |")
    lines += ["", f"Two threads make hybrid {th['hybrid_1'] / th['hybrid_2']:.2f}x faster and SDPA "
              f"{th['sdpa_1'] / th['sdpa_2']:.2f}x."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--note", default="")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    threads_before = torch.get_num_threads()
    with hybrid.torch_path():  # the torch path, whose stages torch.profiler sees
        res = {"stages": stages(args.n, args.rounds), "kernels": kernels(args.n)}
        torch.set_num_threads(threads_before)
        res["threads"] = threads(args.n, max(1, args.rounds // 2))
    meta = {"n": args.n, "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d"), "note": args.note,
            "command": f"python benchmarks/hybrid_profile.py --n {args.n} --rounds {args.rounds} --out {args.out}"}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "hybrid_profile.json").write_text(json.dumps({"meta": meta, **res}, indent=1))
    (args.out / "hybrid_profile.md").write_text(markdown(res, meta))
    print(markdown(res, meta))


if __name__ == "__main__":
    main()
