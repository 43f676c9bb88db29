"""``subquad train report RUNS``: the tables and the figure of a folder of training runs.

A run is a directory holding the ``metrics.csv`` that :mod:`subquad.train.trainer` writes (and,
once finished, its ``results.json``): every such directory under ``RUNS``, or with ``glob`` those
that the pattern matches relative to ``RUNS`` (``*``: the top level alone). A run's *group* is the
path of its parent under ``RUNS`` (``same/hamburger`` for ``RUNS/same/hamburger/seed0``); its
*name* is its own path with a trailing seed (``/seedK`` or ``-seedK``) removed, and its seed K (0
without one): ``linear-seed1`` is seed 1 of ``linear``.

Tables:

- ``groups`` (default): one row per group, one column per run directory name: the test metric of
  each finished run's final model, the mean and the spread (max - min) over the finished runs, or,
  for a run still going, its step and last validation value. With ``sweep`` (a JSON file of each
  run, ``{value: scores}``, as ``subquad evaluate --sweep NAME=... --json FILE`` writes it): one
  column per run directory name and swept value (MQAR: the recall of each method at each length
  and number of pairs), no mean.
- ``runs``: one row per run: steps, the test metric of the final and of the best-validation model,
  the best validation value (its step), the last validation loss ("(prior)" within 0.01 nats of the
  entropy of the training labels, where ``results.json`` records them), the median seconds per
  step over the logged windows and the wall time; then, for every name run with several seeds, the
  best and the median over its finished seeds.

The test metrics are those of ``results.json`` (the trainer's test of ``model.pt`` and ``best.pt``)
or, with :func:`evaluate_runs`, those files evaluated again as ``subquad evaluate`` does. The metric
is the task's own: ``miou`` where the runs record it (segmentation), else ``accuracy``. Rows follow
the registry's order of methods (a path part naming a method), then natural order (``n256`` before
``n1024``).

The figure: every run's validation curve (one panel per top-level folder of the names, one colour
per name, one line style per seed), or with ``sweep`` the metric against the swept value (one
panel per run directory name, one line per group). :func:`write_between_markers` puts a table into
a document between ``<!-- MARKER:begin -->`` and ``<!-- MARKER:end -->``.
"""

from __future__ import annotations

import csv
import json
import math
import re
import statistics
from pathlib import Path
from typing import Any, Callable

__all__ = ["collect_runs", "evaluate_runs", "report_markdown", "runs_table", "sweep_table", "plot_curves",
           "plot_sweep", "write_between_markers", "write_report"]

_SEED = re.compile(r"(?:^|[-/])seed(\d+)$")


def _name_and_seed(label: str) -> tuple[str, int]:
    """``linear-seed1`` -> ``("linear", 1)``, ``same/ham/seed0`` -> ``("same/ham", 0)``, ``x`` -> ``("x", 0)``."""
    found = _SEED.search(label)
    return (label[:found.start()] or ".", int(found.group(1))) if found else (label, 0)


def _natural(text: str) -> tuple:
    return tuple((0, int(c), "") if c.isdigit() else (1, 0, c) for c in re.split(r"(\d+)", text) if c)


def _order(methods: list[str]) -> Callable[[str], tuple]:
    """Sort key of a path: per part, the registry index of the method it names, then natural order."""
    def key(path: str) -> tuple:
        parts = path.split("/")
        return tuple((methods.index(p) if p in methods else len(methods), _natural(p))
                     for p in (_name_and_seed(part)[0] for part in parts)) + (tuple(_natural(path)),)
    return key


def _entropy(distribution: list[float] | None) -> float | None:
    return -sum(p * math.log(p) for p in distribution if p > 0) if distribution else None


def _seconds_per_step(rows: list[dict[str, str]], batch: int | None) -> float | None:
    """Median over the logged training windows of ``batch / samples_per_s``; ``batch`` (None: the
    median of samples per step of the windows)."""
    train = [r for r in rows if r.get("split") == "train" and r.get("samples_per_s")]
    if batch is None:
        steps = [int(r["step"]) for r in rows if r.get("split") == "train"]
        ratios = [int(r["samples"]) / (s - p) for r, s, p in zip(train, steps, [0, *steps]) if s > p]
        batch = statistics.median(ratios) if ratios else None
    rates = [batch / float(r["samples_per_s"]) for r in train if float(r["samples_per_s"]) > 0] if batch else []
    return statistics.median(rates) if rates else None


def _read_run(path: Path, metric: str, sweep: str | None) -> dict[str, Any]:
    with (path / "metrics.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    val = [r for r in rows if r.get("split") == "val" and r.get(metric) not in (None, "")]
    run: dict[str, Any] = {
        "curve": [(int(r["step"]), float(r[metric])) for r in val],
        "last_loss": float(val[-1]["loss"]) if val else None,
        "steps": max((int(r["step"]) for r in rows), default=0), "total": None, "test": None, "test_best": None,
        "seconds": None, "wall": max((float(r["elapsed_s"]) for r in rows if r.get("elapsed_s")), default=0.0),
        "method": None, "prior": None, "majority": None, "sweep": None, "path": path.as_posix()}
    batch = None
    if (path / "results.json").is_file():
        res = json.loads((path / "results.json").read_text())
        run.update(test=res.get(f"test_{metric}"), test_best=res.get(f"test_{metric}_best_val"),
                   total=res.get("steps"), seconds=res.get("train_seconds"), wall=res.get("wall_seconds", run["wall"]),
                   method=res.get("method"), prior=_entropy(res.get("train_label_distribution")),
                   majority=res.get("majority_test_accuracy"))
        batch = (res.get("config") or {}).get("batch_size")
    run["s_per_step"] = _seconds_per_step(rows, batch)
    if sweep and (path / sweep).is_file():
        run["sweep"] = {value: scores[metric] for value, scores in json.loads((path / sweep).read_text()).items()}
    return run


def collect_runs(root: str | Path, glob: str | None = None, sweep: str | None = None) -> dict[str, Any]:
    """Every run under ``root`` (``glob``: the run directories it matches under ``root``):
    ``{"root", "metric", "sweep", "groups": {group: {directory name: run}}}``, groups and runs in
    report order, each run with ``curve`` (validation), ``steps`` (done), ``total`` (of a finished
    run), ``label`` (its path under ``root``), ``name``, ``seed``, and when finished ``test`` and
    ``test_best`` (the final and best-validation models' test metric), ``seconds``, ``wall``;
    ``sweep``: the file of each run read as ``{value: metric}``."""
    import subquad

    root = Path(root)
    found = root.rglob("metrics.csv") if glob is None else (p / "metrics.csv" for p in root.glob(glob))
    paths = sorted({p.parent for p in found if p.is_file()})
    if not paths:
        raise FileNotFoundError(f"no training runs (metrics.csv) under {root}{f' matching {glob!r}' if glob else ''}")
    with (paths[0] / "metrics.csv").open(newline="") as f:
        metric = "miou" if "miou" in (csv.DictReader(f).fieldnames or []) else "accuracy"
    key = _order([m.name for m in subquad.list_methods()])
    groups: dict[str, dict[str, Any]] = {}
    for path in sorted(paths, key=lambda p: key(p.relative_to(root).as_posix())):
        run = _read_run(path, metric, sweep)
        run["label"] = path.relative_to(root).as_posix()
        run["name"], run["seed"] = _name_and_seed(run["label"])
        groups.setdefault(path.parent.relative_to(root).as_posix(), {})[path.name] = run
    return {"root": root.as_posix(), "metric": metric, "sweep": sweep, "groups": groups}


def _runs(runs: dict[str, Any]) -> list[dict[str, Any]]:
    return [run for members in runs["groups"].values() for run in members.values()]


def evaluate_runs(runs: dict[str, Any], data_dir: str | Path | None = None, device: str = "cpu",
                  log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """``test`` and ``test_best`` of every finished run from its ``model.pt`` and ``best.pt``
    evaluated on the test split as ``subquad evaluate`` does (``data_dir``: default
    ``out/data/TASK``); a finished run without them raises FileNotFoundError. Returns ``runs``."""
    from .evaluation import evaluate_checkpoint

    cache: dict = {}
    for run in _runs(runs):
        if run["test"] is None:
            continue
        for field, file in (("test", "model.pt"), ("test_best", "best.pt")):
            path = Path(run["path"]) / file
            if not path.is_file():
                raise FileNotFoundError(f"{path} does not exist: the run's model files are needed to evaluate it")
            if log is not None:
                log(f"evaluating {path}")
            run[field] = evaluate_checkpoint(path, data_dir=data_dir, device=device, cache=cache)[runs["metric"]]
    runs["evaluated"] = True
    return runs


def _metric_name(runs: dict[str, Any], short: bool = False) -> str:
    return "mIoU" if runs["metric"] == "miou" else "acc." if short else "accuracy"


def _cell(run: dict[str, Any]) -> str:
    if run["test"] is not None:
        return f"{100 * run['test']:.1f}"
    last = f", val {100 * run['curve'][-1][1]:.1f}" if run["curve"] else ""
    return f"(step {run['steps']}{last})"


def groups_table(runs: dict[str, Any]) -> str:
    """One row per group, one column per run directory name, then the mean and spread of the
    finished runs' test metric (%)."""
    names = sorted({name for group in runs["groups"].values() for name in group}, key=_natural)
    head = ["runs", *names, "mean", "spread", "finished"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for group, members in runs["groups"].items():
        done = [100 * r["test"] for r in members.values() if r["test"] is not None]
        cells = [_cell(members[n]) if n in members else "" for n in names]
        mean = f"{statistics.mean(done):.1f}" if done else ""
        spread = f"{max(done) - min(done):.1f}" if len(done) > 1 else ""
        lines.append("| " + " | ".join([group, *cells, mean, spread, f"{len(done)} of {len(members)}"]) + " |")
    return "\n".join(lines)


def _sweep_columns(runs: dict[str, Any]) -> list[tuple[str, str]]:
    """``(run directory name, swept value)`` of every column, in natural order."""
    names = sorted({name for group in runs["groups"].values() for name in group}, key=_natural)
    values = sorted({v for r in _runs(runs) for v in (r["sweep"] or {})}, key=_natural)
    return [(name, value) for name in names for value in values]


def sweep_table(runs: dict[str, Any], label: str = "") -> str:
    """One row per group, one column per run directory name and swept value (``label=value``):
    the metric (%) of each run's sweep file, ``-`` where there is none."""
    columns = _sweep_columns(runs)
    head = ["runs", *(f"{name} {label}={value}" if label else f"{name} {value}" for name, value in columns)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for group, members in runs["groups"].items():
        if not any(r["sweep"] for r in members.values()):
            continue
        cells = [(members.get(name) or {}).get("sweep") or {} for name, _ in columns]
        lines.append("| " + " | ".join([group, *(f"{100 * c[v]:.1f}" if v in c else "-"
                                                 for c, (_, v) in zip(cells, columns))]) + " |")
    return "\n".join(lines)


def _run_row(run: dict[str, Any]) -> str:
    last = ""
    if run["last_loss"] is not None:
        near_prior = run["prior"] is not None and abs(run["last_loss"] - run["prior"]) < 0.01
        last = f"{run['last_loss']:.4f}" + (" (prior)" if near_prior else "")
    best = max(run["curve"], key=lambda v: v[1]) if run["curve"] else None
    cells = [run["name"], str(run["seed"]), str(run["total"] if run["test"] is not None else run["steps"])]
    cells += [f"{100 * run[k]:.2f}" if run[k] is not None else "running" for k in ("test", "test_best")]
    cells += [f"{100 * best[1]:.2f} ({best[0]})" if best else "", last,
              f"{run['s_per_step']:.2f}" if run["s_per_step"] else "", f"{run['wall'] / 3600:.1f} h"]
    return "| " + " | ".join(cells) + " |"


def _seed_summary(runs: dict[str, Any]) -> list[str]:
    """For every name run with several seeds: the seeds finished, and the best and the median of
    the final and the best-validation models' test metric over them."""
    by_name: dict[str, list[dict[str, Any]]] = {}
    for run in _runs(runs):
        by_name.setdefault(run["name"], []).append(run)
    lines = []
    for name, members in by_name.items():
        if len(members) < 2:
            continue
        done = [r for r in members if r["test"] is not None]
        cells = []
        for key in ("test", "test_best"):
            values = [100 * r[key] for r in done if r[key] is not None]
            cells.append(f"{max(values):.2f} / {statistics.median(values):.2f}" if values else "-")
        seeds = ", ".join(str(r["seed"]) for r in done) or "none"
        lines.append(f"| {name} | {len(done)} of {len(members)} (seeds {seeds}) | {cells[0]} | {cells[1]} |")
    if not lines:
        return []
    metric = _metric_name(runs, short=True)
    return ["", "Over seeds (finished runs only; best / median):", "",
            f"| Run | Seeds finished | Test {metric} final | Test {metric} best val |", "|---|---|---|---|", *lines]


def runs_table(runs: dict[str, Any]) -> str:
    """One row per run (see the module's docstring), then the summary over seeds."""
    metric = _metric_name(runs, short=True)
    lines = [f"| Run | Seed | Steps | Test {metric} final | Test {metric} best val | Best val (step) | Last val loss | "
             "s / step | Wall time |", "|---|---|---|---|---|---|---|---|---|"]
    lines += [_run_row(run) for run in _runs(runs)]
    return "\n".join(lines + _seed_summary(runs))


def _intro(runs: dict[str, Any], table: str, sweep_label: str) -> str:
    metric = _metric_name(runs)
    source = "evaluated again as `subquad evaluate` does" if runs.get("evaluated") else "as results.json records it"
    if runs["sweep"]:
        swept = f"{sweep_label}=" if sweep_label else ""
        return (f"Test {metric} (%) of each run under `{runs['root']}` at each value ({swept}...) of its "
                f"`{runs['sweep']}`; one column per run directory and value.")
    if table == "runs":
        return (f"One row per run under `{runs['root']}`: the test {metric} (%) of the final and the best-validation "
                f"model ({source}), the best validation {metric} (step), the last validation loss, the median "
                "seconds per step and the wall time; then the best and median over seeds.")
    return (f"Test {metric} (%) of each run's final model under `{runs['root']}` ({source}; a run still going: its "
            f"step and last validation {metric}); mean and spread (max - min) over the finished runs.")


def report_markdown(runs: dict[str, Any], command: str = "", table: str = "groups", sweep_label: str = "",
                    intro: bool = True) -> str:
    """The table (``table``: ``groups`` or ``runs``; the sweep table when the runs were collected
    with ``sweep``), after a line saying what it holds and the command (``intro``)."""
    if table not in ("groups", "runs"):
        raise ValueError(f"table must be 'groups' or 'runs', got {table!r}")
    if runs["sweep"]:
        body = sweep_table(runs, sweep_label)
    else:
        body = runs_table(runs) if table == "runs" else groups_table(runs)
    if not intro:
        return body + "\n"
    head = [_intro(runs, table, sweep_label), *([f"Command: `{command}`"] if command else []), ""]
    return "\n".join([*head, body]) + "\n"


def write_between_markers(doc: str | Path, marker: str, text: str) -> Path:
    """Replace what stands between the lines ``<!-- MARKER:begin -->`` and ``<!-- MARKER:end -->``
    of ``doc`` with ``text``; ValueError when the file lacks them."""
    doc = Path(doc)
    content = doc.read_text()
    begin, end = f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->"
    if begin not in content or end not in content.split(begin, 1)[1]:
        raise ValueError(f"{doc} has no {begin} ... {end} to write the table between")
    head, rest = content.split(begin, 1)
    doc.write_text(head + begin + "\n" + text.rstrip("\n") + "\n" + end + rest.split(end, 1)[1])
    return doc


def _figure(panels: int, single: tuple[float, float]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    size = single if panels == 1 else (5.5 * panels, 4)
    fig, axes = plt.subplots(1, panels, figsize=size, squeeze=False, sharey=True)
    return plt, fig, axes[0]


def _save(plt, fig, path: str | Path, title: str | None) -> Path:
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def plot_curves(runs: dict[str, Any], path: str | Path, title: str | None = None,
                references: tuple[tuple[str, float], ...] = ()) -> Path:
    """Validation metric against step, every run; one panel per top-level folder of the names (one
    panel when the names have none), one colour per name, one line style per seed; a grey line at
    the majority class's test accuracy where the runs record it, and at each ``(label, percent)``
    of ``references``."""
    all_runs = _runs(runs)
    nested = any("/" in r["name"] for r in all_runs)
    panel_of = {r["label"]: r["name"].split("/")[0] if nested else "" for r in all_runs}
    panels = list(dict.fromkeys(panel_of.values()))
    plt, fig, axes = _figure(len(panels), (9.5, 5))
    cmap, styles = plt.get_cmap("tab10"), ["-", "--", ":", "-."]
    majority = {r["majority"] for r in all_runs if r["majority"] is not None}
    lines = [("majority class (test)", 100 * majority.pop(), "grey", ":")] if len(majority) == 1 else []
    lines += [(text, value, "black", "--") for text, value in references]
    for ax, panel in zip(axes, panels):
        members = [r for r in all_runs if panel_of[r["label"]] == panel]
        names = list(dict.fromkeys(r["name"] for r in members))
        for run in members:
            steps, values = zip(*run["curve"]) if run["curve"] else ((), ())
            label = run["label"][len(panel) + 1:] if panel else run["label"]
            ax.plot(steps, [100 * v for v in values], color=cmap(names.index(run["name"]) % 10), lw=1, alpha=0.85,
                    linestyle=styles[run["seed"] % len(styles)], label=label)
        for text, value, colour, style in lines:
            ax.axhline(value, color=colour, linestyle=style, linewidth=0.8, label=text)
        ax.set_xlim(0, max([r["total"] or r["steps"] for r in members], default=1))
        ax.set(title=panel or ("" if title else runs["root"]), xlabel="step")
        ax.grid(True, alpha=0.3)
        if len(panels) == 1:
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        else:
            ax.legend(fontsize=7, frameon=False)
    axes[0].set_ylabel(f"validation {_metric_name(runs)} (%)")
    return _save(plt, fig, path, title)


def plot_sweep(runs: dict[str, Any], path: str | Path, label: str = "", title: str | None = None) -> Path:
    """The metric of each run's sweep file against the swept value: one panel per run directory
    name, one line per group."""
    columns = _sweep_columns(runs)
    names = list(dict.fromkeys(name for name, _ in columns))
    values = list(dict.fromkeys(value for _, value in columns))
    numeric = all(re.fullmatch(r"-?\d+(\.\d*)?", v) for v in values)
    plt, fig, axes = _figure(len(names), (6, 4))
    cmap = plt.get_cmap("tab10" if len(runs["groups"]) <= 10 else "tab20")
    for ax, name in zip(axes, names):
        for i, (group, members) in enumerate(runs["groups"].items()):
            sweep = (members.get(name) or {}).get("sweep") or {}
            xs = [v for v in values if v in sweep]
            if xs:
                ax.plot([float(x) if numeric else x for x in xs], [100 * sweep[x] for x in xs], marker="o",
                        color=cmap(i % cmap.N), label=group)
        if numeric:
            ax.set(xscale="log", xticks=[float(v) for v in values])
            ax.minorticks_off()
            ax.set_xticklabels(values)
        ax.set(title=name, xlabel=label or "swept value")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel(f"test {_metric_name(runs)} (%)")
    axes[-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _save(plt, fig, path, title)


def write_report(root: str | Path, out: str | Path | None = None, command: str = "", *, table: str = "groups",
                 glob: str | None = None, sweep: str | None = None, sweep_label: str = "", evaluate: bool = False,
                 data_dir: str | Path | None = None, doc: str | Path | None = None, marker: str | None = None,
                 plot: str | Path | None = None, title: str | None = None,
                 references: tuple[tuple[str, float], ...] = (),
                 log: Callable[[str], None] | None = None) -> list[Path]:
    """The report of the runs under ``root`` (see the module's docstring for ``table``, ``glob``,
    ``sweep``; ``evaluate``: :func:`evaluate_runs` on ``data_dir``): with ``out``, ``OUT/report.md``
    and the figure ``OUT/val_curves.png`` (``OUT/sweep.png`` with ``sweep``); with ``doc`` and
    ``marker``, the table between the document's markers; the figure at ``plot`` when given.
    Returns the paths written."""
    if out is None and doc is None and plot is None:
        raise ValueError("nothing to write: give out, doc (with marker) or plot")
    if (doc is None) != (marker is None):
        raise ValueError("doc and marker go together")
    runs = collect_runs(root, glob, sweep)
    if evaluate:
        evaluate_runs(runs, data_dir, log=log)
    written = []
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.md").write_text(report_markdown(runs, command, table, sweep_label))
        written.append(out / "report.md")
        plot = plot if plot is not None else out / ("sweep.png" if sweep else "val_curves.png")
    if doc is not None:
        written.append(write_between_markers(doc, marker, report_markdown(runs, table=table, sweep_label=sweep_label,
                                                                          intro=False)))
    if plot is not None:
        written.append(plot_sweep(runs, plot, sweep_label, title) if sweep else plot_curves(runs, plot, title,
                                                                                           references))
    return written
