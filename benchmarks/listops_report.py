"""The ListOps results table and validation curves, from the committed runs in runs/listops/.

    python benchmarks/listops_report.py --runs runs/listops --data out/data/listops
    python benchmarks/listops_report.py --runs runs/listops-curriculum --marker listops-curriculum \
        --plot docs/listops_curriculum_val_accuracy.png --title "LRA ListOps, warm-started from short ListOps"

For every run directory (``METHOD`` is seed 0, ``METHOD-seedK`` seed K): steps done, the
validation curve from ``metrics.csv``, and, for a finished run, the test accuracy of ``model.pt``
(final) and of ``best.pt`` (best validation) as ``subquad evaluate listops`` prints it: the
command runs in a subprocess and its last stdout line is parsed, so the table holds exactly
what anyone re-running the command gets. Writes the table between the markers
``<!-- MARKER:begin -->`` and ``<!-- MARKER:end -->`` of ``--doc`` (``--marker``, default
``listops-runs``) and the figure ``--plot`` (validation accuracy against step, every run).
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
from pathlib import Path

from tqdm import tqdm

LABEL_ENTROPY = 2.2491  # nats, of the training labels (docs/results.md)


def _rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _evaluate(checkpoint: Path, data: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "subquad.train.cli", "evaluate", "listops", "--checkpoint",
                           str(checkpoint), "--data", data, "--split", "test", "--no-progress"],
                          capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _run(directory: Path, data: str, evaluate: bool) -> dict:
    rows = _rows(directory / "metrics.csv")
    val = [(int(r["step"]), float(r["accuracy"]), float(r["loss"])) for r in rows if r["split"] == "val"]
    train = [r for r in rows if r["split"] == "train"]
    step_s = [32 / float(r["samples_per_s"]) for r in train if r["samples_per_s"]]  # batch 32
    name = directory.name
    method, _, seed = name.partition("-seed")
    out = {"name": name, "method": method, "seed": int(seed or 0), "val": val,
           "steps": max([int(r["step"]) for r in rows], default=0),
           "elapsed_s": max([float(r["elapsed_s"]) for r in rows if r["elapsed_s"]], default=0.0),
           "s_per_step": statistics.median(step_s) if step_s else None, "finished": False}
    results_path = directory / "results.json"
    if results_path.is_file():
        results = json.loads(results_path.read_text())
        out.update(finished=True, steps=results["steps"], wall_s=results["wall_seconds"],
                   options=results["method_options"], trainer_final=results["test_accuracy"],
                   trainer_best=results["test_accuracy_best_val"], best_val=results["best_val_accuracy"],
                   best_val_step=results["best_val_step"])
        if evaluate:
            out["final"] = _evaluate(directory / "model.pt", data)
            out["best"] = _evaluate(directory / "best.pt", data)
    return out


def _table(runs: list[dict]) -> str:
    lines = ["| Method | Seed | Steps | Test acc. final | Test acc. best val (`subquad evaluate`) | Best val (step) | "
             "Last val loss | s / step | Wall time |", "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        last_loss = ""
        if r["val"]:  # "(prior)": within 0.01 of the label entropy, i.e. still on the plateau
            loss = r["val"][-1][2]
            last_loss = f"{loss:.4f}" + (" (prior)" if abs(loss - LABEL_ENTROPY) < 0.01 else "")
        best = max(r["val"], key=lambda v: v[1]) if r["val"] else None
        best_cell = f"{100 * best[1]:.2f} ({best[0]})" if best else ""
        step_s = f"{r['s_per_step']:.2f}" if r["s_per_step"] else ""
        wall = f"{r.get('wall_s', r['elapsed_s']) / 3600:.1f} h"
        if r["finished"] and "final" in r:
            final, best_eval = f"{100 * r['final']['accuracy']:.2f}", f"{100 * r['best']['accuracy']:.2f}"
            steps = str(r["steps"])
        else:
            final = best_eval = "running"
            steps = f"{r['steps']} of 5000"
        lines.append(f"| {r['method']} | {r['seed']} | {steps} | {final} | {best_eval} | {best_cell} | {last_loss} | "
                     f"{step_s} | {wall} |")
    return "\n".join(lines)


def _seed_summary(runs: list[dict]) -> str:
    """Every method run with more than one seed: how many seeds finished, and the best and the
    median test accuracy over them (``subquad evaluate``, final and best-validation models)."""
    by_method: dict[str, list[dict]] = {}
    for r in runs:
        by_method.setdefault(r["method"], []).append(r)
    lines = []
    for method, rs in by_method.items():
        if len(rs) < 2:
            continue
        done = [r for r in rs if r["finished"] and "final" in r]
        cells = []
        for key in ("final", "best"):
            acc = [100 * r[key]["accuracy"] for r in done]
            cells.append(f"{max(acc):.2f} / {statistics.median(acc):.2f}" if acc else "-")
        seeds = ", ".join(str(r["seed"]) for r in done) or "none"
        lines.append(f"| {method} | {len(done)} of {len(rs)} (seeds {seeds}) | {cells[0]} | {cells[1]} |")
    if not lines:
        return ""
    head = ["", "", "Over seeds (finished runs only; best / median):", "",
            "| Method | Seeds finished | Test acc. final | Test acc. best val |", "|---|---|---|---|"]
    return "\n".join(head + lines)


def _plot(runs: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9.5, 5))
    methods = list(dict.fromkeys(r["method"] for r in runs))
    colours = plt.get_cmap("tab10")
    styles = ["-", "--", ":"]  # seed 0, 1, 2: one colour per method
    for r in runs:
        if r["val"]:
            steps, acc, _ = zip(*r["val"])
            ax.plot(steps, [100 * a for a in acc], marker=".", markersize=3, label=r["name"],
                    color=colours(methods.index(r["method"]) % 10), linestyle=styles[r["seed"] % len(styles)])
    ax.axhline(17.15, color="grey", linestyle=":", label="majority class (test)")
    ax.axhline(37.10, color="black", linestyle="--", linewidth=0.8, label="published softmax (37.10)")
    ax.set_xlabel("training step")
    ax.set_ylabel("validation accuracy (%)")
    ax.set_xlim(0, 5000)
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=Path, default=Path("runs/listops"))
    parser.add_argument("--data", default="out/data/listops")
    parser.add_argument("--doc", type=Path, default=Path("docs/results.md"))
    parser.add_argument("--plot", type=Path, default=Path("docs/listops_val_accuracy.png"))
    parser.add_argument("--marker", default="listops-runs", help="the table goes between <!-- MARKER:begin/end -->")
    parser.add_argument("--title", default="LRA ListOps, preset nystromformer, length-bucketed batches")
    parser.add_argument("--no-evaluate", action="store_true", help="skip subquad evaluate (table shows 'running')")
    args = parser.parse_args()
    order = ["softmax", "nystrom", "linear", "efficient", "performer", "lara", "sinkhorn", "hamburger"]
    dirs = sorted((d for d in args.runs.iterdir() if (d / "metrics.csv").is_file()),
                  key=lambda d: (order.index(d.name.partition("-seed")[0]) if d.name.partition("-seed")[0] in order
                                 else len(order), d.name))
    # subquad evaluate per run: minutes in all, so one line per run as it goes
    runs = [_run(d, args.data, not args.no_evaluate) for d in tqdm(dirs, desc="listops runs", unit="run")]
    table = _table(runs) + _seed_summary(runs)
    print(table)
    text = args.doc.read_text()
    begin, end = f"<!-- {args.marker}:begin -->", f"<!-- {args.marker}:end -->"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        args.doc.write_text(head + begin + "\n" + table + "\n" + end + tail)
    _plot(runs, args.plot, args.title)


if __name__ == "__main__":
    main()
