"""Should hybrid give the key blocks it leaves out one summary key each? Measured on SmolLM2's real
causal attention.

    python benchmarks/hybrid_summaries.py --n 4096 8192 --out benchmarks/results

The RetroInfer-style estimate (arXiv 2505.02922; hybrid's retired per-query estimator did the same
per group of keys): every complete key block before the query block that its selection leaves out
enters the same softmax as one pseudo-key, its mean key with logit ``scale q . mean(k) + log(size)``
and its mean value, so the unselected mass is estimated instead of dropped. Inputs: SmolLM2-135M's
q, k, v (``subquad.data.smollm.cached_capture``, layers 0, 3, ..., 27, 9 heads), causal, scale
1/8; the selection is hybrid's at the given options (``subquad.ops.hybrid.select_blocks``).
Error: ``|out - exact|_F / |exact|_F`` per layer over all heads, dense float32 per head.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

from subquad.data import smollm
from subquad.compare.common import md_table
from subquad.ops.hybrid import HybridOptions, select_blocks


def head_outputs(q, k, v, sel_index, sel_valid, qb, kb, scale):
    """Per head (q (N, D), k (M, D), v (M, Dv)): exact causal attention, the selected keys alone, and
    the selected keys plus one summary key per left-out complete past block."""
    N, M = q.shape[0], k.shape[0]
    nq, nk = -(-N // qb), -(-M // kb)
    logits = (q @ k.T) * scale
    causal = torch.ones(N, M, dtype=torch.bool).tril()
    exact = torch.softmax(logits.masked_fill(~causal, float("-inf")), -1) @ v
    chosen = torch.zeros(nq, nk, dtype=torch.bool)
    for i in range(nq):
        chosen[i, sel_index[i][sel_valid[i]]] = True
    allowed = chosen.repeat_interleave(qb, 0)[:N].repeat_interleave(kb, 1)[:, :M] & causal
    # the diagonal blocks: every key at or after the query block's first position is the causal op's
    first = (torch.arange(N) // qb) * qb
    allowed |= causal & (torch.arange(M)[None, :] >= first[:, None])
    sparse = torch.softmax(logits.masked_fill(~allowed, float("-inf")), -1) @ v
    complete = M // kb
    kmean = k[: complete * kb].view(complete, kb, -1).mean(1)
    vmean = v[: complete * kb].view(complete, kb, -1).mean(1)
    past_complete = (torch.arange(complete)[None, :] + 1) * kb <= first[:, None]  # wholly before the block
    left_out = past_complete & ~chosen.repeat_interleave(qb, 0)[:N, :complete]
    slog = (q @ kmean.T) * scale + torch.log(torch.tensor(float(kb), dtype=q.dtype))
    both = torch.cat([logits.masked_fill(~allowed, float("-inf")), slog.masked_fill(~left_out, float("-inf"))], 1)
    weights = torch.softmax(both, -1)
    summarised = weights[:, :M] @ v + weights[:, M:] @ vmean
    return exact, sparse, summarised


def measure(n: int, options: HybridOptions, layers) -> dict:
    cap = smollm.cached_capture(n, layers)
    rows = {"selected keys only": [], "plus one summary key per left-out block": []}
    for i in range(len(layers)):
        q, k, v = (cap[name][i][0].float() for name in ("q", "k", "v"))
        scale = cap.get("scale", 0.125)
        sel = select_blocks(q[None].float(), k[None].float(), True, scale, query_block=options.query_block,
                            key_block=options.key_block, num_blocks=options.num_blocks, sinks=options.sinks,
                            local=options.local, score=options.score)
        num = {name: 0.0 for name in rows}
        den = 0.0
        for h in range(q.shape[0]):
            exact, sparse, summ = head_outputs(q[h], k[h], v[h], sel.index[0, h], sel.valid[0, h],
                                               options.query_block, options.key_block, scale)
            den += float(exact.pow(2).sum())
            num["selected keys only"] += float((sparse - exact).pow(2).sum())
            num["plus one summary key per left-out block"] += float((summ - exact).pow(2).sum())
        for name in rows:
            rows[name].append((num[name] / den) ** 0.5)
        print(f"N={n} layer {layers[i]}: " + ", ".join(f"{name} {rows[name][-1]:.4f}" for name in rows),
              file=sys.stderr, flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--num-blocks", type=int, nargs="+", default=[16])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    layers = smollm.default_layers()
    start = time.perf_counter()
    report = {"command": "python benchmarks/hybrid_summaries.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "date": datetime.date.today().isoformat(), "layers": layers, "results": []}
    for n in args.n:
        for nb in args.num_blocks:
            rows = measure(n, HybridOptions(num_blocks=nb), layers)
            report["results"].append({"n": n, "num_blocks": nb, "errors": rows})
    report["seconds"] = time.perf_counter() - start
    body = [[str(r["n"]), str(r["num_blocks"]), name, f"{sum(e) / len(e):.4f}", " ".join(f"{x:.3f}" for x in e)]
            for r in report["results"] for name, e in r["errors"].items()]
    text = ["# hybrid: summary keys for the left-out blocks, on SmolLM2's attention", "",
            __doc__.split("\n\n")[2].strip(), "",
            f"Command: `{report['command']}` ({report['date']}, {report['seconds']:.0f} s). Other options: "
            "hybrid's defaults (128-query and 128-key blocks, 1 sink, 1 local, score mean).", "",
            md_table(["N", "num_blocks", "keys", "mean error", "per layer (0, 3, ..., 27)"], body), ""]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "hybrid_summaries.md").write_text("\n".join(text))
    (args.out / "hybrid_summaries.json").write_text(json.dumps(report, indent=2) + "\n")
    print("\n".join(text))


if __name__ == "__main__":
    main()
