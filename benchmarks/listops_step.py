"""Seconds per ListOps training step: published padding against length buckets, float32 against bf16.

    python benchmarks/listops_step.py --data out/data/listops --out benchmarks/results

For each method (the options of the committed runs in runs/listops/), one process, one thread
(as the training runs use), the same 4 training batches of 32 samples drawn by each pipeline's
sampler (seed 0, first steps of the run): ``pad`` pads every batch to 2048 tokens (the published
pipeline), ``bucket`` pads each batch of similar lengths to its longest sample rounded up to 64.
A step is forward, backward and the AdamW update of the ``nystromformer`` preset's model in train
mode. Rounds are interleaved (method x pipeline x autocast, then again), and each cell is the
median over rounds and batches. Writes ``listops_step.md`` and ``listops_step.json`` into --out
and, with --doc, the table into docs/results.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from subquad.models.encoder import cross_entropy
from subquad.tasks import listops
from subquad.train.sampler import BucketBatchSampler, ShardedBatchSampler
from subquad.train import TrainConfig, build_model
from subquad.train.config import pad_multiple

# The options of the runs in runs/listops/ (docs/results.md).
RUN_OPTIONS = {
    "softmax": {}, "linear": {}, "efficient": {}, "performer": {"num_features": 256},
    "nystrom": {"num_landmarks": 64, "conv_kernel_size": 35}, "lara": {"num_landmarks": 64},
    "sinkhorn": {"block_size": 64}, "hamburger": {},
}


def _config(method: str, batching: str, amp: str) -> TrainConfig:
    return TrainConfig.from_preset("nystromformer", method=method, method_options=RUN_OPTIONS[method],
                                   attention_dropout=0.0, batching=batching, amp=amp)


def _batches(data: listops.ListOpsDataset, cfg: TrainConfig, count: int):
    if cfg.batching == "bucket":
        sampler = BucketBatchSampler(data.data.lengths(), cfg.batch_size, seed=0, cap=cfg.pad_to)
    else:
        sampler = ShardedBatchSampler(len(data), cfg.batch_size, seed=0)
    return [data.batch(next(sampler), cfg.pad_to, pad_multiple(cfg)) for _ in range(count)]


def _step_seconds(model, optimizer, batch, amp: str) -> float:
    tokens, pad, labels = batch
    t0 = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp == "bf16"):
        logits = model(tokens, pad)
    loss = cross_entropy(logits, labels)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="out/data/listops")
    parser.add_argument("--methods", nargs="+", default=list(RUN_OPTIONS), choices=list(RUN_OPTIONS))
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--doc", type=Path, default=None,
                        help="also write the table between the listops-step markers of this file (docs/results.md)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    data = listops.ListOpsDataset(listops.load_splits(args.data, ("train",))["train"])
    settings = [("pad", "none"), ("bucket", "none"), ("bucket", "bf16")]
    cells = {}
    for method in args.methods:
        for batching, amp in settings:
            cfg = _config(method, batching, amp)
            torch.manual_seed(0)
            model, _ = build_model(cfg, torch.device("cpu"))
            model.train()
            optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)
            batches = _batches(data, cfg, args.batches)
            _step_seconds(model, optimizer, batches[0], amp)  # warm-up
            cells[method, batching, amp] = {"model": model, "optimizer": optimizer, "batches": batches,
                                            "times": [], "tokens": [b[0].numel() for b in batches],
                                            "real": [int((~b[1]).sum()) for b in batches]}
    for r in range(args.rounds):
        for key, cell in cells.items():
            for batch in cell["batches"]:
                cell["times"].append(_step_seconds(cell["model"], cell["optimizer"], batch, key[2]))
            print(f"round {r}: {key} {statistics.median(cell['times']):.3f} s/step", flush=True)
    rows = []
    for method in args.methods:
        pad, bucket, bf16 = (statistics.median(cells[method, b, a]["times"]) for b, a in settings)
        padded = sum(cells[method, "bucket", "none"]["tokens"])
        real = sum(cells[method, "bucket", "none"]["real"])
        rows.append({"method": method, "options": RUN_OPTIONS[method], "pad_s": pad, "bucket_s": bucket,
                     "bucket_bf16_s": bf16, "bucket_speedup": pad / bucket, "bf16_speedup": bucket / bf16,
                     "bucket_padding_fraction": 1 - real / padded,
                     "pad_padding_fraction": 1 - sum(cells[method, "pad", "none"]["real"])
                     / sum(cells[method, "pad", "none"]["tokens"])})
    lines = ["| method | pad 2048 (s/step) | bucket (s/step) | bucket + bf16 (s/step) | bucket speed-up | "
             "bf16 speed-up | padding: pad / bucket |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['pad_s']:.2f} | {r['bucket_s']:.2f} | {r['bucket_bf16_s']:.2f} | "
                     f"{r['bucket_speedup']:.1f}x | {r['bf16_speedup']:.2f}x | "
                     f"{100 * r['pad_padding_fraction']:.0f}% / {100 * r['bucket_padding_fraction']:.0f}% |")
    table = "\n".join(lines)
    print(table)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = {"command": "python benchmarks/listops_step.py " + " ".join(
                    f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
                    for k, v in vars(args).items() if v is not None),
                "torch": torch.__version__, "threads": args.threads, "machine": platform.machine(),
                "batches": args.batches, "rounds": args.rounds}
        (args.out / "listops_step.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
        (args.out / "listops_step.md").write_text(
            f"# Seconds per ListOps training step\n\n`{meta['command']}` (torch {meta['torch']}, "
            f"{args.threads} thread(s); median of {args.rounds} interleaved rounds x {args.batches} batches)\n\n"
            + table + "\n")
    if args.doc is not None:
        begin, end = "<!-- listops-step:begin -->", "<!-- listops-step:end -->"
        text = args.doc.read_text()
        head, rest = text.split(begin, 1)
        tail = rest.split(end, 1)[1]
        source = f"`{meta['command']}`" if args.out is not None else "`python benchmarks/listops_step.py`"
        args.doc.write_text(head + begin + "\n" + table + "\n\nWritten by " + source + " (median of "
                            f"{args.rounds} interleaved rounds x {args.batches} batches, one thread).\n" + end + tail)


if __name__ == "__main__":
    main()
