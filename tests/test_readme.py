"""Every code block of the README holds: Python examples run as written, shell commands parse
with the parser that will run them (``subquad``, ``python -m subquad.train.cli`` under torchrun,
the Makefile's targets), and the layout names paths that exist."""

import re
import shlex
from pathlib import Path

import pytest

from subquad import cli
from subquad.train import cli as train_cli

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```(\w*)\n(.*?)```", README, flags=re.S)
PYTHON = [code for lang, code in BLOCKS if lang == "python"]
SHELL = [line for lang, code in BLOCKS if lang == "bash" for line in code.splitlines()
         if line.split("#")[0].strip()]
PLAIN = [code for lang, code in BLOCKS if not lang]
MAKE_TARGETS = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M))


def test_every_block_is_checked():
    """A block in a language this file does not check fails here, not silently."""
    assert {lang for lang, _ in BLOCKS} <= {"python", "bash", ""}
    assert PYTHON and SHELL and PLAIN


@pytest.mark.parametrize("code", PYTHON, ids=[f"python{i}" for i in range(len(PYTHON))])
def test_readme_example_runs(code):
    exec(compile(code, "README.md", "exec"), {"__name__": "__readme__"})


def _parses(parser, argv: list[str]) -> None:
    try:
        parser.parse_args(argv)
    except SystemExit as e:  # argparse's way of refusing a command line
        pytest.fail(f"{' '.join(argv)!r} does not parse (exit {e.code})")


@pytest.mark.parametrize("line", SHELL, ids=[f"shell{i}" for i in range(len(SHELL))])
def test_readme_command_parses(line):
    words = shlex.split(line, comments=True)
    if words[0] == "make":
        assert set(words[1:]) <= MAKE_TARGETS, f"no such make target in {line!r}"
    elif words[0] == "subquad":
        _parses(cli.build_parser(), words[1:])
    elif words[0] == "torchrun" and "-m" not in words:  # a script of this checkout (run by its own test)
        assert (ROOT / words[-1]).is_file(), f"no such script in {line!r}"
    elif words[0] == "torchrun":
        module = words.index("-m")
        assert words[module + 1] == "subquad.train.cli", line
        _parses(train_cli.build_parser(), words[module + 2:])
    else:
        pytest.fail(f"the README runs {words[0]!r}: teach tests/test_readme.py to check it")


def test_readme_layout_paths_exist():
    """The layout block's first column names files and folders of this checkout."""
    layout = next(code for code in PLAIN if "src/subquad/" in code)
    paths = [line.split()[0] for line in layout.splitlines() if line and not line.startswith(" ")]
    assert len(paths) >= 10
    for path in paths:
        matches = list(ROOT.glob(path.replace("<method>", "*").rstrip("/")))
        assert matches, f"README layout names {path}, which does not exist"
