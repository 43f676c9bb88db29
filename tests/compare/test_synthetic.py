"""``subquad compare --source synthetic`` (``subquad.compare.source_synthetic``): errors on inputs of
known structure, mean and spread over seeds, and the options of the error-only sources."""

import json

import pytest
import torch
from conftest import run_cli

import subquad
from subquad.compare import cli as compare_cli
from subquad.compare import source_synthetic
from subquad.compare.common import Config
from subquad.compare.fidelity import exact_reference, relative_error


def test_families_are_seeded_and_clustered_local_is_sorted():
    assert compare_cli.FAMILY_NAMES == source_synthetic.FAMILIES
    for family in source_synthetic.FAMILIES:
        q, k, v = source_synthetic.synthetic_qkv(family, 1, 2, 64, 8, seed=3)
        assert q.shape == v.shape == (1, 2, 64, 8) and q.dtype == torch.float64
        assert torch.equal(q, source_synthetic.synthetic_qkv(family, 1, 2, 64, 8, seed=3)[0])
    q, k, _ = source_synthetic.synthetic_qkv("clustered-local", 1, 1, 64, 8, seed=0)
    near = (q[0, 0, 1:] - q[0, 0, :-1]).norm(dim=-1)  # neighbours share a cluster: close
    q, k, _ = source_synthetic.synthetic_qkv("clustered", 1, 1, 64, 8, seed=0)
    mixed = (q[0, 0, 1:] - q[0, 0, :-1]).norm(dim=-1)
    assert near.median() < 0.5 * mixed.median()
    with pytest.raises(ValueError, match="unknown input family"):
        source_synthetic.synthetic_qkv("uniform", 1, 1, 8, 8, seed=0)


def test_run_averages_each_row_over_the_seeds():
    config = Config(ns=[64], heads=2, dim=8, methods=["softmax", "nystrom", "performer"], seeds=3,
                    families=["gaussian", "clustered-local"], sweeps=[["nystrom", "num_landmarks", [4, 16]]])
    res = source_synthetic.run(config, show_progress=False)
    assert res["kind"] == "synthetic" and [(p["family"], p["n"]) for p in res["points"]] == [
        ("gaussian", 64), ("clustered-local", 64)]
    errors = res["points"][1]["errors"]
    assert list(errors) == ["softmax", "nystrom", "performer", "nystrom num_landmarks=4", "nystrom num_landmarks=16"]
    assert errors["softmax"]["mean"] < 1e-5 and len(errors["performer"]["per_seed"]) == 3
    assert errors["nystrom num_landmarks=4"]["mean"] > errors["nystrom num_landmarks=16"]["mean"]
    x = errors["performer"]["per_seed"]
    assert errors["performer"]["std"] == pytest.approx(torch.tensor(x).std().item()) and errors["performer"]["std"] > 0
    q, k, v = source_synthetic.synthetic_qkv("clustered-local", 1, 2, 64, 8, seed=1)
    out = subquad.attention(q.float(), k.float(), v.float(), method="nystrom", num_landmarks=4)
    assert errors["nystrom num_landmarks=4"]["per_seed"][1] == pytest.approx(
        relative_error(out, exact_reference(q, k, v)), rel=1e-6)
    text = source_synthetic.summary_text(res)
    assert "clustered-local N = 64" in text and "over 3 seeds" in text


def test_limits_add_the_reference_rows_and_the_sharpness(tmp_path):
    config = Config(ns=[32], heads=1, dim=8, methods=["softmax"], seeds=2, families=["clustered"], limits=True,
                    budgets=[0.25])
    res = source_synthetic.run(config, show_progress=False)
    errors, point = res["points"][0]["errors"], res["points"][0]
    assert {"uniform (mean of the visible values)", "rank-r limit @ 25%", "block-local @ 25%"} <= set(errors)
    assert errors["rank-r limit @ 25%"]["limit"] and len(errors["rank-r limit @ 25%"]["per_seed"]) == 2
    assert 0 < point["sharpness"]["normalised_entropy"] < 1
    md = source_synthetic.markdown_synthetic(res, [])
    assert "| rank-r limit @ 25% |" in md and "sharpness of exact attention" in md
    assert [p.name for p in source_synthetic.plot_synthetic(res, tmp_path)] == ["synthetic_error.png"]


def test_cli_runs_the_synthetic_source(capsys, tmp_path):
    code, out, err = run_cli(["compare", "--source", "synthetic", "--n", "32", "--heads", "1", "--dim", "8",
                              "--seeds", "2", "--families", "gaussian", "--methods", "nystrom", "--limits",
                              "--budgets", "0.25", "--quiet", "--out", str(tmp_path)], capsys)
    assert code == 0, err
    assert "gaussian N = 32" in out and "rank-r limit @ 25%" in out
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["config"]["seeds"] == 2 and res["config"]["families"] == ["gaussian"] and res["config"]["limits"]
    assert "--source synthetic" in (tmp_path / "report.md").read_text()


@pytest.mark.parametrize("args, words", [
    (["--seeds", "2"], "--seeds goes with --source synthetic"),
    (["--source", "minilm", "--families", "gaussian"], "--families goes with --source synthetic"),
    (["--limits"], "--limits goes with --source minilm or smollm or synthetic"),
    (["--source", "synthetic", "--layers", "3"], "--layers goes with --source smollm"),
    (["--source", "synthetic", "--seeds", "0"], "--seeds must be >= 1"),
    (["--source", "synthetic", "--error-inputs", "real"], "does not combine with --source synthetic"),
    (["--source", "synthetic", "--families", "uniform"], "invalid choice"),
])
def test_cli_checks_the_error_only_options(capsys, args, words):
    code, _, err = run_cli(["compare", *args], capsys)
    assert code == 2 and words in err, err
