"""MQAR (multi-query associative recall, Zoology) for every method: train the grid, then report it.

    python benchmarks/mqar.py run --max-minutes 120        # resumable: finished runs are skipped
    python benchmarks/mqar.py report                         # table + plot into docs/results.md

``run`` trains each (method, sequence length) of the grid with ``subquad.train`` and the ``mqar``
preset into ``runs/mqar/<method>/n<L>/``, on samples whose number of pairs is drawn from
:data:`TRAIN_PAIRS` (as Zoology trains on a mixture), then tests the best-validation model at
each of :data:`PAIRS` pairs (``recall.json``). ``results.json``, ``metrics.csv`` and
``recall.json`` are committed, model files are not; cheapest lengths first. ``--max-minutes``
bounds the whole call: the run in progress then stops with a checkpoint that the next call
resumes, so the grid can be done in slices across sessions. ``report`` reads every finished run.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import subquad
from subquad.tasks import make_task
from subquad.train import TrainConfig, evaluate_model, load_model, train

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "runs" / "mqar"
DOC = ROOT / "docs" / "results.md"  # its section between the MARKS
PLOT = ROOT / "docs" / "results_mqar.png"
MARKS = ("<!-- mqar: written by benchmarks/mqar.py report -->", "<!-- mqar end -->")
LENGTHS = (256, 512, 1024)
PAIRS = (16, 32, 64)  # tested
TRAIN_PAIRS = (4, 8, 16, 32, 64)  # trained on
# the protocol: the preset "mqar" (2 layers, dim 64, 1 head, a width-3 short conv before each
# mixer) with these overrides; validation at 64 pairs
PROTOCOL = dict(batch_size=32, lr=1e-3, steps=2000, eval_every=250, log_every=250, checkpoint_every=250)
TASK = dict(vocab_size=256, eval_size=500, num_pairs=64, train_pairs=TRAIN_PAIRS)
# hybrid's defaults (16 blocks of 128 keys) attend to every key at these lengths: 32-key blocks
# make it sparse (at 1024 tokens a query attends to 6 of 32 key blocks plus its own block's keys)
METHOD_OPTIONS = {"hybrid": {"query_block": 32, "key_block": 32, "num_blocks": 4}}


def task_options(n: int) -> dict:
    """The task of the run at N: beyond the shortest length, training samples take the lengths up
    to N in turn (at N = 512, 2000 steps of samples of 512 tokens alone left softmax at 1.1 % on 64
    pairs, the 1/P plateau; Zoology trains on several lengths too)."""
    lengths = tuple(m for m in LENGTHS if m <= n)
    return {**TASK, "seq_len": n, **({"train_lengths": lengths} if len(lengths) > 1 else {})}


def methods() -> list[str]:
    return [m.name for m in subquad.list_methods()]


def run_dir(method: str, n: int) -> Path:
    return RUNS / method / f"n{n}"


def run(args: argparse.Namespace) -> None:
    deadline = time.monotonic() + 60 * args.max_minutes
    for n, method in [(n, m) for n in args.lengths for m in args.methods]:
        out = run_dir(method, n)
        if (out / "recall.json").is_file():
            continue
        left = (deadline - time.monotonic()) / 60
        if left < 0.5:
            print("out of time: run again to continue", flush=True)
            return
        print(f"== {method} n={n} ({left:.0f} min left)", flush=True)
        cfg = TrainConfig.from_preset("mqar", method=method, method_options=METHOD_OPTIONS.get(method, {}),
                                      task_options=task_options(n), out_dir=str(out),
                                      pad_to=max(LENGTHS), resume=True, max_minutes=left, threads=args.threads,
                                      progress=False, tensorboard=False, **PROTOCOL)
        if train(cfg).get("stopped"):
            return
        _test_pairs(out)


def _test_pairs(out: Path) -> None:
    """Test the best-validation model at each of :data:`PAIRS` pairs into ``recall.json``; the
    model files (0.7 MB each) then go."""
    model, cfg, _ = load_model(out / "best.pt")
    recall = {}
    for pairs in PAIRS:
        task = make_task("mqar", {**cfg.task_options, "num_pairs": pairs})
        _, accuracy, n = evaluate_model(model, cfg, task.load("", None).test)
        recall[str(pairs)] = {"accuracy": accuracy, "queries": n}
        print(f"   {pairs} pairs: {100 * accuracy:.1f} %", flush=True)
    (out / "recall.json").write_text(json.dumps(recall, indent=2) + "\n")
    for name in ("model.pt", "best.pt"):
        (out / name).unlink(missing_ok=True)


def _finished() -> dict[tuple[str, int, int], float]:
    """``(method, N, pairs) -> test accuracy`` of every finished run."""
    out = {}
    for path in sorted(RUNS.glob("*/n*/recall.json")):
        r = json.loads((path.parent / "results.json").read_text())
        for pairs, cell in json.loads(path.read_text()).items():
            out[(r["method"], r["task_options"]["seq_len"], int(pairs))] = cell["accuracy"]
    return out


def report(args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = _finished()
    names = [m for m in methods() if any(k[0] == m for k in done)]
    head = "| method | " + " | ".join(f"N={n} P={p}" for n in LENGTHS for p in PAIRS) + " |"
    lines = [head, "|---" * (1 + len(LENGTHS) * len(PAIRS)) + "|"]
    for m in names:
        cells = [f"{100 * done[(m, n, p)]:.1f}" if (m, n, p) in done else "-"
                 for n in LENGTHS for p in PAIRS]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    fig, axes = plt.subplots(1, len(LENGTHS), figsize=(4 * len(LENGTHS), 3.4), sharey=True)
    for ax, n in zip(axes, LENGTHS):
        for m in names:
            xs = [p for p in PAIRS if (m, n, p) in done]
            if xs:
                ax.plot(xs, [100 * done[(m, n, p)] for p in xs], marker="o", label=m)
        ax.set(title=f"N = {n}", xlabel="key-value pairs", xscale="log", xticks=list(PAIRS))
        ax.set_xticklabels([str(p) for p in PAIRS])
    axes[0].set_ylabel("test accuracy over queries (%)")
    axes[-1].legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(PLOT, dpi=110)
    runs = [json.loads(p.read_text()) for p in sorted(RUNS.glob("*/n*/results.json"))
            if (p.parent / "recall.json").is_file()]
    seconds = sum(r["train_seconds"] for r in runs)
    section = (
        "# MQAR: which methods can recall\n\n"
        "Multi-query associative recall (Zoology, Arora et al. 2023; `subquad.tasks.mqar`): N tokens start "
        "with P key-value pairs, then every key appears once more and the model must name its value. Test "
        "accuracy over the queries (%, best-validation model; chance 0.8 %) of the 2-layer encoder (dim 64, "
        "1 head, a width-3 causal short convolution before each mixer as in Zoology's models) with each "
        "method at its default options (" + "; ".join(f"{m}: {o}" for m, o in METHOD_OPTIONS.items())
        + f"), trained once per N on samples of {'/'.join(map(str, TRAIN_PAIRS))} "
        "pairs (and of the lengths up to N in turn, beyond N = 256) "
        f"({PROTOCOL['steps']} steps of batch {PROTOCOL['batch_size']}, lr {PROTOCOL['lr']}, vocabulary "
        f"{TASK['vocab_size']}) and tested at each P on {TASK['eval_size']} samples ({len(runs)} runs, "
        f"{seconds / 3600:.1f} h of training on one CPU thread each).\n\n" + "\n".join(lines)
        + "\n\n![accuracy against pairs](results_mqar.png)\n\n"
        "Command: `python benchmarks/mqar.py run --max-minutes M` (resumable; "
        "runs in `runs/mqar/METHOD/nN/`), then `python benchmarks/mqar.py report`.\n")
    text = DOC.read_text()
    if MARKS[0] in text:
        text = text[:text.index(MARKS[0])] + text[text.index(MARKS[1]) + len(MARKS[1]):].lstrip("\n")
    DOC.write_text(text.rstrip("\n") + f"\n\n{MARKS[0]}\n{section}{MARKS[1]}\n")
    print(section)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="train the grid (resumable)")
    r.add_argument("--methods", nargs="+", default=methods())
    r.add_argument("--lengths", nargs="+", type=int, default=list(LENGTHS))
    r.add_argument("--max-minutes", type=float, default=60.0)
    r.add_argument("--threads", type=int, default=1)
    r.set_defaults(func=run)
    sub.add_parser("report", help="table and plot of the finished runs").set_defaults(func=report)
    args = p.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
