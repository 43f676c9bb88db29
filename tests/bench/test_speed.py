"""The forward speed table (python -m subquad.bench.speed)."""

import json

import pytest

import subquad
from subquad.bench import speed


def test_speed_table_end_to_end(tmp_path):
    assert speed.main(["--n", "16", "24", "--rounds", "2", "--min-run-time", "0.001", "--heads", "2",
                       "--dim", "8", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "speed.json").read_text())
    methods = [m.name for m in subquad.list_methods() if m.kind == "attention"]
    assert {(r["n"], r["method"]) for r in data["rows"]} == {(n, m) for n in (16, 24) for m in methods}
    for r in data["rows"]:
        assert len(r["rounds"]) == 2 and r["seconds"] > 0
        assert len(r["speedup_rounds"]) == 2
        assert min(r["speedup_rounds"]) <= r["speedup_vs_softmax"] <= max(r["speedup_rounds"])
        if r["method"] == "softmax":
            assert r["speedup_vs_softmax"] == pytest.approx(1.0) and r["rel_error"] == 0.0
    table = (tmp_path / "speed.md").read_text()
    assert all(f"| {m} |" in table for m in methods)
    assert "(1.0x; 1.0-1.0x)" in table  # softmax against itself, with its range over the rounds


@pytest.mark.parametrize("argv", [["--methods", "nope"], ["--n", "0"], ["--rounds", "0"]])
def test_speed_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        speed.main(argv)
    assert e.value.code == 2
    assert "error" in capsys.readouterr().err
