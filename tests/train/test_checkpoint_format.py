"""Files written by earlier versions of the trainer still load, evaluate and resume.

``data/format1/`` is a run stopped after its first step, written by the trainer of commit
dc16722 (checkpoint ``format`` 1) with the ``data_dir`` fixture's data and :data:`RUN`::

    train(TrainConfig(**RUN, data_dir=DATA, out_dir="stopped", max_minutes=1e-9))  # checkpoint.pt, best.pt
    train(TrainConfig(**RUN, data_dir=DATA, out_dir="whole"))                     # expected.json "resumed"

``expected.json`` holds what that code reported: ``subquad evaluate listops`` of ``best.pt`` on
the validation split, the results of the uninterrupted run, and the sum of each of its weights.
The committed ListOps runs (``runs/listops/*/``, written by the same trainer) are checked too
when present.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from subquad.cli import main
from subquad.train import checkpoint as ckpt
from subquad.train import TrainConfig, load_model, train

FIXTURE = Path(__file__).parent / "data" / "format1"
EXPECTED = json.loads((FIXTURE / "expected.json").read_text())
RUN = dict(layers=1, dim=8, heads=2, ffn_dim=16, head_hidden=8, batch_size=8, lr=1e-3, warmup_steps=2, pad_to=48,
           eval_every=1, checkpoint_every=3, log_every=2, progress=False, tensorboard=False, method="performer",
           method_options={"num_features": 8}, steps=6, seed=3, device="cpu")
RUNS = Path(__file__).resolve().parents[2] / "runs" / "listops"
# the recording ran on the CPU, so the runs here do too (on a GPU machine "auto" would take the GPU,
# whose random streams differ from the recorded CPU step). The torch the recording was made with:
# torch 2.11's CUDA build (on its CPU) resumed this run to a test loss 1.5e-3 away, one of the 40
# test examples flipped; on any build the resumed run must still equal that build's own
# uninterrupted run (the end of the test)
RECORDED_WITH = "2.13."


def test_the_fixture_is_format_1():
    state = ckpt.load(FIXTURE / "checkpoint.pt")
    assert state["format"] == 1 and state["step"] == 1 and state["world_size"] == 1
    assert set(state) == {"format", "step", "config", "world_size", "model", "optimizer", "scheduler", "sampler",
                          "rng", "best", "best_model", "window", "elapsed_s"}
    best = ckpt.load(FIXTURE / "best.pt")
    assert set(best) == {"kind", "format", "config", "step", "model", "val_accuracy"}
    assert best["kind"] == "subquad.listops.encoder" and best["format"] == 1


@pytest.mark.parametrize("name", ["best.pt", "checkpoint.pt"])
def test_format_1_files_evaluate(name, data_dir, capsys):
    code = main(["evaluate", "listops", "--checkpoint", str(FIXTURE / name), "--data", str(data_dir),
                 "--split", "val", "--no-progress"])
    assert code == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    want = EXPECTED["evaluate_best_val"]
    assert got["step"] == want["step"] and got["n"] == want["n"] and got["method"] == "performer"
    assert got["accuracy"] == want["accuracy"]  # at step 1 the checkpoint's model is the best one
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)


def test_format_1_checkpoint_resumes_to_the_old_result(data_dir, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run, ignore=shutil.ignore_patterns("expected.json"))
    results = train(TrainConfig(**RUN, data_dir=str(data_dir), out_dir=str(run), resume=True))
    want = EXPECTED["resumed"]
    assert results["steps"] == want["steps"] and results["best_val_step"] == want["best_val_step"]
    model = ckpt.load(run / "model.pt")["model"]
    assert set(model) == set(EXPECTED["model_sums"])
    if torch.__version__.startswith(RECORDED_WITH):  # another build trains to other numbers (see RECORDED_WITH)
        for key in ("test_accuracy", "best_val_accuracy", "test_accuracy_best_val"):
            assert results[key] == want[key], key
        assert results["test_loss"] == pytest.approx(want["test_loss"], rel=1e-5)
        for key, total in EXPECTED["model_sums"].items():
            assert model[key].double().sum().item() == pytest.approx(total, rel=1e-4, abs=1e-5), key
    assert not (run / "checkpoint.pt").exists()
    # and the same as this code's own uninterrupted run
    whole = train(TrainConfig(**RUN, data_dir=str(data_dir), out_dir=str(tmp_path / "whole")))
    assert whole["test_accuracy"] == results["test_accuracy"]
    fresh = ckpt.load(tmp_path / "whole" / "model.pt")["model"]
    for key in model:
        torch.testing.assert_close(model[key], fresh[key], rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("path", sorted(RUNS.parent.glob("listops*/**/*.pt")) or [RUNS / "none"],
                         ids=lambda p: str(p.relative_to(RUNS.parent)))
def test_committed_listops_runs_load(path):
    """Every committed checkpoint (best, final and resume) of the ListOps runs (runs/listops,
    the short-ListOps diagnostic and the warm-started runs) rebuilds its model; the run directory
    is METHOD or METHOD-seedK."""
    if not path.is_file():
        pytest.skip(f"{path} is not here")
    model, cfg, saved = load_model(path)  # reads only: the runs are written by their own processes
    assert cfg.method == path.parent.name.split("-seed")[0] and int(saved["step"]) > 0
    assert set(model.state_dict()) == set(saved["model"])


@pytest.mark.slow  # generates the ListOps test split and evaluates 2000 samples
def test_a_committed_run_evaluates_to_its_recorded_number(tmp_path, capsys):
    """``runs/listops/efficient``'s best-validation model evaluates, through today's trainer and
    ``subquad evaluate``, to the test accuracy its run recorded (the test split does not depend on
    the train size, so a train-less generation gives the same samples)."""
    from subquad.tasks import listops

    run = RUNS / "efficient"
    if not (run / "best.pt").is_file():
        pytest.skip(f"{run} is not here")
    splits = listops.generate_splits(train_size=1, val_size=2000, test_size=2000, seed=0)
    listops.write_splits(tmp_path, splits, meta={"task": "listops"})
    assert main(["evaluate", "listops", "--checkpoint", str(run / "best.pt"), "--data", str(tmp_path),
                 "--no-progress"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    recorded = json.loads((run / "results.json").read_text())
    assert got["n"] == 2000 and got["accuracy"] == recorded["test_accuracy_best_val"]
