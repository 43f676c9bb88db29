"""``subquad train report RUNS``: the table and the validation curves of a folder of training runs.

A run is a directory holding the ``metrics.csv`` that :mod:`subquad.train.trainer` writes (and,
once finished, its ``results.json``). Runs are grouped by the path of their parent under ``RUNS``
(``same/hamburger`` for ``RUNS/same/hamburger/seed0``) and named by their own directory (the seed).
Per group: the test metric of every finished run (its final model, from ``results.json``), their
mean and their spread (max - min), or, for a run still going, its step and last validation value;
the figure draws every run's validation curve, one panel per top-level folder.

The metric is the task's own: ``miou`` where the runs record it (segmentation), else ``accuracy``.
"""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path
from typing import Any

__all__ = ["collect_runs", "report_markdown", "plot_curves", "write_report"]


def _curve(metrics: Path, metric: str) -> list[tuple[int, float]]:
    """``(step, value)`` of the validation rows of ``metrics.csv`` that hold ``metric``."""
    with metrics.open(newline="") as f:
        return [(int(r["step"]), float(r[metric])) for r in csv.DictReader(f)
                if r.get("split") == "val" and r.get(metric) not in (None, "")]


def collect_runs(root: str | Path) -> dict[str, Any]:
    """Every run under ``root``: ``{"metric", "groups": {group: {run: {...}}}}``, each run with
    ``curve`` (validation), ``steps`` (done), ``total`` (configured) and, when finished, ``test``
    (the final model's test metric) and ``seconds``."""
    root = Path(root)
    paths = sorted(p.parent for p in root.rglob("metrics.csv"))
    if not paths:
        raise FileNotFoundError(f"no training runs (metrics.csv) under {root}")
    with (paths[0] / "metrics.csv").open(newline="") as f:
        metric = "miou" if "miou" in (csv.DictReader(f).fieldnames or []) else "accuracy"
    groups: dict[str, dict[str, Any]] = {}
    for path in paths:
        curve = _curve(path / "metrics.csv", metric)
        with (path / "metrics.csv").open(newline="") as f:
            steps = max((int(r["step"]) for r in csv.DictReader(f)), default=0)
        run: dict[str, Any] = {"curve": curve, "steps": steps, "total": None, "test": None, "seconds": None}
        if (path / "results.json").is_file():
            res = json.loads((path / "results.json").read_text())
            run.update(test=res.get(f"test_{metric}"), total=res.get("steps"), seconds=res.get("train_seconds"))
        group = path.parent.relative_to(root).as_posix()
        groups.setdefault(group, {})[path.name] = run
    return {"root": root.as_posix(), "metric": metric, "groups": groups}


def _cell(run: dict[str, Any]) -> str:
    if run["test"] is not None:
        return f"{100 * run['test']:.1f}"
    last = f", val {100 * run['curve'][-1][1]:.1f}" if run["curve"] else ""
    return f"(step {run['steps']}{last})"


def report_markdown(runs: dict[str, Any], command: str = "") -> str:
    """The table: one row per group, one column per run name, then the mean and spread of the
    finished runs' test metric (%)."""
    names = sorted({name for group in runs["groups"].values() for name in group})
    head = ["runs", *names, "mean", "spread", "finished"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for group, members in sorted(runs["groups"].items()):
        done = [100 * r["test"] for r in members.values() if r["test"] is not None]
        cells = [_cell(members[n]) if n in members else "" for n in names]
        mean = f"{statistics.mean(done):.1f}" if done else ""
        spread = f"{max(done) - min(done):.1f}" if len(done) > 1 else ""
        lines.append("| " + " | ".join([group, *cells, mean, spread, f"{len(done)} of {len(members)}"]) + " |")
    metric = "mIoU" if runs["metric"] == "miou" else "accuracy"
    intro = (f"Test {metric} (%) of each run's final model under `{runs['root']}` (a run still going: its step "
             f"and last validation {metric}); mean and spread (max - min) over the finished runs.")
    return "\n".join([intro, *([f"Command: `{command}`"] if command else []), "", *lines]) + "\n"


def plot_curves(runs: dict[str, Any], path: str | Path) -> Path:
    """Validation metric against step, every run; one panel per top-level folder, one colour per
    group (its runs share it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({group.split("/")[0] for group in runs["groups"]})
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    cmap = plt.get_cmap("tab10")
    for ax, panel in zip(axes[0], panels):
        members = sorted(g for g in runs["groups"] if g.split("/")[0] == panel)
        for i, group in enumerate(members):
            for j, (_, run) in enumerate(sorted(runs["groups"][group].items())):
                steps, values = zip(*run["curve"]) if run["curve"] else ((), ())
                label = group.partition("/")[2] or group
                ax.plot(steps, [100 * v for v in values], color=cmap(i % 10), lw=1, alpha=0.8,
                        label=label if j == 0 else None)
        ax.set_title(panel, fontsize=9)
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, frameon=False)
    axes[0][0].set_ylabel(f"validation {'mIoU' if runs['metric'] == 'miou' else 'accuracy'} (%)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def write_report(root: str | Path, out: str | Path, command: str = "") -> list[Path]:
    """``report.md`` and ``val_curves.png`` of the runs under ``root`` into ``out``."""
    runs = collect_runs(root)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(report_markdown(runs, command))
    return [out / "report.md", plot_curves(runs, out / "val_curves.png")]
