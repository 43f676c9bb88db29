"""``subquad train report``: the table and validation curves of a folder of runs
(``subquad.train.report``), on runs written here in the trainer's file formats."""

import json

import pytest
from conftest import run_cli

from subquad.train.report import collect_runs, report_markdown

HEADER = "step,split,loss,accuracy,samples,lr,samples_per_s,tokens_per_s,elapsed_s,miou,miou_foreground\n"


def _run(path, vals, test=None, steps=300):
    path.mkdir(parents=True)
    rows = [f"{s},train,1.0,0.5,32,0.001,1,1,1,," for s in range(50, steps + 1, 50)]
    rows += [f"{s},val,1.0,0.5,100,,,,1,{v},{v}" for s, v in vals]
    (path / "metrics.csv").write_text(HEADER + "\n".join(rows) + "\n")
    if test is not None:
        (path / "results.json").write_text(json.dumps({"steps": steps, "test_miou": test, "test_accuracy": 0.9,
                                                       "train_seconds": 12.0}))


@pytest.fixture
def runs(tmp_path):
    root = tmp_path / "runs"
    _run(root / "same" / "none" / "seed0", [(100, 0.5), (300, 0.7)], test=0.80)
    _run(root / "same" / "none" / "seed1", [(100, 0.5), (300, 0.7)], test=0.86)
    _run(root / "same" / "ham" / "seed0", [(100, 0.6), (200, 0.655)], steps=250)
    _run(root / "mixed" / "none" / "seed0", [(100, 0.4), (300, 0.6)], test=0.7)
    return root


def test_runs_are_grouped_by_parent_and_finished_runs_give_their_test_metric(runs):
    got = collect_runs(runs)
    assert got["metric"] == "miou" and set(got["groups"]) == {"same/none", "same/ham", "mixed/none"}
    ham = got["groups"]["same/ham"]["seed0"]
    assert ham["test"] is None and ham["steps"] == 250 and ham["curve"] == [(100, 0.6), (200, 0.655)]
    assert got["groups"]["same/none"]["seed1"]["test"] == 0.86
    table = report_markdown(got, "subquad train report x --out y")
    assert "| same/none | 80.0 | 86.0 | 83.0 | 6.0 | 2 of 2 |" in table
    assert "| same/ham | (step 250, val 65.5) |  |  |  | 0 of 1 |" in table
    assert "Test mIoU (%)" in table and "Command: `subquad train report x --out y`" in table


def test_cli_writes_the_table_and_the_curves(runs, tmp_path, capsys):
    out = tmp_path / "report"
    code, stdout, _ = run_cli(["train", "report", str(runs), "--out", str(out)], capsys)
    assert code == 0 and "val_curves.png" in stdout
    assert (out / "val_curves.png").stat().st_size > 1000 and "| mixed/none | 70.0 |" in (out / "report.md").read_text()
    code, _, err = run_cli(["train", "report", str(tmp_path / "missing"), "--out", str(out)], capsys)
    assert code == 2 and "not a directory" in err
    code, _, err = run_cli(["train", "report", str(out), "--out", str(out)], capsys)
    assert code == 2 and "no training runs" in err
