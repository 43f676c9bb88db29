"""Command line for data generation and training: ``data listops`` and ``train listops``.

``add_data_parser(subparsers)`` and ``add_train_parser(subparsers)`` add the sub-commands to an
argparse parser (``subquad data`` / ``subquad train``); each sets ``func`` so the caller runs
``args.func(args)``, which returns an exit status. ``main(argv)`` runs them standalone::

    python -m subquad.train.cli data listops --out out/data/listops
    python -m subquad.train.cli train listops --method nystrom -o num_landmarks=64 -o conv_kernel_size=35

Method options are ``-o NAME=VALUE`` (repeatable) or, through :func:`main` (which passes what
argparse does not know as ``args.extra_options``), trailing ``--name VALUE`` pairs such as
``--num-landmarks 64``. Values are Python literals (``64``, ``0.5``, ``True``, ``None``,
``(8, 8)``), anything else is a string.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path
from typing import Any

__all__ = ["add_data_parser", "add_train_parser", "add_evaluate_parser", "parse_method_options", "main"]


def _parse_value(text: str) -> Any:
    lowered = text.strip().lower()
    if lowered in ("none", "null"):
        return None
    if lowered in ("true", "false"):
        return lowered == "true"
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def parse_method_options(pairs: list[str] | None = None, extra: list[str] | None = None) -> dict[str, Any]:
    """``["num_landmarks=64"]`` and/or ``["--num-landmarks", "64", "--flag=1"]`` -> options dict."""
    out: dict[str, Any] = {}
    for pair in pairs or []:
        name, sep, value = pair.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"method option must be NAME=VALUE, got {pair!r}")
        out[name.strip().replace("-", "_")] = _parse_value(value)
    extra = list(extra or [])
    i = 0
    while i < len(extra):
        tok = extra[i]
        if not tok.startswith("--") or len(tok) == 2:
            raise ValueError(f"unexpected argument {tok!r}; method options are --name VALUE or -o NAME=VALUE")
        name, sep, value = tok[2:].partition("=")
        if not sep:
            if i + 1 >= len(extra) or extra[i + 1].startswith("--"):
                raise ValueError(f"method option {tok} needs a value")
            value = extra[i + 1]
            i += 1
        out[name.replace("-", "_")] = _parse_value(value)
        i += 1
    return out


# --------------------------------------------------------------------------- data


def add_data_parser(subparsers) -> argparse.ArgumentParser:
    """``data listops``: generate the ListOps splits."""
    from ..tasks.listops import GeneratorConfig

    d = GeneratorConfig()
    parser = subparsers.add_parser("data", help="generate task data (ListOps)",
                                   description="Generate task data.")
    tasks = parser.add_subparsers(dest="data_task", metavar="TASK")
    tasks.required = True
    p = tasks.add_parser("listops", help="LRA ListOps splits (seeded, deduplicated)",
                         description="Write basic_{train,val,test}.tsv (LRA format), a tokenised .npz cache "
                                     "and meta.json (label distribution, majority baseline) into --out.")
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
    return parser


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


def add_train_parser(subparsers) -> argparse.ArgumentParser:
    """``train listops``: train the encoder with a method (works under ``torchrun``)."""
    from ..train.trainer import PRESETS, SCHEDULES

    parser = subparsers.add_parser("train", help="train an encoder on a task (ListOps)",
                                   description="Train an encoder on a task.")
    tasks = parser.add_subparsers(dest="train_task", metavar="TASK")
    tasks.required = True
    p = tasks.add_parser(
        "listops", help="LRA ListOps classification",
        description="Train on ListOps. Defaults: preset 'nystromformer' (2 layers, dim 64, 2 heads, FFN 128, "
                    "batch 32, lr 1e-4, 1000 warm-up steps then linear decay, 5000 steps, pad to 2048). "
                    "Options left unset take the preset's value. Run the same command under "
                    "`torchrun --nproc_per_node=N` for DistributedDataParallel "
                    "(--batch-size is the global batch).",
        epilog="Method options: -o NAME=VALUE (repeatable), e.g. -o num_landmarks=64 -o conv_kernel_size=35.")
    p.add_argument("--method", required=True, help="a registered method (subquad.list_methods())")
    p.add_argument("-o", "--option", action="append", default=[], metavar="NAME=VALUE",
                   help="a method option (repeatable)")
    p.add_argument("--preset", default="nystromformer", choices=sorted(PRESETS), help="default: %(default)s")
    p.add_argument("--data", default="out/data/listops", help="data directory (default: %(default)s)")
    p.add_argument("--out", default=None, help="run directory (default: out/listops/METHOD)")
    g = p.add_argument_group("model and optimisation (default: the preset's)")
    g.add_argument("--layers", type=int)
    g.add_argument("--dim", type=int)
    g.add_argument("--heads", type=int)
    g.add_argument("--ffn-dim", type=int)
    g.add_argument("--positions", choices=("learned", "sinusoidal"))
    g.add_argument("--pooling", choices=("mean", "cls"), help="summary of the sequence: mean of real tokens, or "
                   "a learned first token (LRA's CLS)")
    g.add_argument("--dropout", type=float)
    g.add_argument("--attn-dropout", type=float, help="dropout on attention weights (softmax only)")
    g.add_argument("--head-hidden", type=int, help="classifier hidden width (0: one linear layer)")
    g.add_argument("--batch-size", type=int, help="global batch size")
    g.add_argument("--lr", type=float)
    g.add_argument("--warmup-steps", type=int)
    g.add_argument("--schedule", choices=SCHEDULES)
    g.add_argument("--steps", type=int, help="optimizer updates")
    g.add_argument("--weight-decay", type=float)
    g.add_argument("--betas", type=float, nargs=2, metavar=("B1", "B2"))
    g.add_argument("--eps", type=float)
    g.add_argument("--grad-clip", type=float, help="max gradient norm (default: none)")
    g.add_argument("--pad-to", type=int, help="longest sequence; longer ones are truncated")
    g.add_argument("--batching", choices=("bucket", "pad"), default="bucket",
                   help="bucket: batches of similar length, each padded to its longest sample; pad: the "
                        "published pipeline, uniform batches padded to --pad-to (default: %(default)s)")
    g.add_argument("--bucket-pool", type=int, default=64,
                   help="batches per pool sorted by length (default: %(default)s)")
    r = p.add_argument_group("run")
    r.add_argument("--eval-every", type=int, help="validate every K steps")
    r.add_argument("--eval-samples", type=int,
                   help="validate on the first N validation samples (default: all)")
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
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    r.add_argument("--tensorboard", action=argparse.BooleanOptionalAction, default=None,
                   help="TensorBoard logs (default: when installed)")
    p.set_defaults(func=run_train_listops)
    return parser


def config_from_args(args: argparse.Namespace):
    """The :class:`TrainConfig` of parsed ``train listops`` arguments."""
    from ..registry import get_method
    from ..train.trainer import TrainConfig

    get_method(args.method)
    options = parse_method_options(args.option, getattr(args, "extra_options", None))
    overrides = {
        "layers": args.layers, "dim": args.dim, "heads": args.heads, "ffn_dim": args.ffn_dim,
        "positions": args.positions, "pooling": args.pooling, "dropout": args.dropout,
        "attention_dropout": args.attn_dropout,
        "head_hidden": args.head_hidden, "batch_size": args.batch_size, "lr": args.lr,
        "warmup_steps": args.warmup_steps, "schedule": args.schedule, "steps": args.steps,
        "weight_decay": args.weight_decay, "betas": tuple(args.betas) if args.betas else None,
        "eps": args.eps,
        "grad_clip": args.grad_clip, "pad_to": args.pad_to, "eval_every": args.eval_every,
        "batching": args.batching, "bucket_pool": args.bucket_pool,
    }
    return TrainConfig.from_preset(
        args.preset, method=args.method, method_options=options, data_dir=args.data,
        out_dir=args.out or f"out/listops/{args.method}", eval_samples=args.eval_samples,
        checkpoint_every=args.checkpoint_every, log_every=args.log_every, seed=args.seed,
        threads=args.threads,
        device=args.device, amp=args.amp, dtype=args.dtype, resume=args.resume, max_minutes=args.max_minutes,
        progress=False if args.no_progress else None, tensorboard=args.tensorboard, **overrides)


def run_train_listops(args: argparse.Namespace) -> int:
    from ..train.trainer import train

    try:
        cfg = config_from_args(args)
        cfg.validate()
        _check_model(cfg)
        if not Path(cfg.data_dir).is_dir():
            raise FileNotFoundError(f"data directory {cfg.data_dir!r} does not exist; create it with "
                                    f"`subquad data listops --out {cfg.data_dir}`")
        train(cfg)
    except (ValueError, TypeError, FileNotFoundError, NotImplementedError, FloatingPointError) as e:
        print(f"train listops: error: {e}", file=sys.stderr)
        return 2
    return 0


def _check_model(cfg) -> None:
    """Build one tiny mixer with the method's options: bad options fail before any data is read."""
    from ..models.encoder import build_mixer

    build_mixer(cfg.method, cfg.dim, cfg.heads, **cfg.method_options)


# --------------------------------------------------------------------------- evaluate


def add_evaluate_parser(subparsers) -> argparse.ArgumentParser:
    """``evaluate listops``: accuracy of a saved model on a split."""
    parser = subparsers.add_parser("evaluate", help="evaluate a trained model on a task (ListOps)",
                                   description="Evaluate a trained model.")
    tasks = parser.add_subparsers(dest="evaluate_task", metavar="TASK")
    tasks.required = True
    p = tasks.add_parser(
        "listops", help="accuracy of a ListOps checkpoint",
        description="Rebuild the model from the config saved in a checkpoint (model.pt, best.pt or "
                    "checkpoint.pt of a `train listops` run; read with weights_only), evaluate it on a split "
                    "with the run's input pipeline, and print one JSON object as the last line of stdout "
                    "(accuracy as a fraction, loss, n, method, step, split, checkpoint).")
    p.add_argument("--checkpoint", required=True, help="model file of a run")
    p.add_argument("--data", default="out/data/listops", help="data directory (default: %(default)s)")
    p.add_argument("--split", default="test", choices=("val", "test"), help="default: %(default)s")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    p.add_argument("--device", default="cpu", help="default: %(default)s")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run_evaluate_listops)
    return parser


def run_evaluate_listops(args: argparse.Namespace) -> int:
    import json

    import torch

    from ..tasks import listops
    from ..train.trainer import evaluate_model, load_model

    try:
        if args.threads is not None:
            if args.threads <= 0:
                raise ValueError(f"--threads must be positive, got {args.threads}")
            torch.set_num_threads(args.threads)
        model, cfg, saved = load_model(args.checkpoint, device=args.device)
        if not Path(args.data).is_dir():
            raise FileNotFoundError(f"data directory {args.data!r} does not exist; create it with "
                                    f"`subquad data listops --out {args.data}`")
        data = listops.ListOpsDataset(listops.load_splits(args.data, (args.split,))[args.split])
        progress = not args.no_progress
        if progress:
            try:
                import tqdm  # noqa: F401
            except ImportError:
                progress = False
        loss, accuracy, n = evaluate_model(model, cfg, data, progress=progress)
    except (ValueError, TypeError, FileNotFoundError, RuntimeError, KeyError) as e:
        print(f"evaluate listops: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"accuracy": accuracy, "loss": loss, "n": n, "method": cfg.method,
                      "method_options": cfg.method_options, "step": int(saved.get("step", -1)),
                      "split": args.split, "checkpoint": str(args.checkpoint)}))
    return 0


# --------------------------------------------------------------------------- standalone


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m subquad.train.cli",
                                     description="subquad task data and training")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    add_data_parser(sub)
    add_train_parser(sub)
    add_evaluate_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        if args.command != "train":
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.extra_options = extra
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
