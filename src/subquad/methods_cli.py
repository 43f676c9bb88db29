"""``subquad methods``: the registered methods and what each supports; ``subquad methods NAME``:
one method's summary and options with their defaults.

    subquad methods              # one line per method: kind, cost, causal, cross, padding
    subquad methods hybrid       # hybrid's summary, every option with its default, and what they mean

An option whose default is None is resolved when the op runs or stands for something absent (a
``generator``: torch's global one); the options' docstring, printed after them, says which.
"""

from __future__ import annotations

import argparse

from .cli_base import plain_text

__all__ = ["add_parser", "run_methods", "COMMAND_HELP"]

#: the command of this module and its one-line help (``subquad --help`` reads it without the parser)
COMMAND_HELP = {"methods": "list the registered methods, or one method's options"}


def add_parser(subparsers) -> argparse.ArgumentParser:
    """``methods [NAME]``."""
    p = subparsers.add_parser("methods", help=COMMAND_HELP["methods"],
                              description="The registered attention methods and mixers: what each supports, and "
                              "with NAME its summary and options (the -o NAME=VALUE of the other commands).")
    p.add_argument("name", nargs="?", default=None, metavar="NAME", help="a method to describe")
    p.set_defaults(func=run_methods, subparser=p)
    return p


def _yes(flag: bool) -> str:
    return "yes" if flag else "-"


def run_methods(args: argparse.Namespace) -> int:
    """Print the table of methods, or NAME's summary and options; an unknown NAME is a usage error.
    Imports the registry and the ops (torch) only, not the other commands' packages."""
    from .registry import get_method, list_methods

    if args.name is None:
        rows = [("name", "kind", "cost", "causal", "cross", "padding", "sharded")]
        rows += [(m.name, m.kind, m.complexity, _yes(m.causal), _yes(m.cross_attention), _yes(m.key_padding),
                  _yes(m.context_parallel is not None)) for m in list_methods()]
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for row in rows:
            print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        print("\nsharded: runs on a sequence split over processes (subquad.distributed.attention)")
        print("subquad methods NAME: a method's options and defaults")
        return 0
    try:
        info = get_method(args.name)
    except ValueError as e:
        args.subparser.error(str(e))
    print(f"{info.name} ({info.kind}, {info.complexity}): {info.summary}")
    defaults = info.option_defaults()
    for name, default in defaults.items():
        print(f"  {name} = {default!r}" + ("  (what None means: below)" if default is None else ""))
    module = info.module_option_defaults() if info.kind == "attention" else {}
    if module:
        print("options of its MultiheadAttention layer:")
        for name, default in module.items():
            print(f"  {name} = {default!r}")
    doc = plain_doc(info.options)
    if doc and defaults:
        print(f"\nwhat the options mean ({info.options.__name__}):")
        print("\n".join(f"  {line}".rstrip() for line in doc.splitlines()))
    return 0


def plain_doc(cls: type) -> str:
    """``cls``'s own docstring as plain text (reST roles and double backticks dropped), or "" for
    none (a dataclass without one gets its signature as ``__doc__``)."""
    doc = cls.__dict__.get("__doc__") or ""
    return "" if not doc or doc.startswith(f"{cls.__name__}(") else plain_text(doc)
