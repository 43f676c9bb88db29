"""``subquad compare`` with its default methods: every registered method, in every table (the
check the retired forward-only speed table had), with the default error inputs (real activations:
conftest's tiny stand-in for the MiniLM capture)."""

import json

import subquad
from subquad import cli


def test_every_registered_method_runs_by_default(fake_minilm, capsys, tmp_path):
    """Every method but the quality references (full logits: run when named)."""
    out_dir = tmp_path / "compare"
    code = cli.main(["compare", "--n", "16", "24", "--heads", "2", "--dim", "8", "--min-run-time", "0.001",
                     "--no-memory", "--no-backward", "--quiet", "--out", str(out_dir)])
    assert code == 0
    methods = [m.name for m in subquad.list_methods() if m.kind in ("attention", "mixer") and not m.quality_reference]
    references = {"topk", "quest", "moba", "xattention", "magicpig"}
    assert {m.name for m in subquad.list_methods() if m.quality_reference} == references
    res = json.loads((out_dir / "results.json").read_text())
    assert sorted((r["n"], r["method"]) for r in res["rows"]) == sorted((n, m) for n in (16, 24) for m in methods)
    assert all(r["forward_s"] > 0 for r in res["rows"])
    assert res["error_inputs"]["kind"] == "real" and len(fake_minilm) == 1
    for r in res["rows"]:
        if r["method"] == "softmax":  # exact attention against itself
            assert r["speedup_forward"] == 1.0 and r["rel_error"] < 1e-5
        # every attention method runs on the capture: one error, the same at every N
        expected = res["error_inputs"]["errors"][r["method"]]["mean"] if r["kind"] == "attention" else None
        assert r["rel_error"] == expected and (r["kind"] != "attention" or expected is not None), r["method"]
    leaderboard = capsys.readouterr().out
    report = (out_dir / "report.md").read_text()
    for m in methods:
        assert f"\n| {m} " in report, m
        assert f"\n{m} " in leaderboard, m
