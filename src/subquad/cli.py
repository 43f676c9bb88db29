"""The ``subquad`` command: one parser, built from the command modules.

    subquad compare --methods nystrom performer -o nystrom.num_landmarks=32   # subquad.compare.cli
    subquad methods hybrid                                                     # subquad.methods_cli
    subquad data listops --out out/data/listops                                # subquad.train.cli
    subquad train listops --method nystrom -o num_landmarks=64
    subquad evaluate listops --checkpoint out/listops/nystrom/best.pt
    subquad retrofit --model minilm --method hedgehog -o window=64             # subquad.hf.cli

Each module of :data:`COMMANDS` has ``add_parser(subparsers)``, which registers its sub-command(s)
and their handler; :func:`main` builds one parser from them and runs the command
(:func:`subquad.cli_base.run_command`). ``python -m subquad`` and the ``subquad`` console script
run :func:`main`; ``python -m subquad.train.cli`` is the standalone form of data / train /
evaluate, built from the same ``add_parser``. The ``-o NAME=VALUE`` grammar of method options
and the value parser every command uses are in :mod:`subquad.cli_base`. User mistakes print a
message on stderr and exit with status 2.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections.abc import Iterable
from types import ModuleType

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


def build_parser(prog: str = "subquad", commands: Iterable[str | ModuleType] = COMMANDS) -> argparse.ArgumentParser:
    """The parser of ``prog``: the sub-commands of each module's ``add_parser``, and ``--version``."""
    parser = command_parser(prog, "Sub-quadratic attention for PyTorch, measured against exact attention.",
                            [module.add_parser for module in _command_modules(commands)])
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    return parser


def main(argv: list[str] | None = None) -> int:
    """``subquad ARGV``: returns the command's exit status (usage errors raise ``SystemExit(2)``)."""
    return run_command(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
