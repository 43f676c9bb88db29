"""The correctness gate of ``subquad compare``: a speed is reported only for a method that computes
what it claims.

Before anything is timed, the tests that hold each compared method to its slow, obvious reference
(``tests/ops/test_<module>.py``, the tests whose name contains ``naive`` or ``reference``, where ``<module>`` is the
``subquad.ops`` package of the method's op) run in one separate pytest process, on small
inputs. A method whose test fails is not timed: its row says ``FAILED`` with the failing tests.
A method without such tests (a token mixer, or a copy of subquad installed without its tests) is
timed and its row says it was not gated. ``--no-gate`` skips the gate.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import subquad

__all__ = ["tests_dir", "test_file", "run_gate", "verdicts"]

#: the pytest expression that picks the tests against a method's naive reference
SELECT = "naive or reference"


def tests_dir() -> Path | None:
    """``tests/ops`` of the checkout subquad was imported from, or None (an installed copy)."""
    root = Path(subquad.__file__).resolve().parents[2] / "tests" / "ops"
    return root if root.is_dir() else None


def test_file(method: str, root: Path | None) -> Path | None:
    """The test file of ``method``'s op package, when there is one under ``root``."""
    info = subquad.get_method(method)
    module = (info.op.__module__ if info.op is not None else info.module_path or "").split(".")
    if root is None or module[:2] != ["subquad", "ops"] or len(module) < 3:
        return None
    path = root / f"test_{module[2]}.py"
    return path if path.is_file() else None


def _outcomes(report: Path) -> dict[str, list[tuple[str, bool]]]:
    """``{test file stem: [(test name, passed)]}`` from a pytest JUnit XML report."""
    out: dict[str, list[tuple[str, bool]]] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        if case.find("skipped") is not None:
            continue
        stem = case.get("classname", "").split(".")[-1]
        failed = case.find("failure") is not None or case.find("error") is not None
        out.setdefault(stem, []).append((case.get("name", "?"), not failed))
    return out


def run_gate(methods: list[str], timeout: float = 900.0) -> dict[str, dict[str, object]]:
    """``{method: {"status", "detail", "tests"}}`` for each of ``methods``: ``status`` ``"passed"``,
    ``"failed"`` (``detail``: the failing tests) or ``"untested"`` (``detail``: why)."""
    root = tests_dir()
    files = {m: test_file(m, root) for m in methods}
    gated = sorted({str(f) for f in files.values() if f is not None})
    outcomes: dict[str, list[tuple[str, bool]]] = {}
    trouble = ""
    if gated:
        with tempfile.TemporaryDirectory() as tmp:
            report = Path(tmp) / "gate.xml"
            cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow", "-k", SELECT,
                   f"--junitxml={report}", *gated]
            try:
                done = subprocess.run(cmd, cwd=root.parents[1], capture_output=True, text=True, timeout=timeout)
                outcomes = _outcomes(report) if report.is_file() else {}
                trouble = "" if report.is_file() else (done.stdout + done.stderr).strip()[-300:]
            except (OSError, subprocess.TimeoutExpired) as e:
                trouble = f"{type(e).__name__}: {e}"
    out: dict[str, dict[str, object]] = {}
    for method, path in files.items():
        if path is None:
            why = ("subquad's tests are not beside this copy of the package" if root is None
                   else "a token mixer: the gate runs the tests of the ops under subquad.ops"
                   if subquad.get_method(method).op is None else "no tests against a naive reference")
            out[method] = {"status": "untested", "detail": why, "tests": 0}
            continue
        cases = outcomes.get(path.stem, [])
        failed = [name for name, ok in cases if not ok]
        if trouble and not cases:
            out[method] = {"status": "failed", "detail": f"the gate did not run: {trouble}", "tests": 0}
        elif not cases:
            out[method] = {"status": "untested", "tests": 0,
                           "detail": f"no test named *naive* or *reference* in {path.name}"}
        else:
            out[method] = {"status": "failed" if failed else "passed", "tests": len(cases),
                           "detail": f"{path.name}: failed {', '.join(failed)}" if failed else path.name}
    return out


def verdicts(names: list[str], enabled: bool, bar) -> dict[str, dict[str, object]]:
    """:func:`run_gate` for a compare run that times ``names`` (empty when not ``enabled``, as with
    ``--no-gate``), with the stage on the progress bar ``bar`` and a line on stderr per method that
    failed."""
    if not enabled:
        return {}
    bar.set_postfix_str("correctness gate: each method against its naive reference")
    gates = run_gate(names)
    for name, g in gates.items():
        if g["status"] == "failed":
            bar.write(f"subquad compare: {name} failed its correctness gate ({g['detail']}); it is not timed",
                      file=sys.stderr)
    return gates
