"""``subquad data``, ``subquad train`` and ``subquad evaluate`` on a task, and their standalone form.

:func:`add_parser` registers the three commands for :func:`subquad.cli.main`; :func:`main` runs
them standalone (``python -m subquad.train.cli``, for ``torchrun``) from the same parsers::

    subquad data listops --out out/data/listops
    subquad train listops --method nystrom -o num_landmarks=64 -o conv_kernel_size=35
    subquad evaluate listops --checkpoint out/listops/nystrom/best.pt --split val
    subquad train mqar --method linear -t seq_len=512 -t num_pairs=32
    subquad evaluate mqar --checkpoint out/mqar/linear/best.pt --sweep num_pairs=16,32 --json recall.json
    subquad train report runs/mqar --sweep recall.json --sweep-label P --out out/mqar_report
    torchrun --nproc_per_node=2 -m subquad.train.cli train listops --method performer

``train`` and ``evaluate`` take every registered task (:func:`subquad.tasks.list_tasks`); task
options are ``-t NAME=VALUE``; ``data`` writes the files of a task that reads files (ListOps).

Method options are ``-o NAME=VALUE`` (repeatable; ``NAME`` may be qualified, ``nystrom.num_landmarks``),
values as :func:`subquad.cli_base.parse_value` reads them (``64``, ``0.5``, ``True``, ``None``, ``(8, 8)``,
else a string). The old trailing ``--name VALUE`` pairs (``--num-landmarks 64``) still work for one
release, with a deprecation notice on stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
import warnings
from pathlib import Path
from typing import Any

from ..cli_base import (add_option_argument, command_parser, deprecated, plain_text, run_command,
                        single_method_options, split_option)

__all__ = ["COMMAND_HELP", "add_parser", "add_data_parser", "add_train_parser", "add_evaluate_parser", "task_options",
           "method_options", "parse_method_options", "build_parser", "main"]

PROG = "python -m subquad.train.cli"


def _legacy_specs(extra: list[str]) -> list[str]:
    """The old trailing method options, ``["--num-landmarks", "64", "--flag=1"]``, as ``NAME=VALUE``
    specs (``["num_landmarks=64", "flag=1"]``)."""
    specs = []
    i = 0
    while i < len(extra):
        tok = extra[i]
        if not tok.startswith("--") or len(tok) == 2:
            raise ValueError(f"unexpected argument {tok!r}; method options are -o NAME=VALUE")
        name, sep, value = tok[2:].partition("=")
        if not sep:
            if i + 1 >= len(extra) or extra[i + 1].startswith("--"):
                raise ValueError(f"method option {tok} needs a value")
            value = extra[i + 1]
            i += 1
        specs.append(f"{name.replace('-', '_')}={value}")
        i += 1
    return specs


def method_options(args: argparse.Namespace) -> dict[str, Any]:
    """The method options of parsed ``train TASK`` arguments: ``-o``, then the deprecated
    trailing ``--name VALUE`` pairs (with a notice on stderr)."""
    extra = list(getattr(args, "extra_options", None) or [])
    legacy = _legacy_specs(extra)
    if legacy:
        deprecated(shlex.join(extra), " ".join(f"-o {shlex.quote(spec)}" for spec in legacy))
    return single_method_options([*args.option, *legacy], args.method)


def parse_method_options(pairs: list[str] | None = None, extra: list[str] | None = None) -> dict[str, Any]:
    """Deprecated: ``["num_landmarks=64"]`` and/or ``["--num-landmarks", "64"]`` -> options dict.
    Use :func:`subquad.cli_base.single_method_options`."""
    warnings.warn("subquad.train.cli.parse_method_options is deprecated: use subquad.cli_base.single_method_options",
                  DeprecationWarning, stacklevel=2)
    return {name: value for _, name, value in map(split_option, [*(pairs or []), *_legacy_specs(extra or [])])}


# command: (what it does, its description)
_COMMANDS = {
    "data": ("generate task data", "Generate the data files of a task that reads files."),
    "train": ("train an encoder on a task",
              "Train the encoder on a task. Options left unset take the preset's value. Run the same command "
              "under `torchrun --nproc_per_node=N` for DistributedDataParallel "
              "(--batch-size is the global batch)."),
    "evaluate": ("evaluate a trained model on a task",
                 "Rebuild the model from the config saved in a model file (model.pt, best.pt or checkpoint.pt of "
                 "a `train` run; read with weights_only), evaluate it on a split with the run's input pipeline and "
                 "task options, print the accuracy as a percentage (as train does), then one JSON object as the "
                 "last line of stdout (accuracy as a fraction, loss, n, the task's own scores such as a "
                 "segmentation's miou, method, step, split, checkpoint)."),
}
#: the commands of this module and their one-line help (``subquad --help`` reads it without the parsers,
#: which import the tasks and so torch)
COMMAND_HELP = {command: does for command, (does, _) in _COMMANDS.items()}


def _task_parsers(subparsers, command: str, tasks: tuple[str, ...] | None = None, more=None,
                  **kwargs: Any) -> list[argparse.ArgumentParser]:
    """``COMMAND TASK``: the command's parser and one sub-parser per task (default: every
    registered task), which it returns; ``more(sub)`` adds sub-commands that are not tasks."""
    from ..tasks import get_task, list_tasks

    tasks = tuple(list_tasks()) if tasks is None else tasks
    does, description = _COMMANDS[command]
    parser = subparsers.add_parser(command, help=f"{does} ({', '.join(tasks)})",
                                   description=f"{description}")
    sub = parser.add_subparsers(dest=f"{command}_task", metavar="TASK")
    sub.required = True
    if more is not None:
        more(sub)
    out = []
    for task in tasks:
        doc = " ".join(plain_text(get_task(task).__doc__ or task).split())
        p = sub.add_parser(task, help=doc.split(".")[0], description=f"{description} {doc}", **kwargs)
        p.set_defaults(subparser=p, task=task)
        out.append(p)
    return out


def add_parser(subparsers) -> None:
    """``data`` (ListOps), ``train`` and ``evaluate`` (every task)."""
    add_data_parser(subparsers)
    add_train_parser(subparsers)
    add_evaluate_parser(subparsers)


# --------------------------------------------------------------------------- data


def add_data_parser(subparsers) -> argparse.ArgumentParser:
    """``data listops``: generate the ListOps splits."""
    from ..tasks.listops import GeneratorConfig

    d = GeneratorConfig()
    (p,) = _task_parsers(subparsers, "data", ("listops",))
    p.add_argument("--out", default="out/data/listops", help="output directory (default: %(default)s)")
    p.add_argument("--train-size", type=int, default=96_000, help="default: %(default)s")
    p.add_argument("--val-size", type=int, default=2_000, help="default: %(default)s")
    p.add_argument("--test-size", type=int, default=2_000, help="default: %(default)s")
    p.add_argument("--seed", type=int, default=0, help="default: %(default)s")
    p.add_argument("--max-depth", type=int, default=d.max_depth, help="default: %(default)s")
    p.add_argument("--max-args", type=int, default=d.max_args, help="default: %(default)s")
    p.add_argument("--min-length", type=int, default=d.min_length,
                   help="keep lengths > this (default: %(default)s)")
    p.add_argument("--max-length", type=int, default=d.max_length,
                   help="keep lengths < this (default: %(default)s)")
    p.add_argument("--force", action="store_true", help="overwrite existing files")
    p.set_defaults(func=run_data_listops)
    return p


def run_data_listops(args: argparse.Namespace) -> int:
    from ..tasks import listops

    try:
        cfg = listops.GeneratorConfig(max_depth=args.max_depth, max_args=args.max_args,
                                      min_length=args.min_length, max_length=args.max_length)
        out = Path(args.out)
        paths = [listops.split_path(out, s) for s in listops.SPLITS]
        existing = [str(path) for path in paths if path.exists()]
        if existing and not args.force:
            raise ValueError(f"{existing} already exist; pass --force to overwrite")
        meta = listops.generate_and_write(out, train_size=args.train_size, val_size=args.val_size,
                                          test_size=args.test_size, seed=args.seed, config=cfg)
    except (ValueError, TypeError, OSError) as e:
        print(f"data listops: error: {e}", file=sys.stderr)
        return 2
    sizes = meta["sizes"]
    print(f"wrote {sizes['train']} train / {sizes['val']} val / {sizes['test']} test samples to {out} in "
          f"{meta['seconds']:.1f} s (generation {meta['generate_seconds']:.1f} s)")
    for split in listops.SPLITS:
        lengths = meta["length"].get(split) or {}
        dist = " ".join(f"{c}:{100 * p:.1f}%" for c, p in enumerate(meta["label_distribution"][split]))
        if lengths:
            print(f"  {split}: length {lengths['min']}..{lengths['max']} (mean {lengths['mean']:.0f}); "
                  f"labels {dist}")
    if "majority_class" in meta:
        print(f"majority class {meta['majority_class']}: {100 * meta['majority_test_accuracy']:.2f}% of test")
    return 0


# --------------------------------------------------------------------------- train


def add_train_parser(subparsers) -> list[argparse.ArgumentParser]:
    """``train TASK``: train the encoder with a method (works under ``torchrun``)."""
    from ..tasks import get_task
    from ..train.config import PRESETS

    parsers = _task_parsers(
        subparsers, "train", more=_add_report_parser, epilog="Method options: -o NAME=VALUE or -o METHOD.NAME=VALUE "
        "(repeatable), e.g. -o num_landmarks=64 -o conv_kernel_size=35. Task options: -t NAME=VALUE.")
    for p in parsers:
        task = p.get_default("task")
        p.add_argument("--method", required=True,
                       help="a registered method (subquad.list_methods()), or none: no token mixing")
        add_option_argument(p, "num_landmarks=64")
        p.add_argument("-t", "--task-option", action="append", default=[], metavar="NAME=VALUE",
                       help="a task option (repeatable), e.g. -t num_pairs=32")
        preset = get_task(task).preset
        p.add_argument("--preset", default=preset, choices=sorted(PRESETS),
                       help="the model and optimisation values of the options left unset (default: %(default)s)")
        _add_data_argument(p, task)
        p.add_argument("--out", default=None, help=f"run directory (default: out/{task}/METHOD)")
        _add_model_arguments(_PresetGroup(p.add_argument_group(
            f"model and optimisation (default: the value of --preset; shown: preset {preset})"), preset))
        _add_run_arguments(p.add_argument_group("run"), preset)
        # accepts_extra: the deprecated trailing --name VALUE method options reach run_train
        p.set_defaults(func=run_train, accepts_extra=True)
    return parsers


def _add_report_parser(sub) -> None:
    """``train report RUNS``: the tables and figures of finished and running runs (subquad.train.report)."""
    p = sub.add_parser("report", help="the table and validation curves of a folder of runs",
                       description="The table and the figure of the training runs under RUNS (subquad.train.report). "
                       "--table groups (default): each run's test metric, mean and spread per group of seeds (a run "
                       "still going: its step and last validation value); --table runs: one row per run, test metric "
                       "of the final and best-validation model, best validation, last validation loss, s/step, wall "
                       "time, then best and median over seeds. --sweep FILE: the metric at each value of each run's "
                       "FILE (`subquad evaluate --sweep ... --json FILE`), e.g. MQAR's recall by pairs. The figure: "
                       "every validation curve, or with --sweep the metric against the swept value.")
    p.add_argument("runs", type=Path, metavar="RUNS", help="a folder of run directories, e.g. runs/digit_scenes")
    p.add_argument("--out", type=Path, help="write report.md and the figure (val_curves.png, or sweep.png) here")
    p.add_argument("--table", choices=("groups", "runs"), default="groups", help="default: %(default)s")
    p.add_argument("--glob", metavar="PATTERN", help="only the run directories matching PATTERN under RUNS "
                   "(e.g. '*': the top level); default: every directory with a metrics.csv")
    p.add_argument("--sweep", metavar="FILE", help="a table of the metric at each value in each run's FILE, "
                   "e.g. recall.json")
    p.add_argument("--sweep-label", default="", metavar="TEXT", help="the swept option's name in the column "
                   "heads, e.g. P (columns 'n256 P=16')")
    p.add_argument("--evaluate", action="store_true", help="test metrics from model.pt and best.pt evaluated again "
                   "as `subquad evaluate` does (default: results.json's)")
    p.add_argument("--data", help="with --evaluate: the data directory of a task that reads files "
                   "(default: out/data/TASK)")
    p.add_argument("--doc", type=Path, metavar="FILE", help="write the table into FILE between "
                   "<!-- MARKER:begin --> and <!-- MARKER:end --> (with --marker)")
    p.add_argument("--marker", metavar="NAME", help="the marker name of --doc")
    p.add_argument("--plot", type=Path, metavar="FILE", help="the figure's path (default: in --out)")
    p.add_argument("--title", help="the figure's title")
    p.add_argument("--reference", action="append", default=[], metavar="LABEL=PERCENT",
                   help="a horizontal line on the validation curves (repeatable), e.g. 'published (37.10)=37.10'")
    p.set_defaults(func=run_report, subparser=p, task=None)


def run_report(args: argparse.Namespace) -> int:
    from .report import write_report

    if not args.runs.is_dir():
        args.subparser.error(f"RUNS {str(args.runs)!r} is not a directory")
    if args.out is None and args.doc is None and args.plot is None:
        args.subparser.error("give --out DIR, --doc FILE --marker NAME or --plot FILE")
    references = []
    for spec in args.reference:
        label, sep, value = spec.rpartition("=")
        try:
            references.append((label, float(value)))
        except ValueError:
            sep = ""
        if not sep or not label:
            args.subparser.error(f"--reference {spec!r} is not LABEL=PERCENT")
    try:
        paths = write_report(args.runs, args.out, _report_command(args),
                             table=args.table, glob=args.glob, sweep=args.sweep, sweep_label=args.sweep_label,
                             evaluate=args.evaluate, data_dir=args.data, doc=args.doc, marker=args.marker,
                             plot=args.plot, title=args.title, references=tuple(references),
                             log=lambda line: print(line, file=sys.stderr, flush=True))
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        args.subparser.error(str(e))
    print("\n".join(f"wrote {p}" for p in paths))
    return 0


def _report_command(args: argparse.Namespace) -> str:
    """The ``subquad train report`` command line of parsed arguments, for report.md."""
    words = ["subquad", "train", "report", str(args.runs)]
    for flag, value in (("--table", None if args.table == "groups" else args.table), ("--glob", args.glob),
                        ("--sweep", args.sweep), ("--sweep-label", args.sweep_label or None), ("--data", args.data),
                        ("--out", args.out), ("--doc", args.doc), ("--marker", args.marker), ("--plot", args.plot),
                        ("--title", args.title), *(("--reference", r) for r in args.reference)):
        words += [] if value is None else [flag, str(value)]
    return shlex.join(words + (["--evaluate"] if args.evaluate else []))


def _add_data_argument(p: argparse.ArgumentParser, task: str) -> None:
    """``--data DIR`` for a task that reads files; a task that generates its data in memory gets
    the same default without the argument (its ``data_hint`` is empty)."""
    from ..tasks import make_task

    default = f"out/data/{task}"
    try:
        reads_files = bool(make_task(task, {}).data_hint(default))
    except (ValueError, TypeError):  # a task without default options: offer the argument
        reads_files = True
    if reads_files:
        p.add_argument("--data", default=default, help="data directory (default: %(default)s)")
    else:
        p.set_defaults(data=default)


class _PresetGroup:
    """An argument group for options that default to None (unset: the chosen ``--preset``'s value),
    whose help states the value of ``preset``, the task's own."""

    def __init__(self, group, preset: str):
        from ..train.config import TrainConfig

        self.group, self.preset = group, preset
        self.values = dataclasses.asdict(TrainConfig.from_preset(preset))

    def add_argument(self, flag: str, *args: Any, field: str | None = None, **kwargs: Any) -> None:
        if "default" in kwargs:  # an option of its own, not the preset's
            self.group.add_argument(flag, *args, **kwargs)
            return
        value = self.values[field or flag.lstrip("-").replace("-", "_")]
        shown = "none" if value is None else " ".join(map(str, value)) if isinstance(value, (list, tuple)) else value
        text = f"default: {shown}, preset {self.preset}"
        self.group.add_argument(flag, *args, help=f"{kwargs.pop('help')} ({text})" if "help" in kwargs else text,
                                **kwargs)


def _add_model_arguments(g: _PresetGroup) -> None:
    from ..train.config import SCHEDULES

    g.add_argument("--layers", type=int)
    g.add_argument("--dim", type=int)
    g.add_argument("--heads", type=int)
    g.add_argument("--ffn-dim", type=int)
    g.add_argument("--positions", choices=("learned", "sinusoidal"))
    g.add_argument("--pooling", choices=("mean", "cls", "none"), help="summary of the sequence: mean of real "
                   "tokens, or a learned first token (LRA's CLS); none for a task with labels per position")
    g.add_argument("--conv-kernel-size", type=int, help="a causal depthwise conv of this width before each mixer "
                   "(0: none)")
    g.add_argument("--dropout", type=float)
    g.add_argument("--attn-dropout", type=float, field="attention_dropout",
                   help="dropout on attention weights (softmax only)")
    g.add_argument("--head-hidden", type=int, help="classifier hidden width (0: one linear layer)")
    g.add_argument("--batch-size", type=int, help="global batch size")
    g.add_argument("--lr", type=float)
    g.add_argument("--warmup-steps", type=int, help="learning-rate warm-up, at most half of --steps")
    g.add_argument("--schedule", choices=SCHEDULES)
    g.add_argument("--steps", type=int, help="optimizer updates")
    g.add_argument("--weight-decay", type=float)
    g.add_argument("--betas", type=float, nargs=2, metavar=("B1", "B2"))
    g.add_argument("--eps", type=float)
    g.add_argument("--grad-clip", type=float, help="max gradient norm")
    g.add_argument("--pad-to", type=int, help="longest sequence; longer ones are truncated")
    g.add_argument("--batching", choices=("bucket", "pad"), default="bucket",
                   help="bucket: batches of similar length, each padded to its longest sample; pad: the "
                        "published pipeline, uniform batches padded to --pad-to (default: %(default)s)")
    g.add_argument("--bucket-pool", type=int, default=64,
                   help="batches per pool sorted by length (default: %(default)s)")


def _add_run_arguments(r, preset: str) -> None:
    _PresetGroup(r, preset).add_argument("--eval-every", type=int, help="validate every K steps")
    r.add_argument("--eval-samples", type=int,
                   help="validate and test on the first N samples of each split (default: all)")
    r.add_argument("--checkpoint-every", type=int, default=500, help="default: %(default)s")
    r.add_argument("--log-every", type=int, default=50, help="default: %(default)s")
    r.add_argument("--seed", type=int, default=0, help="default: %(default)s")
    r.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    r.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="default: %(default)s")
    r.add_argument("--amp", default="none", choices=("none", "bf16"), help="autocast (default: %(default)s)")
    r.add_argument("--dtype", default="float32", choices=("float32", "float64"), help="default: %(default)s")
    r.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt if it exists")
    r.add_argument("--max-minutes", type=float,
                   help="stop after this much wall time, with a checkpoint; --resume continues later")
    r.add_argument("--init-from", metavar="PATH",
                   help="initial weights from another run's model file (best.pt, model.pt or checkpoint.pt) "
                        "with the same architecture, e.g. one trained on shorter inputs; optimiser and "
                        "schedule start afresh; ignored when --resume finds a checkpoint")
    r.add_argument("--context-parallel", type=int, default=1, metavar="N",
                   help="under torchrun: N processes split each sequence (context parallelism; the rest of the "
                        "processes are data parallel); tasks with labels per position, methods of "
                        "`subquad methods` with a sharded form (default: %(default)s)")
    r.add_argument("--no-progress", action="store_true", help="no progress bar (the log and evaluation lines stay)")
    r.add_argument("--tensorboard", action=argparse.BooleanOptionalAction, default=None,
                   help="TensorBoard logs (default: when installed)")


def task_options(specs: list[str]) -> dict[str, Any]:
    """``["num_pairs=32"]`` (the ``-t`` arguments) -> ``{"num_pairs": 32}``."""
    from ..cli_base import parse_value

    options = {}
    for spec in specs:
        name, sep, value = spec.partition("=")
        if not sep or not name:
            raise ValueError(f"task option {spec!r} is not NAME=VALUE")
        options[name.strip()] = parse_value(value)
    return options


def config_from_args(args: argparse.Namespace):
    """The :class:`TrainConfig` of parsed ``train TASK`` arguments."""
    from ..models.encoder import check_method
    from ..train.config import TrainConfig

    check_method(args.method)
    options = method_options(args)
    overrides = {
        "layers": args.layers, "dim": args.dim, "heads": args.heads, "ffn_dim": args.ffn_dim,
        "positions": args.positions, "pooling": args.pooling, "dropout": args.dropout,
        "conv_kernel_size": args.conv_kernel_size,
        "attention_dropout": args.attn_dropout,
        "head_hidden": args.head_hidden, "batch_size": args.batch_size, "lr": args.lr,
        "warmup_steps": args.warmup_steps, "schedule": args.schedule, "steps": args.steps,
        "weight_decay": args.weight_decay, "betas": tuple(args.betas) if args.betas else None,
        "eps": args.eps,
        "grad_clip": args.grad_clip, "pad_to": args.pad_to, "eval_every": args.eval_every,
        "batching": args.batching, "bucket_pool": args.bucket_pool,
    }
    return TrainConfig.from_preset(
        args.preset, task=args.task, task_options=task_options(args.task_option), method=args.method,
        method_options=options,
        data_dir=args.data, out_dir=args.out or f"out/{args.task}/{args.method}", eval_samples=args.eval_samples,
        checkpoint_every=args.checkpoint_every, log_every=args.log_every, seed=args.seed,
        threads=args.threads,
        device=args.device, amp=args.amp, dtype=args.dtype, resume=args.resume, max_minutes=args.max_minutes,
        progress=False if args.no_progress else None, tensorboard=args.tensorboard, init_from=args.init_from,
        context_parallel=args.context_parallel, **overrides)


def run_train(args: argparse.Namespace) -> int:
    from ..tasks import make_task
    from ..train.trainer import train
    from .evaluation import check_data

    try:
        cfg = config_from_args(args)
        cfg.validate()
        _check_model(cfg)
        check_data(make_task(cfg.task, cfg.task_options), cfg.data_dir)
        train(cfg)
    except (ValueError, TypeError, FileNotFoundError, NotImplementedError, FloatingPointError) as e:
        print(f"train {args.task}: error: {e}", file=sys.stderr)
        return 2
    return 0


def _check_model(cfg) -> None:
    """Build one tiny mixer with the method's options: bad options fail before any data is read."""
    from ..models.encoder import build_mixer

    build_mixer(cfg.method, cfg.dim, cfg.heads, **cfg.method_options)


# --------------------------------------------------------------------------- evaluate


def add_evaluate_parser(subparsers) -> list[argparse.ArgumentParser]:
    """``evaluate TASK``: accuracy of a saved model on a split."""
    parsers = _task_parsers(subparsers, "evaluate")
    for p in parsers:
        task = p.get_default("task")
        p.add_argument("--checkpoint", required=True, help="model file of a run")
        _add_data_argument(p, task)
        p.add_argument("--split", default="test", choices=("val", "test"), help="default: %(default)s")
        p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
        p.add_argument("--device", default="cpu", help="default: %(default)s")
        p.add_argument("--no-progress", action="store_true", help="no progress bar")
        p.add_argument("-t", "--task-option", action="append", default=[], metavar="NAME=VALUE",
                       help="evaluate with this task option changed from the run's (repeatable), e.g. -t num_pairs=32")
        p.add_argument("--sweep", metavar="NAME=V1,V2,...",
                       help="evaluate at each value of one task option, e.g. --sweep num_pairs=16,32,64: one line "
                            "per value, then the JSON object {value: scores}")
        p.add_argument("--json", metavar="FILE", help="also write the last line's JSON object to FILE (with "
                       "--sweep: what `subquad train report --sweep FILE` reads, e.g. RUN/recall.json)")
        p.set_defaults(func=run_evaluate)
    return parsers


def run_evaluate(args: argparse.Namespace) -> int:
    import json

    import torch

    from ..tasks import get_task
    from .evaluation import evaluate_checkpoint, parse_sweep, sweep_checkpoint

    try:
        if args.threads is not None:
            if args.threads <= 0:
                raise ValueError(f"--threads must be positive, got {args.threads}")
            torch.set_num_threads(args.threads)
        progress = not args.no_progress
        if progress:
            try:
                import tqdm  # noqa: F401
            except ImportError:
                progress = False
        kwargs = dict(data_dir=args.data, split=args.split, task_options=task_options(args.task_option),
                      task=args.task, device=args.device, progress=progress)
        task = get_task(args.task)
        if args.sweep:
            option, values = parse_sweep(args.sweep)
            out = sweep_checkpoint(args.checkpoint, option, values, **kwargs)
            lines = [f"{option}={value}: {_scores_line(task, args.split, s)}" for value, s in out.items()]
        else:
            out = evaluate_checkpoint(args.checkpoint, **kwargs)
            lines = [f"{_scores_line(task, args.split, out)} ({out['method']}, step {out['step']})"]
            out = {k: v for k, v in out.items() if k != "task_options"}
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    except (ValueError, TypeError, FileNotFoundError, RuntimeError, KeyError) as e:
        print(f"evaluate {args.task}: error: {e}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    print(json.dumps(out))
    return 0


def _scores_line(task, split: str, scores: dict[str, Any]) -> str:
    """``test accuracy 37.65%, loss 1.6973 on 2000 samples``, with the task's own scores."""
    shown = "".join(f", {name} {100 * scores[name]:.2f}%" for name in task.scores)
    return (f"{split} accuracy {100 * scores['accuracy']:.2f}%{shown}, loss {scores['loss']:.4f} on {scores['n']} "
            f"{'labels' if task.per_token else 'samples'}")


# --------------------------------------------------------------------------- standalone


def build_parser() -> argparse.ArgumentParser:
    """The standalone parser: ``data``, ``train`` and ``evaluate`` alone, from :func:`add_parser`."""
    return command_parser(PROG, "subquad task data and training", [add_parser])


def main(argv: list[str] | None = None) -> int:
    """``python -m subquad.train.cli ARGV``: these commands run as ``subquad`` runs them."""
    return run_command(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
