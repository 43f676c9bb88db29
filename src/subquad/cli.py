"""The ``subquad`` command: one parser, built from the command modules.

    subquad compare --methods nystrom performer -o nystrom.num_landmarks=32   # subquad.compare.cli
    subquad methods hybrid                                                     # subquad.methods_cli
    subquad data listops --out out/data/listops                                # subquad.train.cli
    subquad train listops --method nystrom -o num_landmarks=64
    subquad evaluate listops --checkpoint out/listops/nystrom/best.pt
    subquad retrofit --model minilm --method hedgehog -o window=64             # subquad.hf.cli

Each module of :data:`COMMANDS` has ``add_parser(subparsers)``, which registers its sub-command(s)
and their handler, and ``COMMAND_HELP``, their one-line help; :func:`main` builds one parser from
them and runs the command (:func:`subquad.cli_base.run_command`). It builds in full only the
command that its arguments name, the others as their one-line help: the command modules import
torch and the rest only inside their functions, so ``subquad --help``, ``subquad compare --help``
and the usage errors argparse finds answer without importing them (``subquad train`` reads its
tasks, which import torch). ``python -m subquad`` and the ``subquad`` console script run
:func:`main`; ``python -m subquad.train.cli`` is the standalone form of data / train / evaluate,
built from the same ``add_parser``. The ``-o NAME=VALUE`` grammar of method options and the value
parser every command uses are in :mod:`subquad.cli_base`. User mistakes print a message on stderr
and exit with status 2.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections.abc import Callable, Iterable, Sequence
from types import ModuleType
from typing import Any

from . import __version__
from .cli_base import command_parser, run_command

__all__ = ["main", "build_parser", "COMMANDS"]

#: the modules whose ``add_parser`` make up ``subquad``, in the order of ``subquad --help``
COMMANDS = ("subquad.compare.cli", "subquad.methods_cli", "subquad.train.cli", "subquad.hf.cli")


def _command_modules(commands: Iterable[str | ModuleType]) -> list[ModuleType]:
    modules = []
    for command in commands:
        if isinstance(command, str):
            if importlib.util.find_spec(command) is None:  # a command left out of this installation
                continue
            command = importlib.import_module(command)
        modules.append(command)
    return modules


def _stubs(helps: dict[str, str]) -> Callable[[Any], None]:
    """An ``add_parser`` that registers each command of ``helps`` with its one-line help only."""

    def add_parser(subparsers) -> None:
        for name, text in helps.items():
            subparsers.add_parser(name, help=text, add_help=False)

    return add_parser


def build_parser(prog: str = "subquad", commands: Iterable[str | ModuleType] = COMMANDS,
                 argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser of ``prog``: the sub-commands of each module's ``add_parser``, and ``--version``.

    With ``argv``, the command line about to be parsed, only the command it names (its first
    argument that is not an option) is built in full; the commands of the other modules that
    declare ``COMMAND_HELP`` are entries with their one-line help, enough for ``--help`` and for
    naming the choices of a wrong command."""
    chosen = next((a for a in argv if not a.startswith("-")), None) if argv is not None else None
    add_parsers = []
    for module in _command_modules(commands):
        helps = getattr(module, "COMMAND_HELP", None)
        lazy = argv is not None and helps is not None and chosen not in helps
        add_parsers.append(_stubs(helps) if lazy else module.add_parser)
    parser = command_parser(prog, "Sub-quadratic attention for PyTorch, measured against exact attention.",
                            add_parsers)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    return parser


def main(argv: list[str] | None = None) -> int:
    """``subquad ARGV``: returns the command's exit status (usage errors raise ``SystemExit(2)``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    return run_command(build_parser(argv=argv), argv)


if __name__ == "__main__":
    sys.exit(main())
