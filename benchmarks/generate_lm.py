"""Greedy generation of SmolLM2-135M-Instruct after a long prompt: hybrid decoding through its state
against the model's own attention.

    python benchmarks/generate_lm.py --out benchmarks/results                  # 8192-token prompt, 256 tokens
    python benchmarks/generate_lm.py --n 1024 --new 32 --out /tmp/gen          # smoke run

The prompt is the first N tokens of held-out English prose (``smollm.long_text(N, tokenizer,
part="eval")``, torch's docstrings, never the standard library's). Exact: ``model.generate`` with
transformers' DynamicCache, greedy. Then for each row, the model retrofitted zero-shot
(``subquad.hf.retrofit``) decodes through ``subquad.hf.StateCache`` (hybrid: the prefill by the
parallel op, each new token through the key index):

- **free-running**: its own greedy continuation; reported: the share of the positions where its
  token equals exact attention's, and the first position where they differ (after a difference the
  two texts are about different things, so this share mostly measures how long they agree);
- **teacher-forced**: fed exact attention's continuation token by token; reported: the share of
  positions where its greedy next token equals exact attention's (each position judged on the same
  history: the issue's "same tokens for >= 90 % of positions").

Also the median seconds per generated token of each (prefill excluded), and the start of both
continuations. ``--ppl-tokens K``: also the perplexity of the prompt's last K tokens read one at a
time through the row's cache after a prefill of the others (decoding as generation does, on text
the model did not write), against exact attention's over the same tokens.
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

import subquad.hf as H
from subquad.cli_base import parse_value
from subquad.data import smollm
from subquad.compare.common import machine_info, md_table, source_state
from subquad.data.pretrained import load_smollm


def _steps(model, ids: torch.Tensor, cache, feed: torch.Tensor | None, new: int) -> tuple[list[int], list[float]]:
    """Prefill ``ids`` into ``cache``, then ``new`` greedy steps: each step feeds the greedy token
    (``feed`` None) or ``feed``'s next token (teacher forcing). Returns the greedy tokens (one per
    step, the first from the prefill) and each step's seconds."""
    tokens, seconds = [], []
    with torch.no_grad():
        logits = model(input_ids=ids, **{H.CACHE_ARGUMENT: cache}).logits[0, -1]
        tokens.append(int(logits.argmax()))
        for i in range(new - 1):
            nxt = tokens[-1] if feed is None else int(feed[i])
            start = time.perf_counter()
            logits = model(input_ids=torch.tensor([[nxt]]), **{H.CACHE_ARGUMENT: cache}).logits[0, -1]
            seconds.append(time.perf_counter() - start)
            tokens.append(int(logits.argmax()))
    return tokens, seconds


def decode_losses(model, ids: torch.Tensor, cache, k: int) -> torch.Tensor:
    """Next-token losses ``(k,)`` of the last ``k`` tokens of ``ids``: a prefill of the others into
    ``cache``, then one token per call."""
    n = ids.shape[1]
    out = []
    with torch.no_grad():
        logits = model(input_ids=ids[:, : n - k], **{H.CACHE_ARGUMENT: cache}).logits[0, -1:]
        for t in range(n - k, n):
            out.append(torch.nn.functional.cross_entropy(logits.float(), ids[0, t: t + 1]))
            if t + 1 < n:
                logits = model(input_ids=ids[:, t: t + 1], **{H.CACHE_ARGUMENT: cache}).logits[0, -1:]
    return torch.stack(out)


def _ppl_rows(model, ids: torch.Tensor, rows, k: int) -> list[dict]:
    """Perplexity of the last ``k`` tokens: exact (one forward) and each row through its cache."""
    import math

    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, -k - 1: -1].float()
    exact = torch.nn.functional.cross_entropy(logits, ids[0, -k:], reduction="none")
    out = [{"method": "exact (the model's own attention)", "ppl": math.exp(exact.mean().item())}]
    for method, options in rows:
        H.retrofit(model, method, **options)
        try:
            loss = decode_losses(model, ids, H.decoding_cache(model), k)
        finally:
            H.unretrofit(model)
        out.append({"method": _label(method, options), "options": options, "ppl": math.exp(loss.mean().item())})
        out[-1]["ppl_ratio"] = out[-1]["ppl"] / out[0]["ppl"]
        print(f"{method} decoding the last {k} tokens: ppl x{out[-1]['ppl_ratio']:.4f}", file=sys.stderr, flush=True)
    return out


def measure(model, ids: torch.Tensor, rows, new: int, tokenizer) -> dict:
    from transformers import DynamicCache

    exact, exact_s = _steps(model, ids, DynamicCache(), None, new)
    print(f"exact: {statistics.median(exact_s) * 1e3:.1f} ms/token", file=sys.stderr, flush=True)
    target = torch.tensor(exact)
    out = {"exact": {"tokens": exact, "s_per_token": statistics.median(exact_s),
                     "text": tokenizer.decode(exact[:60])}, "rows": []}
    for method, options in rows:
        label = _label(method, options)
        H.retrofit(model, method, **options)
        try:
            free, free_s = _steps(model, ids, H.decoding_cache(model), None, new)
            forced, _ = _steps(model, ids, H.decoding_cache(model), target, new)
        finally:
            H.unretrofit(model)
        same = [a == b for a, b in zip(free, exact)]
        row = {"method": label, "free_same": sum(same) / new, "first_difference": same.index(False) if not all(same)
               else None, "forced_same": sum(a == b for a, b in zip(forced, exact)) / new,
               "s_per_token": statistics.median(free_s), "tokens": free, "text": tokenizer.decode(free[:60])}
        out["rows"].append(row)
        print(f"{label}: teacher-forced {100 * row['forced_same']:.1f} %, free {100 * row['free_same']:.1f} % "
              f"(first difference {row['first_difference']}), {row['s_per_token'] * 1e3:.1f} ms/token",
              file=sys.stderr, flush=True)
    return out


def markdown(report: dict) -> str:
    c, r = report["config"], report["results"]
    body = [["exact (the model's own attention)", "100.0", "100.0", "-", f"{r['exact']['s_per_token'] * 1e3:.1f}"]]
    body += [[row["method"], f"{100 * row['forced_same']:.1f}", f"{100 * row['free_same']:.1f}",
              str(row["first_difference"]), f"{row['s_per_token'] * 1e3:.1f}"] for row in r["rows"]]
    lines = ["# Greedy generation after a long prompt: SmolLM2-135M-Instruct with subquad attention", "",
             __doc__.split("\n\n", 2)[2].strip(), "",
             f"Prompt: {c['n']} tokens; {c['new']} generated. subquad at {c['source']}; torch {c['torch']}, "
             f"{c['cpu']}, {c['threads']} threads, {c['date']}, {c['seconds']:.0f} s. Command: `{c['command']}`", "",
             md_table(["attention", "same token, teacher-forced %", "same token, free-running %",
                       "first difference", "ms / token"], body), "",
             f"Exact attention's continuation starts: {json.dumps(r['exact']['text'])}", ""]
    lines += [f"{row['method']}'s: {json.dumps(row['text'])}" for row in r["rows"]]
    if r.get("decode_ppl"):
        k = c["ppl_tokens"]
        lines += ["", f"## Perplexity of the prompt's last {k} tokens, decoded one at a time", "",
                  md_table(["attention", "perplexity", "vs exact"],
                           [[row["method"], f"{row['ppl']:.3f}", f"{row.get('ppl_ratio', 1.0):.4f}"]
                            for row in r["decode_ppl"]])]
    return "\n".join(lines) + "\n"


def _label(method: str, options: dict) -> str:
    return method + (f" ({', '.join(f'{k}={v}' for k, v in options.items())})" if options else " (defaults)")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=8192, help="prompt tokens")
    p.add_argument("--new", type=int, default=256, help="tokens generated (at least 1)")
    p.add_argument("--rows", nargs="+", default=["hybrid"], metavar="METHOD[:NAME=VALUE,...]")
    p.add_argument("--ppl-tokens", type=int, default=0, metavar="K",
                   help="also the perplexity of the prompt's last K tokens decoded one at a time")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args(argv)
    rows = [(spec.partition(":")[0], {k: parse_value(v) for k, _, v in (pair.partition("=") for pair in
                                     spec.partition(":")[2].split(",") if pair)}) for spec in args.rows]
    start = time.perf_counter()
    tokenizer, model = load_smollm()
    ids = tokenizer(smollm.long_text(args.n, tokenizer, part="eval"), return_tensors="pt")["input_ids"][:, :args.n]
    results = measure(model, ids, rows, args.new, tokenizer)
    if args.ppl_tokens:
        results["decode_ppl"] = _ppl_rows(model, ids, rows, args.ppl_tokens)
    info = machine_info(torch.device("cpu"))
    report = {"config": {"n": args.n, "new": args.new, "ppl_tokens": args.ppl_tokens, "rows": [[m, o] for m, o in rows],
                         "torch": info["torch"],
                         "cpu": info["cpu"], "threads": info["threads"], "source": source_state(Path(__file__).parent),
                         "date": datetime.date.today().isoformat(), "seconds": time.perf_counter() - start,
                         "command": "python " + " ".join(["benchmarks/generate_lm.py", *(argv or sys.argv[1:])])},
              "results": results}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "generate_lm.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.out / "generate_lm.md").write_text(markdown(report))
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
