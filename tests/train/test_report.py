"""``subquad train report``: the table and validation curves of a folder of runs
(``subquad.train.report``), on runs written here in the trainer's file formats."""

import json

import pytest
from conftest import run_cli

from subquad.train.report import collect_runs, evaluate_runs, plot_sweep, report_markdown, write_between_markers

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


# --------------------------------------------------------------------------- --table runs, --sweep, --doc

LISTOPS_HEADER = "step,split,loss,accuracy,samples,lr,samples_per_s,tokens_per_s,elapsed_s\n"


def _listops_run(path, vals, finished=True, steps=400):
    """A run as ListOps writes it: batch 32, one train row per 100 steps (3200 samples at 16 / s:
    2 s a step), validation ``(step, accuracy, loss)``; results.json with the label distribution."""
    path.mkdir(parents=True)
    rows = [f"{s},train,2.0,0.2,3200,0.001,16,100,{s}" for s in range(100, steps + 1, 100)]
    rows += [f"{s},val,{loss},{acc},100,,,,{s}" for s, acc, loss in vals]
    (path / "metrics.csv").write_text(LISTOPS_HEADER + "\n".join(rows) + "\n")
    if finished:
        (path / "results.json").write_text(json.dumps({
            "method": path.name.partition("-seed")[0], "steps": steps, "test_accuracy": 0.3765,
            "test_accuracy_best_val": 0.2, "train_seconds": 3000.0, "wall_seconds": 7200.0,
            "train_label_distribution": [0.5, 0.5], "majority_test_accuracy": 0.5, "config": {"batch_size": 32}}))


@pytest.fixture
def listops_runs(tmp_path):
    root = tmp_path / "listops"
    _listops_run(root / "softmax", [(200, 0.3, 1.7), (400, 0.35, 1.6)])
    _listops_run(root / "linear", [(200, 0.18, 0.6935), (400, 0.17, 0.69)])  # ln 2 = 0.6931: the prior
    _listops_run(root / "linear-seed1", [(200, 0.2, 0.9)])
    _listops_run(root / "linear-seed2", [(200, 0.21, 0.8)], finished=False, steps=200)
    _listops_run(root / "short" / "linear", [(200, 0.5, 0.5)])  # below the top level
    return root


def test_runs_table_one_row_per_run_in_method_order_and_the_summary_over_seeds(listops_runs):
    runs = collect_runs(listops_runs, glob="*")
    table = report_markdown(runs, table="runs", intro=False)
    lines = table.splitlines()
    assert lines[0].startswith("| Run | Seed | Steps | Test acc. final | Test acc. best val | Best val (step) |")
    # softmax comes first (the registry's order), the seeds of linear in order; short/ is not matched by '*'
    assert lines[2] == "| softmax | 0 | 400 | 37.65 | 20.00 | 35.00 (400) | 1.6000 | 2.00 | 2.0 h |"
    assert lines[3] == "| linear | 0 | 400 | 37.65 | 20.00 | 18.00 (200) | 0.6900 (prior) | 2.00 | 2.0 h |"
    assert lines[4].startswith("| linear | 1 | 400 |") and "0.9000 |" in lines[4]
    assert lines[5] == "| linear | 2 | 200 | running | running | 21.00 (200) | 0.8000 | 2.00 | 0.1 h |"
    assert "short" not in table and "Over seeds (finished runs only; best / median):" in table
    assert "| linear | 2 of 3 (seeds 0, 1) | 37.65 / 37.65 | 20.00 / 20.00 |" in table
    assert "short/linear" in report_markdown(collect_runs(listops_runs), table="runs")
    with pytest.raises(ValueError, match="table"):
        report_markdown(runs, table="rows")


def _mqar_run(path, recall):
    path.mkdir(parents=True)
    (path / "metrics.csv").write_text(LISTOPS_HEADER + "250,val,1.0,0.5,100,,,,1\n")
    if recall is not None:
        (path / "recall.json").write_text(json.dumps({p: {"accuracy": a, "queries": 10} for p, a in recall.items()}))


def test_sweep_table_one_column_per_run_and_value_in_natural_order(tmp_path):
    root = tmp_path / "mqar"
    _mqar_run(root / "linear" / "n256", {"16": 0.5, "64": 0.25})
    _mqar_run(root / "linear" / "n1024", {"16": 0.125, "64": 0.0625})
    _mqar_run(root / "softmax" / "n256", {"16": 1.0, "64": 1.0})
    _mqar_run(root / "hamburger" / "n256", None)  # no sweep file yet: no row
    runs = collect_runs(root, sweep="recall.json")
    lines = report_markdown(runs, sweep_label="P", intro=False).splitlines()
    assert lines[0] == "| runs | n256 P=16 | n256 P=64 | n1024 P=16 | n1024 P=64 |"
    assert lines[2:] == ["| softmax | 100.0 | 100.0 | - | - |", "| linear | 50.0 | 25.0 | 12.5 | 6.2 |"]
    assert plot_sweep(runs, tmp_path / "sweep.png", "P").stat().st_size > 1000


def test_the_table_goes_between_the_markers_of_a_doc(listops_runs, tmp_path, capsys):
    doc = tmp_path / "doc.md"
    doc.write_text("intro\n<!-- runs:begin -->\nold table\n<!-- runs:end -->\nafter\n")
    plot = tmp_path / "curves.png"
    code, stdout, _ = run_cli(["train", "report", str(listops_runs), "--glob", "*", "--table", "runs", "--doc",
                               str(doc), "--marker", "runs", "--plot", str(plot), "--title", "ListOps",
                               "--reference", "published (37.10)=37.10"], capsys)
    assert code == 0 and f"wrote {doc}" in stdout and plot.stat().st_size > 1000
    text = doc.read_text()
    assert text.startswith("intro\n<!-- runs:begin -->\n| Run | Seed |") and text.endswith("<!-- runs:end -->\nafter\n")
    assert "old table" not in text and "| softmax | 0 | 400 | 37.65 |" in text
    with pytest.raises(ValueError, match="no <!-- other:begin -->"):
        write_between_markers(doc, "other", "x")
    code, _, err = run_cli(["train", "report", str(listops_runs), "--doc", str(doc), "--marker", "other"], capsys)
    assert code == 2 and "other:begin" in err
    code, _, err = run_cli(["train", "report", str(listops_runs)], capsys)
    assert code == 2 and "--out" in err
    code, _, err = run_cli(["train", "report", str(listops_runs), "--plot", str(plot), "--reference", "37.1"], capsys)
    assert code == 2 and "LABEL=PERCENT" in err


# --------------------------------------------------------------------------- a trained MQAR model


@pytest.fixture(scope="module")
def mqar_run(tmp_path_factory):
    """A tiny MQAR run, finished, as runs/mqar/METHOD/nN/ holds it before its model files go."""
    from subquad.train import TrainConfig, train

    out = tmp_path_factory.mktemp("mqar") / "softmax" / "n32"
    cfg = TrainConfig.from_preset(
        "mqar", method="softmax", task_options={"seq_len": 32, "num_pairs": 4, "vocab_size": 32, "train_size": 64,
                                                "eval_size": 24, "train_pairs": (2, 4)},
        layers=1, dim=16, batch_size=8, lr=3e-3, warmup_steps=1, steps=4, eval_every=2, log_every=2,
        checkpoint_every=2, out_dir=str(out), progress=False, tensorboard=False)
    return out, train(cfg)


def test_evaluate_sweep_is_the_model_tested_at_each_value(mqar_run, capsys):
    from subquad.tasks import make_task
    from subquad.train import evaluate_model, load_model

    out, _ = mqar_run
    recall = out / "recall.json"
    code, stdout, _ = run_cli(["evaluate", "mqar", "--checkpoint", str(out / "best.pt"), "--sweep",
                               "num_pairs=2,4,6", "--json", str(recall), "--no-progress"], capsys)
    assert code == 0 and stdout.splitlines()[0].startswith("num_pairs=2: test accuracy ")
    got = json.loads(recall.read_text())
    assert list(got) == ["2", "4", "6"] and json.loads(stdout.splitlines()[-1]) == got
    model, cfg, _ = load_model(out / "best.pt")
    for pairs in (2, 4, 6):  # what the recall test computes: the saved task with num_pairs changed
        task = make_task("mqar", {**cfg.task_options, "num_pairs": pairs})
        loss, accuracy, n = evaluate_model(model, cfg, task.load("", None).test)
        assert got[str(pairs)]["accuracy"] == accuracy and got[str(pairs)]["n"] == n == 24 * pairs
    code, stdout, _ = run_cli(["evaluate", "mqar", "--checkpoint", str(out / "best.pt"), "-t", "num_pairs=6",
                               "--no-progress"], capsys)
    assert code == 0 and json.loads(stdout.splitlines()[-1])["accuracy"] == got["6"]["accuracy"]
    code, _, err = run_cli(["evaluate", "mqar", "--checkpoint", str(out / "best.pt"), "--sweep", "num_pairs"], capsys)
    assert code == 2 and "NAME=V1,V2" in err
    code, _, err = run_cli(["evaluate", "mqar", "--checkpoint", str(out / "best.pt"), "-t", "num_pairs=99"], capsys)
    assert code == 2 and "error: mqar: seq_len" in err  # 99 pairs do not fit in 32 tokens
    runs = collect_runs(out.parents[1], sweep="recall.json")
    assert runs["groups"]["softmax"]["n32"]["sweep"] == {p: got[p]["accuracy"] for p in got}


def test_report_evaluate_tests_the_model_files_again(mqar_run, tmp_path):
    out, results = mqar_run
    runs = evaluate_runs(collect_runs(out.parents[1]))
    run = runs["groups"]["softmax"]["n32"]
    assert (run["test"], run["test_best"]) == (results["test_accuracy"], results["test_accuracy_best_val"])
    copy = tmp_path / "runs" / "n32"
    copy.mkdir(parents=True)
    for name in ("metrics.csv", "results.json"):  # a committed MQAR run: no model files
        (copy / name).write_text((out / name).read_text())
    with pytest.raises(FileNotFoundError, match="model.pt"):
        evaluate_runs(collect_runs(copy.parent))
