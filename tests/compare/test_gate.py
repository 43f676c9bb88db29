"""``subquad compare``'s correctness gate (``subquad.compare.gate``): a method is timed only after
its tests against its naive reference pass. The suite's conftest replaces the gate with a verdict
of "passed"; these tests call the real one, taken at import."""

from pathlib import Path

import pytest

import subquad
from subquad.compare import compare, gate
from subquad.compare.common import Config
from subquad.compare.report import markdown

REAL_RUN_GATE = gate.run_gate


def test_each_method_maps_to_its_ops_test_file():
    root = gate.tests_dir()
    assert root is not None and root.name == "ops"  # this suite runs from a checkout
    assert gate.test_file("topk", root).name == "test_topk.py"
    assert gate.test_file("hybrid", root).name == "test_hybrid.py"
    mixer = next(m.name for m in subquad.list_methods() if m.kind == "mixer")
    assert gate.test_file(mixer, root) is None or gate.test_file(mixer, root).parent == root
    assert gate.test_file("topk", None) is None


@pytest.mark.slow  # a pytest process of its own over test_moba.py's reference tests
def test_the_real_gate_passes_a_method_that_matches_its_reference():
    verdict = REAL_RUN_GATE(["moba"])["moba"]
    assert verdict["status"] == "passed" and verdict["tests"] >= 2 and verdict["detail"] == "test_moba.py"


@pytest.fixture
def broken_tests(tmp_path, monkeypatch):
    """A tests/ops folder whose topk file fails one naive test and whose moba file has none."""
    ops = tmp_path / "tests" / "ops"
    ops.mkdir(parents=True)
    (ops / "test_topk.py").write_text("def test_matches_naive():\n    assert 1 == 2\n\n"
                                      "def test_other_naive_case():\n    pass\n")
    (ops / "test_moba.py").write_text("def test_shapes():\n    pass\n")
    monkeypatch.setattr(gate, "tests_dir", lambda: ops)
    return ops


def test_a_failing_reference_test_fails_the_gate(broken_tests):
    verdicts = REAL_RUN_GATE(["topk", "moba", "softmax"])
    assert verdicts["topk"]["status"] == "failed" and "test_matches_naive" in verdicts["topk"]["detail"]
    assert verdicts["topk"]["tests"] == 2 and "test_other_naive_case" not in verdicts["topk"]["detail"]
    assert verdicts["moba"]["status"] == "untested" and "no test named" in verdicts["moba"]["detail"]
    assert verdicts["softmax"]["status"] == "untested"  # no test_softmax.py in that folder


def test_compare_does_not_time_a_method_that_fails_the_gate(broken_tests, monkeypatch):
    monkeypatch.setattr(gate, "run_gate", REAL_RUN_GATE)
    config = Config(ns=[16], heads=2, dim=8, methods=["softmax", "topk"], min_run_time=0.001, memory=False,
                    backward=False)
    res = compare.run(config, show_progress=False)
    rows = {r["method"]: r for r in res["rows"]}
    assert rows["topk"]["status"] == "failed" and rows["topk"]["forward_s"] is None
    assert "test_matches_naive" in rows["topk"]["errors"]["gate"]
    assert rows["softmax"]["forward_s"] is not None and any("not gated" in n for n in rows["softmax"]["notes"])
    text = markdown(res, [])
    assert "FAILED, not timed: topk" in text and "not gated: softmax" in text


def test_no_gate_times_every_method(broken_tests, monkeypatch):
    monkeypatch.setattr(gate, "run_gate", REAL_RUN_GATE)
    config = Config(ns=[16], heads=2, dim=8, methods=["softmax", "topk"], min_run_time=0.001, memory=False,
                    backward=False, gate=False)
    res = compare.run(config, show_progress=False)
    assert all(r["forward_s"] is not None for r in res["rows"]) and res["gate"] == {}
    assert "off (--no-gate)" in markdown(res, [])


def test_an_installed_copy_without_tests_is_timed_and_says_so(monkeypatch):
    monkeypatch.setattr(gate, "tests_dir", lambda: None)
    verdict = REAL_RUN_GATE(["topk"])["topk"]
    assert verdict["status"] == "untested" and "not beside" in verdict["detail"]
    assert Path(gate.__file__).name == "gate.py"
