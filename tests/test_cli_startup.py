"""The ``subquad`` command answers ``--help`` and usage errors before importing anything heavy.

Each case runs the command in a fresh interpreter, then lists the heavy packages in
``sys.modules`` once argparse has answered (printed help or a usage error). The cases that import
no torch take about 0.1 s each, so they run in ``make test`` (one subprocess for all of them)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "numba", "matplotlib", "scipy")

# (argv, exit status): --help, --version and the usage errors argparse (or a check before the imports) finds
LIGHT = [
    (["--help"], 0),
    (["--version"], 0),
    ([], 2),
    (["bogus"], 2),
    (["compare", "--help"], 0),
    (["compare", "--n", "many"], 2),
    (["compare", "--dtype", "int8"], 2),
    (["compare", "--n", "0"], 2),
    (["compare", "--max-call-seconds", "-1"], 2),
    (["methods", "--help"], 0),
    (["retrofit", "--help"], 0),
    (["retrofit"], 2),
    (["retrofit", "--model", "m", "--method", "linear", "--steps", "x"], 2),
]

_AUDIT = """
import contextlib, io, json, sys
from subquad.cli import main
out = []
for argv, _ in json.loads(sys.argv[1]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    out.append([argv, code, sorted(m for m in %r if m in sys.modules)])
print(json.dumps(out))
""" % (HEAVY,)


def _audit(cases: list) -> list:
    proc = subprocess.run([sys.executable, "-c", _AUDIT, json.dumps(cases)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_help_and_usage_errors_import_nothing_heavy():
    for (argv, code, heavy), (_, expected) in zip(_audit(LIGHT), LIGHT):
        assert code == expected, argv
        assert heavy == [], f"subquad {' '.join(argv)} imported {heavy} before answering"


@pytest.mark.slow  # imports torch in a subprocess: seconds
def test_methods_imports_the_registry_and_ops_only():
    """Of the other commands' packages, only their light command modules."""
    script = ("import contextlib, io, sys\nfrom subquad.cli import main\n"
              "with contextlib.redirect_stdout(io.StringIO()): main(['methods'])\n"
              "light = ('subquad.compare', 'subquad.hf', 'subquad.train')  # the packages, light, and their .cli\n"
              "print(sorted(m for m in sys.modules if m.startswith((*light, 'subquad.tasks', 'transformers', "
              "'numba', 'matplotlib', 'scipy')) and m not in light and not m.endswith('.cli')))")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


@pytest.mark.slow  # a subprocess that imports torch
def test_lazy_packages_keep_their_public_names():
    """``subquad.hf.retrofit`` is the function (as with eager imports) even when its submodule of
    the same name was imported first; ``import subquad`` still reaches every public name."""
    pytest.importorskip("transformers")
    script = ("from subquad.hf.retrofit import retrofit_layers\nimport subquad, subquad.hf, subquad.train\n"
              "assert callable(subquad.hf.retrofit) and callable(subquad.hf.transfer)\n"
              "assert subquad.train.TrainConfig.__name__ == 'TrainConfig'\n"
              "assert [m.name for m in subquad.list_methods()][0] == 'softmax'\n"
              "assert subquad.MultiheadAttention.__name__ == 'MultiheadAttention'\n"
              "assert subquad.ops.softmax_attention is subquad.get_method('softmax').op\n"
              "assert set(subquad.__all__) <= set(dir(subquad)) and set(subquad.hf.__all__) <= set(dir(subquad.hf))")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr


def test_dtype_names_without_torch_match_the_workload():
    from subquad.compare.cli import DTYPE_NAMES
    from subquad.compare.workload import DTYPES

    assert sorted(DTYPE_NAMES) == sorted(DTYPES)


def test_the_lazy_parser_names_every_command():
    from subquad import cli

    full = cli.build_parser()._subparsers._group_actions[0].choices
    lazy = cli.build_parser(argv=["--help"])._subparsers._group_actions[0].choices
    assert list(lazy) == list(full)
    one = cli.build_parser(argv=["methods"])._subparsers._group_actions[0].choices
    assert one["methods"].get_default("func") is not None and one["compare"].get_default("func") is None
