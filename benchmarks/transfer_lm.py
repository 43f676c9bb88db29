"""Perplexity of SmolLM2-135M-Instruct after attention transfer: a method's own parameters trained
to match exact attention layer by layer, then the model's next-token perplexity on held-out text.

    python benchmarks/transfer_lm.py --method hedgehog --out benchmarks/results      # resumable
    python benchmarks/transfer_lm.py --method hedgehog --texts 2 --length 128 --steps 2 --n 512 \
        --checkpoint /tmp/t.pt --out /tmp/tlm                                         # smoke run

Training text: ``--texts`` windows of ``--length`` tokens from ``smollm.long_text(...,
part="train")`` (numpy's and transformers' docstrings); evaluation text: the first N tokens of
``part="eval"`` (torch's), as in ``subquad compare --source smollm --perplexity``; never the standard
library's docstrings. The
teacher is the same model with exact attention (:func:`subquad.hf.transfer`: one pass caches
every layer's q, k, v and exact output; the student layers are trained on them independently,
Adam). ``hedgehog`` trains its feature maps; a method without parameters of its own gets per-head
q/k adapters. Reported per N: exact attention, the method zero-shot and after transfer
(perplexity over the window and its last quarter, ratios to exact, the share of greedy next tokens
equal to exact's), with the transfer's seconds and per-layer losses before and after. The
transferred parameters are saved with :func:`subquad.hf.save_retrofit` (``--artifact``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

import subquad.hf as H
from retrofit_lm import losses, markdown as lm_markdown, result_row
from subquad.data import smollm
from subquad.compare.common import machine_info, source_state
from subquad.data.pretrained import load_smollm


def training_texts(tokenizer, count: int, length: int) -> list[str]:
    """``count`` consecutive windows of ``length`` tokens of the training prose, as text."""
    ids = tokenizer(smollm.long_text(count * length + 16, tokenizer, part="train"))["input_ids"]
    return [tokenizer.decode(ids[i * length: (i + 1) * length]) for i in range(count)]


def evaluate(model, tokenizer, n: int, label: str, exact: dict | None) -> dict:
    """``model``'s perplexity row at N = ``n`` (with ratios to ``exact``'s, which holds ``pred``)."""
    ids = tokenizer(smollm.long_text(n, tokenizer, part="eval"), return_tensors="pt")["input_ids"][:, :n]
    loss, pred, seconds = losses(model, ids)
    row = result_row(label, loss, pred, seconds, exact)
    print(f"N={n} {label}: ppl {row['ppl']:.3f}", file=sys.stderr, flush=True)
    return row | {"pred": pred} if exact is None else row


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--method", default="hedgehog")
    p.add_argument("--n", type=int, nargs="+", default=[2048, 4096, 8192])
    p.add_argument("--texts", type=int, default=16, help="training windows")
    p.add_argument("--length", type=int, default=1024, help="tokens per training window")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--checkpoint", type=Path, default=None, help="default: runs/transfer_lm/METHOD.ckpt")
    p.add_argument("--artifact", type=Path, default=None, help="default: runs/transfer_lm/smollm-METHOD.pt")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args(argv)
    ckpt = args.checkpoint or Path("runs/transfer_lm") / f"{args.method}.ckpt"
    artifact = args.artifact or Path("runs/transfer_lm") / f"smollm-{args.method}.pt"
    start = time.perf_counter()
    tokenizer, model = load_smollm()
    exact = {n: evaluate(model, tokenizer, n, "exact (the model's own attention)", None) for n in args.n}
    H.retrofit(model, args.method)
    rows = {n: [evaluate(model, tokenizer, n, f"{args.method} (zero-shot)", exact[n])] for n in args.n}
    texts = training_texts(tokenizer, args.texts, args.length)
    info = H.transfer(model, texts, tokenizer, steps=args.steps, lr=args.lr, batch_size=args.batch_size,
                      max_length=args.length, checkpoint=ckpt, checkpoint_every=10)
    H.save_retrofit(model, artifact, meta={"steps": args.steps, "texts": args.texts, "length": args.length})
    print(f"transfer: {info['seconds']:.0f} s, mean layer loss {_mean(info['loss_after'])}", file=sys.stderr,
          flush=True)
    for n in args.n:
        rows[n].append(evaluate(model, tokenizer, n, f"{args.method} (after transfer, {args.steps} steps)", exact[n]))
    results = {str(n): [{k: v for k, v in exact[n].items() if k != "pred"}, *rows[n]] for n in args.n}
    mach = machine_info(torch.device("cpu"))
    report = {"config": {"n": args.n, "method": args.method, "texts": args.texts, "length": args.length,
                         "steps": args.steps, "lr": args.lr, "batch_size": args.batch_size, "torch": mach["torch"],
                         "cpu": mach["cpu"], "threads": mach["threads"], "source": source_state(Path(__file__).parent),
                         "date": datetime.date.today().isoformat(), "seconds": time.perf_counter() - start,
                         "command": "python " + " ".join(["benchmarks/transfer_lm.py", *(argv or sys.argv[1:])])},
              "transfer": {k: info[k] for k in ("loss_before", "loss_after", "seconds", "cache_seconds", "parameters",
                                                "resumed_from")},
              "results": results}
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"transfer_lm_{args.method}"
    (args.out / f"{name}.json").write_text(json.dumps(report, indent=1) + "\n")
    title, _, _, rest = lm_markdown(report).split("\n", 3)  # its title and description replaced by this file's
    text = "\n".join(["# Perplexity after attention transfer: SmolLM2-135M-Instruct with subquad attention", "",
                      __doc__.split("\n\n", 2)[2].strip(), rest])
    resumed = f", resumed at step {info['resumed_from']}" if info["resumed_from"] else ""
    text += (f"\nTransfer: {args.texts} windows of {args.length} tokens, {args.steps} steps of {args.batch_size}, "
             f"lr {args.lr}; {info['parameters']} parameters; {info['seconds']:.0f} s ({info['cache_seconds']:.0f} s "
             f"caching the teacher{resumed}); mean layer loss {_mean(info['loss_before'])} before, "
             f"{_mean(info['loss_after'])} after.\n")
    (args.out / f"{name}.md").write_text(text)
    print(text)
    return report


def _mean(xs) -> str:
    return "-" if not xs else f"{sum(xs) / len(xs):.4f}"


if __name__ == "__main__":
    main()
