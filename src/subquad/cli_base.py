"""What every ``subquad`` command module shares: the ``-o NAME=VALUE`` grammar of method options,
the one value parser, the notice of a deprecated spelling, and running a parsed command.

Method options have one grammar in every command, ``-o NAME=VALUE`` / ``--option NAME=VALUE``
(repeatable). ``NAME`` is ``METHOD.OPTION`` or just ``OPTION``: for a command about one method
(train, retrofit) the option is that method's (:func:`single_method_options`); in ``compare`` an
unqualified name applies to every selected method that has such an option
(:func:`multi_method_options`). Values go through :func:`parse_value`. Spellings this replaces
still work for one release and print a one-line ``deprecated: use ... instead`` on stderr
(:func:`deprecated`).

A command module's ``add_parser(subparsers)`` registers its sub-command(s) with ``func`` (the
handler, ``func(args) -> exit status``) and ``subparser`` (the parser that reports the command's
usage errors) as defaults; :func:`command_parser` builds a parser from such modules and
:func:`run_command` parses and dispatches. This module is the bottom of
the command-line layer: the command modules (``subquad.train.cli``, ``subquad.hf.cli``,
``subquad.compare.cli``) and :mod:`subquad.cli` import it, it imports none of them.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import re
import sys
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

__all__ = ["parse_value", "plain_text", "DefaultsFormatter", "OptionError", "add_option_argument", "split_option",
           "single_method_options", "multi_method_options", "deprecated", "command_parser", "run_command"]


# --------------------------------------------------------------------------- option grammar


class DefaultsFormatter(argparse.HelpFormatter):
    """Help that states an option's default where it says something: not for None or False
    defaults (flags, and options whose absence the help explains) and not twice."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, [], argparse.SUPPRESS) or not action.option_strings:
            return text
        return text + " (default: %(default)s)"


def plain_text(doc: str) -> str:
    """A docstring for a terminal: dedented, with reST roles (``:func:`x``` -> ``x``) and double
    backticks dropped."""
    return re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", inspect.cleandoc(doc)).replace("``", "")


class OptionError(ValueError):
    """A malformed or misdirected ``-o NAME=VALUE``; each command reports it its own way."""


def parse_value(text: str) -> Any:
    """An option value: ``none`` / ``null`` -> None, ``true`` / ``false`` -> bool (any case), a
    Python literal (``64``, ``0.5``, ``1e-6``, ``(8, 8)``, ``'x'``), a JSON value (``Infinity``),
    or else the text itself (``per_matrix``)."""
    lowered = text.strip().lower()
    if lowered in ("none", "null"):
        return None
    if lowered in ("true", "false"):
        return lowered == "true"
    try:
        return ast.literal_eval(text.strip())
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        pass
    try:
        return json.loads(text)
    except ValueError:
        return text


def add_option_argument(parser: argparse.ArgumentParser | Any, example: str) -> None:
    """``-o`` / ``--option NAME=VALUE`` (repeatable) into ``args.option``."""
    parser.add_argument("-o", "--option", action="append", default=[], metavar="NAME=VALUE",
                        help=f"a method option, NAME or METHOD.NAME (repeatable), e.g. -o {example}")


def split_option(spec: str) -> tuple[str | None, str, Any]:
    """``"nystrom.num_landmarks=32"`` -> ``("nystrom", "num_landmarks", 32)``; ``"rank=None"`` ->
    ``(None, "rank", None)``. Dashes in the option name become underscores."""
    key, eq, text = spec.partition("=")
    method, dot, name = key.strip().partition(".")
    if not dot:
        method, name = "", method
    name = name.strip().replace("-", "_")
    if not (eq and name and (method or not dot)):
        raise OptionError(f"{spec!r} must look like NAME=VALUE or METHOD.NAME=VALUE "
                          "(e.g. num_landmarks=64 or nystrom.num_landmarks=64)")
    return method or None, name, parse_value(text)


def single_method_options(specs: Iterable[str], method: str) -> dict[str, Any]:
    """The options of a command about one ``method``: ``NAME=VALUE`` or ``METHOD.NAME=VALUE`` with
    ``METHOD`` that method."""
    out: dict[str, Any] = {}
    for spec in specs:
        qualifier, name, value = split_option(spec)
        if qualifier is not None and qualifier != method:
            raise OptionError(f"{spec!r} is an option of method {qualifier!r}, but the method is {method!r}")
        out[name] = value
    return out


def multi_method_options(specs: Iterable[str], *, known: Mapping[str, Collection[str]], runs: Sequence[str],
                         selected: Sequence[str]) -> dict[str, dict[str, Any]]:
    """``{method: {name: value}}`` for a command that runs several methods (``compare``).

    ``known`` maps every method to its option names; a qualified ``METHOD.NAME`` must name one of
    ``runs``; an unqualified ``NAME`` goes to every method of ``selected`` that has that option."""
    out: dict[str, dict[str, Any]] = {}
    for spec in specs:
        qualifier, name, value = split_option(spec)
        if qualifier is None:
            targets = [m for m in selected if name in known.get(m, ())]
            if not targets:
                raise OptionError(f"{spec!r}: unknown option {name!r}: none of the methods {list(selected)} has it")
        elif qualifier not in known:
            raise OptionError(f"{spec!r}: unknown method {qualifier!r}; known methods are {sorted(known)}")
        elif qualifier not in runs:
            raise OptionError(f"{spec!r}: method {qualifier!r} is not among --methods {list(runs)}")
        else:
            targets = [qualifier]
        for method in targets:
            out.setdefault(method, {})[name] = value
    return out


def deprecated(old: str, new: str) -> None:
    """The one-line notice of an old spelling that still works for one release."""
    print(f"deprecated: use {new} instead of {old} (the old spelling goes in the next release)", file=sys.stderr)


# --------------------------------------------------------------------------- running a command


def command_parser(prog: str, description: str,
                   add_parsers: Iterable[Callable[[Any], Any]]) -> argparse.ArgumentParser:
    """A parser whose sub-commands are those that each of ``add_parsers`` (command modules'
    ``add_parser``) registers; one of them is required."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for add_parser in add_parsers:
        add_parser(sub)
    return parser


def run_command(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``) and run the chosen command's handler; returns
    its exit status.

    Arguments no parser knows are an error, unless the command sets ``accepts_extra=True``: then
    they reach its handler as ``args.extra_options`` (the old ``--name VALUE`` method options of
    ``train``). ``args.argv`` is the command line as given."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "accepts_extra", False):
        getattr(args, "subparser", parser).error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra_options = extra
    args.argv = argv
    return args.func(args)
