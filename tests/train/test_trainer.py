"""Trainer: a tiny run for every registered method, schedules and presets, checkpoints that
survive SIGKILL (resume equals an uninterrupted run), 2-process DDP equals 1 process with the
same global batch, and clear errors for bad arguments."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import subquad
from subquad.tasks import listops
from subquad.train import checkpoint as ckpt
from subquad.train.cli import build_parser, method_options, parse_method_options
from subquad.train.cli import main as cli_main
from subquad.train.sampler import ShardedBatchSampler
from subquad.train import PRESETS, TrainConfig, build_model, lr_factor, train

METHODS = [m.name for m in subquad.list_methods()]
# Options that suit the tiny runs (sequences padded to 64, head dim 8); others use their defaults.
TINY_OPTIONS = {
    "nystrom": {"num_landmarks": 4},
    "performer": {"num_features": 16},
    "lara": {"num_landmarks": 4},
    "sinkhorn": {"block_size": 8},
}
TINY = dict(layers=2, dim=16, heads=2, ffn_dim=32, head_hidden=16, batch_size=8, lr=1e-3, warmup_steps=2,
            pad_to=64, eval_every=3, checkpoint_every=3, log_every=2, progress=False, tensorboard=False)
REPO = Path(__file__).resolve().parents[2]


def _config(data_dir: Path, out: Path, method: str = "softmax", **kwargs) -> TrainConfig:
    args = dict(TINY, method=method, method_options=TINY_OPTIONS.get(method, {}), data_dir=str(data_dir),
                out_dir=str(out), steps=6)
    args.update(kwargs)
    return TrainConfig(**args)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO / "src") + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    return env


def _rows(path: Path, columns=("step", "split", "loss", "accuracy", "samples", "lr")) -> list[tuple]:
    with open(path, newline="") as f:
        return [tuple(r[c] for c in columns) for r in csv.DictReader(f)]


# --------------------------------------------------------------------------- schedule, presets, config


def test_linear_warmup_then_linear_decay():
    f = [lr_factor(s, warmup=4, total=10, schedule="linear") for s in range(1, 11)]
    assert f[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a > b for a, b in zip(f[3:], f[4:]))  # strictly decreasing after warm-up
    assert f[-1] == pytest.approx(1 / 7) and f[-1] > 0
    assert lr_factor(3, warmup=0, total=10, schedule="constant") == 1.0


def test_lra_rsqrt_schedule_peak():
    """LRA: 0.05 * min(1, step/1000) / sqrt(max(step, 1000)): ~1.58e-3 at step 1000, ~7.1e-4 at 5000."""
    peak = 0.05 * lr_factor(1000, warmup=1000, total=5000, schedule="rsqrt")
    assert peak == pytest.approx(1.581e-3, rel=1e-3)
    end = 0.05 * lr_factor(5000, warmup=1000, total=5000, schedule="rsqrt")
    assert end == pytest.approx(7.07e-4, rel=1e-3)


def test_defaults_are_the_nystromformer_lra_config():
    cfg = TrainConfig()
    assert (cfg.layers, cfg.dim, cfg.heads, cfg.ffn_dim) == (2, 64, 2, 128)
    assert (cfg.batch_size, cfg.lr, cfg.warmup_steps, cfg.steps, cfg.pad_to) == (32, 1e-4, 1000, 5000, 2048)
    assert cfg.schedule == "linear" and cfg.positions == "learned"
    for key, value in PRESETS["nystromformer"].items():
        assert getattr(cfg, key) == value, key
    lra = TrainConfig.from_preset("lra", method="nystrom", steps=10)
    got = (lra.layers, lra.dim, lra.heads, lra.ffn_dim, lra.head_hidden, lra.pooling, lra.positions, lra.schedule,
           lra.steps, lra.pad_to)
    assert got == (6, 512, 8, 2048, 2048, "cls", "sinusoidal", "rsqrt", 10, 2000)
    assert cfg.pooling == "mean"
    with pytest.raises(ValueError, match="unknown preset"):
        TrainConfig.from_preset("bert")


def _train_args(*argv):
    args, extra = build_parser().parse_known_args(["train", "listops", *argv])
    args.extra_options = extra
    return args


def test_method_option_parsing(capsys):
    args = _train_args("--method", "nystrom", "-o", "num_landmarks=64", "--option", "conv-kernel-size=35",
                       "-o", "nystrom.pinv_init=global", "-o", "grid_size=(8, 8)", "-o", "rank=None")
    assert method_options(args) == {"num_landmarks": 64, "conv_kernel_size": 35, "pinv_init": "global",
                                    "grid_size": (8, 8), "rank": None}
    assert capsys.readouterr().err == ""
    with pytest.raises(ValueError, match="NAME=VALUE"):
        method_options(_train_args("--method", "nystrom", "-o", "num_landmarks"))
    with pytest.raises(ValueError, match="option of method 'nystrom'"):
        method_options(_train_args("--method", "lara", "-o", "nystrom.num_landmarks=4"))


def test_old_trailing_method_options_still_work(capsys):
    """``--name VALUE`` after the arguments: the spelling before ``-o``, deprecated for one release."""
    args = _train_args("--method", "performer", "-o", "num_features=8", "--orthogonal", "false",
                       "--grid-size=(8, 8)", "--ham", "nmf", "--rank", "None")
    assert method_options(args) == {"num_features": 8, "orthogonal": False, "grid_size": (8, 8), "ham": "nmf",
                                    "rank": None}
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("deprecated: use -o orthogonal=false -o 'grid_size=(8, 8)' ")
    assert "instead of --orthogonal false '--grid-size=(8, 8)' --ham nmf --rank None" in err[0]
    with pytest.raises(ValueError, match="needs a value"):
        method_options(_train_args("--method", "nystrom", "--num-landmarks"))
    with pytest.deprecated_call():
        opts = parse_method_options(["num_landmarks=64", "conv-kernel-size=35"], ["--rank", "None"])
    assert opts == {"num_landmarks": 64, "conv_kernel_size": 35, "rank": None}


# --------------------------------------------------------------------------- sampler and checkpoints


def test_sharded_batches_equal_the_global_batch():
    one = ShardedBatchSampler(50, 6, seed=3)
    ranks = [ShardedBatchSampler(50, 3, world_size=2, rank=r, seed=3) for r in range(2)]
    for _ in range(25):  # several epochs (8 batches each)
        glob = next(one)
        parts = [next(s) for s in ranks]
        assert sorted(glob) == sorted(parts[0] + parts[1])
        assert len(set(glob)) == 6
    state = one.state_dict()
    expected = [next(one) for _ in range(5)]
    again = ShardedBatchSampler(50, 6, seed=3)
    again.load_state_dict(state)
    assert [next(again) for _ in range(5)] == expected
    with pytest.raises(ValueError, match="fewer than one global batch"):
        ShardedBatchSampler(5, 3, world_size=2)


def test_checkpoint_is_atomic_and_loads_weights_only(tmp_path):
    path = tmp_path / "c.pt"
    ckpt.save_atomic({"a": torch.arange(3), "n": 2, "rng": ckpt.rng_state()}, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.pt"]  # no temporary file left behind
    back = ckpt.load(path)
    assert torch.equal(back["a"], torch.arange(3)) and back["n"] == 2
    # a file that would need to run code to load is refused
    torch.save({"obj": _Opaque()}, tmp_path / "evil.pt")
    with pytest.raises(Exception, match="(?i)weights_only|unsupported|global"):
        ckpt.load(tmp_path / "evil.pt")
    with pytest.raises(FileNotFoundError):
        ckpt.load(tmp_path / "missing.pt")


class _Opaque:
    pass


def test_rng_state_round_trip():
    import random

    state = ckpt.rng_state()
    a = (torch.rand(3), np.random.rand(3), random.random())
    ckpt.set_rng_state(state)
    b = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2] == b[2]


# --------------------------------------------------------------------------- training runs


@pytest.mark.parametrize("method", METHODS)
def test_tiny_training_run_for_every_method(method, data_dir, tmp_path):
    out = tmp_path / method
    results = train(_config(data_dir, out, method))
    assert results["steps"] == 6 and results["method"] == method
    assert results["test_samples"] == 40 and 0 <= results["test_accuracy"] <= 1
    assert np.isfinite(results["test_loss"])
    assert results["majority_test_accuracy"] == pytest.approx(
        listops.majority_baseline(listops.load_splits(data_dir)["train"].labels,
                                  listops.load_splits(data_dir)["test"].labels)[1])
    assert sum(results["train_label_distribution"]) == pytest.approx(1.0)
    assert json.loads((out / "results.json").read_text())["test_accuracy"] == results["test_accuracy"]
    rows = _rows(out / "metrics.csv")
    assert {r[1] for r in rows} >= {"train", "val", "test"}
    assert [int(r[0]) for r in rows if r[1] == "val"] == [3, 6]
    assert not (out / "checkpoint.pt").exists()  # a finished run keeps model.pt, best.pt, results.json
    best = ckpt.load(out / "best.pt")
    assert best["step"] == results["best_val_step"] and best["config"]["method"] == method
    # the mixer was trained: some of its parameters moved away from their initial values
    torch.manual_seed(0)  # the trainer seeds with cfg.seed = 0 before building the model
    fresh, _ = build_model(_config(data_dir, out, method), torch.device("cpu"))
    final = ckpt.load(out / "model.pt")["model"]
    moved = [not torch.equal(final[k], v) for k, v in fresh.state_dict().items() if ".mixer." in k]
    assert any(moved)


def test_existing_run_needs_resume(data_dir, tmp_path):
    cfg = _config(data_dir, tmp_path / "run", steps=3)
    train(cfg)
    with pytest.raises(ValueError, match="resume"):
        train(cfg)
    cfg.resume = True
    again = train(cfg)  # the run is complete: only the final evaluation runs again
    assert again["steps"] == 3
    assert sum(1 for r in _rows(tmp_path / "run" / "metrics.csv") if r[1] == "test") == 1
    cfg.lr = 5e-4
    with pytest.raises(ValueError, match="different configuration.*lr"):
        train(cfg)


@pytest.mark.slow  # a whole command or subprocess run: .ci/run, not make test
def test_resume_after_sigkill_matches_uninterrupted_run(data_dir, tmp_path):
    """Kill a run with SIGKILL once it has written a checkpoint, resume it, and compare with a
    run that was never interrupted: identical parameters and metrics. Performer (features redrawn
    from the global RNG at every training step) and dropout make the RNG restore matter."""
    steps = 80
    command = [sys.executable, "-m", "subquad.train.cli", "train", "listops", "--method", "performer",
               "-o", "num_features=8", "--data", str(data_dir), "--steps", str(steps), "--batch-size", "8",
               "--pad-to", "64", "--dim", "16", "--ffn-dim", "32", "--head-hidden", "16", "--lr", "1e-3",
               "--warmup-steps", "10", "--dropout", "0.1", "--eval-every", "40", "--checkpoint-every", "10",
               "--log-every", "10", "--threads", "1", "--no-progress", "--no-tensorboard"]
    ref_out, run_out = tmp_path / "reference", tmp_path / "killed"
    env = _env()
    reference = subprocess.Popen(command + ["--out", str(ref_out)], env=env, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE)
    victim = subprocess.Popen(command + ["--out", str(run_out)], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not (run_out / "checkpoint.pt").exists():
        assert victim.poll() is None, victim.stderr.read().decode()
        assert time.monotonic() < deadline, "no checkpoint after 120 s"
        time.sleep(0.01)
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait()
    assert victim.returncode == -signal.SIGKILL
    killed_at = ckpt.load(run_out / "checkpoint.pt")["step"]
    assert 0 < killed_at < steps and not (run_out / "results.json").exists()
    resumed = subprocess.run(command + ["--out", str(run_out), "--resume"], env=env, capture_output=True,
                             text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming {run_out} from step {killed_at}" in resumed.stdout
    assert reference.wait(timeout=300) == 0, reference.stderr.read().decode()
    a, b = ckpt.load(ref_out / "model.pt")["model"], ckpt.load(run_out / "model.pt")["model"]
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert _rows(ref_out / "metrics.csv") == _rows(run_out / "metrics.csv")
    ra, rb = (json.loads((d / "results.json").read_text()) for d in (ref_out, run_out))
    for key in ("test_accuracy", "test_loss", "best_val_accuracy", "best_val_step", "test_accuracy_best_val"):
        assert ra[key] == rb[key], key


@pytest.mark.slow  # a whole command or subprocess run: .ci/run, not make test
def test_two_process_ddp_matches_one_process(data_dir, tmp_path):
    """``torchrun --nproc_per_node=2`` (gloo, 4 samples per process) ends with the parameters of
    one process with the same global batch of 8 (float64, no dropout)."""
    steps = 4
    args = ["train", "listops", "--method", "softmax", "--data", str(data_dir), "--steps", str(steps),
            "--batch-size", "8", "--pad-to", "64", "--dim", "16", "--ffn-dim", "32", "--head-hidden", "16",
            "--lr", "1e-2", "--warmup-steps", "1", "--dropout", "0", "--attn-dropout", "0",
            "--dtype", "float64", "--eval-every", "2", "--checkpoint-every", "2", "--log-every", "2",
            "--threads", "1", "--no-progress", "--no-tensorboard"]
    ddp_out = tmp_path / "ddp"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    proc = subprocess.run([*launcher, "-m", "subquad.train.cli", *args, "--out", str(ddp_out)],
                          env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 process(es) on cpu, batch 8 (4 per process)" in proc.stdout
    assert proc.stdout.count("test accuracy") == 1  # only rank 0 reports and writes
    one = train(_config(data_dir, tmp_path / "one", steps=steps, lr=1e-2, warmup_steps=1, dropout=0.0,
                        attention_dropout=0.0, dtype="float64", eval_every=2, checkpoint_every=2,
                        log_every=2))
    a, b = ckpt.load(ddp_out / "model.pt")["model"], ckpt.load(tmp_path / "one" / "model.pt")["model"]
    torch.manual_seed(0)
    fresh, _ = build_model(_config(data_dir, tmp_path, dtype="float64"), torch.device("cpu"))
    assert max((a[k] - v).abs().max().item() for k, v in fresh.state_dict().items()) > 1e-3  # it trained
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-9, atol=1e-10, msg=k)
    ddp_results = json.loads((ddp_out / "results.json").read_text())
    assert ddp_results["world_size"] == 2
    assert ddp_results["test_accuracy"] == one["test_accuracy"]
    assert ddp_results["best_val_accuracy"] == one["best_val_accuracy"]
    assert ddp_results["config"]["batching"] == "bucket"


@pytest.mark.slow  # a whole command or subprocess run: .ci/run, not make test
def test_two_process_ddp_matches_one_process_on_mqar(tmp_path):
    """The task interface under torchrun: MQAR, whose samples carry different numbers of labels
    (a mixture of pair counts), ends with the parameters of one process with the same global batch:
    the loss is the mean over every process's labels."""
    task = ["-t", "seq_len=32", "-t", "num_pairs=4", "-t", "train_pairs=(1,2,4)", "-t", "vocab_size=24",
            "-t", "train_size=64", "-t", "eval_size=8"]
    args = ["train", "mqar", "--method", "linear", *task, "--steps", "4", "--batch-size", "8", "--pad-to", "32",
            "--dim", "16", "--ffn-dim", "32", "--lr", "1e-2", "--warmup-steps", "1", "--dtype", "float64",
            "--eval-every", "2", "--checkpoint-every", "2", "--log-every", "2", "--threads", "1", "--no-progress",
            "--no-tensorboard"]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    proc = subprocess.run([*launcher, "-m", "subquad.train.cli", *args, "--out", str(tmp_path / "ddp")],
                          env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert cli_main([*args, "--out", str(tmp_path / "one")]) == 0
    a, b = (ckpt.load(tmp_path / d / "model.pt")["model"] for d in ("ddp", "one"))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-9, atol=1e-10, msg=k)


# --------------------------------------------------------------------------- command line errors


def test_cli_unknown_method(data_dir, tmp_path, capsys):
    code = cli_main(["train", "listops", "--method", "nope", "--data", str(data_dir), "--out", str(tmp_path)])
    assert code == 2
    err = capsys.readouterr().err
    assert "unknown method 'nope'" in err and "softmax" in err and "nystrom" in err


def test_cli_missing_data_dir(tmp_path, capsys):
    code = cli_main(["train", "listops", "--method", "softmax", "--data", str(tmp_path / "none"),
                     "--out", str(tmp_path / "run")])
    assert code == 2
    assert "subquad data listops --out" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli_main(["train", "listops", "--method", "softmax", "--data", str(empty),
                     "--out", str(tmp_path / "run")]) == 2
    assert "no ListOps data" in capsys.readouterr().err


def test_cli_bad_method_option(data_dir, tmp_path, capsys):
    code = cli_main(["train", "listops", "--method", "nystrom", "--landmarks", "4", "--data", str(data_dir),
                     "--out", str(tmp_path)])
    assert code == 2
    err = capsys.readouterr().err
    assert "deprecated: use -o landmarks=4 instead of --landmarks 4" in err and "unknown option" in err
    code = cli_main(["train", "listops", "--method", "nystrom", "-o", "landmarks=4", "--data", str(data_dir),
                     "--out", str(tmp_path)])
    assert code == 2
    err = capsys.readouterr().err
    assert "unknown option" in err and "deprecated" not in err
    code = cli_main(["train", "listops", "--method", "nystrom", "-o", "performer.num_features=4", "--data",
                     str(data_dir), "--out", str(tmp_path)])
    assert code == 2 and "option of method 'performer'" in capsys.readouterr().err
    code = cli_main(["train", "listops", "--method", "performer", "-o", "num_features=0", "--data",
                     str(data_dir), "--out", str(tmp_path)])
    assert code == 2 and "num_features" in capsys.readouterr().err


def test_cli_bad_numbers(data_dir, tmp_path, capsys):
    assert cli_main(["train", "listops", "--method", "softmax", "--steps", "0", "--data", str(data_dir),
                     "--out", str(tmp_path)]) == 2
    assert "train: steps must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["train", "listops", "--data", str(data_dir)])  # --method is required
    with pytest.raises(SystemExit):
        cli_main(["data", "listops", "--bogus"])
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_cli_data_and_train(tmp_path, capsys):
    out = tmp_path / "data"
    args = ["data", "listops", "--out", str(out), "--train-size", "40", "--val-size", "8", "--test-size", "8",
            "--max-depth", "3", "--min-length", "4", "--max-length", "40"]
    assert cli_main(args) == 0
    text = capsys.readouterr().out
    assert "wrote 40 train / 8 val / 8 test" in text and "majority class" in text
    meta = json.loads((out / "meta.json").read_text())
    assert meta["sizes"] == {"train": 40, "val": 8, "test": 8} and meta["seed"] == 0
    assert cli_main(args) == 2 and "--force" in capsys.readouterr().err
    assert cli_main(args + ["--force"]) == 0
    code = cli_main(["train", "listops", "--method", "linear", "--data", str(out),
                     "--out", str(tmp_path / "run"), "--steps", "2", "--batch-size", "4", "--dim", "8",
                     "--ffn-dim", "8", "--pad-to", "48",
                     "--no-progress", "--no-tensorboard"])
    assert code == 0
    assert "majority baseline" in capsys.readouterr().out


class _FakeWriter:
    """Stands in for torch.utils.tensorboard.SummaryWriter (tensorboard is an optional extra)."""

    instances: list["_FakeWriter"] = []

    def __init__(self, log_dir, purge_step=None):
        self.log_dir, self.purge_step, self.scalars, self.closed = log_dir, purge_step, [], False
        _FakeWriter.instances.append(self)

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, value, step))

    def close(self):
        self.closed = True


def test_tensorboard_when_installed(data_dir, tmp_path, monkeypatch):
    import types

    fake = types.ModuleType("torch.utils.tensorboard")
    fake.SummaryWriter = _FakeWriter
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake)
    _FakeWriter.instances.clear()
    cfg = _config(data_dir, tmp_path / "run", steps=4, tensorboard=None, checkpoint_every=2)
    train(cfg)
    writer = _FakeWriter.instances[-1]
    assert writer.closed and writer.purge_step is None and writer.log_dir.endswith("tensorboard")
    tags = {tag for tag, _, _ in writer.scalars}
    assert {"train/loss", "train/accuracy", "train/lr", "val/accuracy", "test/accuracy"} <= tags
    # a resumed run purges what came after its checkpoint
    cfg = _config(data_dir, tmp_path / "sliced", steps=4, tensorboard=None, max_minutes=1e-9)
    assert train(cfg)["step"] == 1
    cfg.resume = True
    train(cfg)
    assert _FakeWriter.instances[-1].purge_step == 2


def test_tensorboard_requested_but_missing(data_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    with pytest.raises(ValueError, match="tensorboard"):
        train(_config(data_dir, tmp_path / "run", steps=2, tensorboard=True))
    results = train(_config(data_dir, tmp_path / "run2", steps=2, tensorboard=None))  # auto: CSV only
    assert results["steps"] == 2 and not (tmp_path / "run2" / "tensorboard").exists()


def test_bf16_autocast_run(data_dir, tmp_path):
    results = train(_config(data_dir, tmp_path / "run", "nystrom", steps=2, amp="bf16"))
    assert np.isfinite(results["test_loss"])
    final = ckpt.load(tmp_path / "run" / "model.pt")["model"]
    assert all(v.dtype == torch.float32 for v in final.values() if v.is_floating_point())


def test_time_budget_stops_with_a_checkpoint_and_resume_finishes_the_run(data_dir, tmp_path):
    """``max_minutes`` stops after the first step (writing a checkpoint); resuming in slices ends
    exactly where a run in one piece ends."""
    kwargs = dict(method_options={"num_features": 8}, steps=7, dropout=0.1)
    whole = train(_config(data_dir, tmp_path / "whole", "performer", **kwargs))
    cfg = _config(data_dir, tmp_path / "sliced", "performer", max_minutes=1e-9, **kwargs)
    first = train(cfg)
    assert first["stopped"] and first["step"] == 1
    assert ckpt.load(tmp_path / "sliced" / "checkpoint.pt")["step"] == 1
    assert not (tmp_path / "sliced" / "results.json").exists()
    cfg.resume = True
    assert train(cfg)["step"] == 2  # one more slice
    cfg.max_minutes = None
    sliced = train(cfg)
    assert sliced["test_accuracy"] == whole["test_accuracy"] and sliced["test_loss"] == whole["test_loss"]
    a, b = (ckpt.load(tmp_path / d / "model.pt")["model"] for d in ("whole", "sliced"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert _rows(tmp_path / "whole" / "metrics.csv") == _rows(tmp_path / "sliced" / "metrics.csv")


def test_init_from_starts_from_another_runs_weights(data_dir, tmp_path):
    """A warm start takes the weights of the source file exactly (step 0 equals the source), runs
    its own schedule, and a later --resume continues from its own checkpoint, not the source."""
    train(_config(data_dir, tmp_path / "short", steps=3))
    source = ckpt.load(tmp_path / "short" / "model.pt")["model"]
    cfg = _config(data_dir, tmp_path / "warm", steps=4, lr=1e-12, warmup_steps=0,
                  init_from=str(tmp_path / "short" / "model.pt"))
    result = train(cfg)
    assert result["config"]["init_from"] == str(tmp_path / "short" / "model.pt")
    warm = ckpt.load(tmp_path / "warm" / "model.pt")["model"]
    for k, v in source.items():  # lr 1e-12: the weights barely move from the source's
        torch.testing.assert_close(warm[k], v, atol=1e-6, rtol=0)
    # and the source is far from this seed's own initial weights, so the check above can fail
    fresh, _ = build_model(_config(data_dir, tmp_path / "x"), torch.device("cpu"))
    assert max((fresh.state_dict()[k] - v).abs().max().item() for k, v in source.items()) > 1e-4


def test_init_from_resume_ignores_the_source(data_dir, tmp_path):
    train(_config(data_dir, tmp_path / "short", steps=3))
    src = tmp_path / "short" / "model.pt"
    out = tmp_path / "warm"
    first = _config(data_dir, out, steps=6, max_minutes=1e-9, init_from=str(src))
    train(first)  # stops at once with a checkpoint
    assert (out / "checkpoint.pt").is_file()
    src.unlink()  # a resumed run reads only its own checkpoint
    again = _config(data_dir, out, steps=6, resume=True, init_from=str(src))
    assert train(again)["steps"] == 6


def test_init_from_errors(data_dir, tmp_path, capsys):
    train(_config(data_dir, tmp_path / "small", steps=2))
    src = str(tmp_path / "small" / "best.pt")
    with pytest.raises(ValueError, match="does not fit this run's model: shapes differ"):
        train(_config(data_dir, tmp_path / "wide", steps=2, dim=32, init_from=src))
    with pytest.raises(ValueError, match="does not fit this run's model: missing"):
        train(_config(data_dir, tmp_path / "deep", steps=2, layers=3, init_from=src))
    code = cli_main(["train", "listops", "--method", "softmax", "--data", str(data_dir), "--out",
                     str(tmp_path / "none"), "--init-from", str(tmp_path / "nothing.pt"), "--steps", "2"])
    assert code == 2 and "nothing.pt" in capsys.readouterr().err
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint")
    code = cli_main(["train", "listops", "--method", "softmax", "--data", str(data_dir), "--out",
                     str(tmp_path / "none2"), "--init-from", str(bad), "--steps", "2"])
    assert code == 2 and "not a readable checkpoint" in capsys.readouterr().err


def test_no_progress_keeps_the_log_lines(data_dir, tmp_path, capsys):
    """progress=False (--no-progress) drops the bar only: a line every log_every steps and one
    per evaluation still reach stdout."""
    train(_config(data_dir, tmp_path / "run"))
    out = capsys.readouterr().out
    assert "step 2: " in out and "step 4: " in out and "step 6: " in out
    assert "step 3: val loss" in out and "step 6: val loss" in out


def test_short_run_warms_up_within_half_its_steps(data_dir, tmp_path):
    """With the presets' 1000 warm-up steps, a 6-step run still reaches its learning rate: the
    warm-up ends at step 3 (half the run), then the linear decay (rows logged at steps 2, 4, 6)."""
    cfg = _config(data_dir, tmp_path / "run", warmup_steps=1000)
    train(cfg)
    lrs = {int(s): float(lr) for s, split, *_, lr in _rows(tmp_path / "run" / "metrics.csv") if split == "train"}
    assert lrs[2] == pytest.approx(cfg.lr * 2 / 3)
    assert lrs[4] == pytest.approx(cfg.lr * 3 / 4)


def test_eval_samples_limits_the_final_test(data_dir, tmp_path):
    train(_config(data_dir, tmp_path / "run", eval_samples=5))
    tests = [r for r in _rows(tmp_path / "run" / "metrics.csv") if r[1] == "test"]
    assert tests and all(int(r[4]) == 5 for r in tests)


@pytest.mark.parametrize("field,error,match", [
    (dict(steps=0), ValueError, "train: steps must be >= 1, got 0"),
    (dict(layers=True), TypeError, "train: layers must be an int"),
    (dict(dropout=1.0), ValueError, "train: dropout must be < 1"),
    (dict(betas=(0.9, 1.2)), ValueError, r"train: betas\[1\] must be < 1"),
    (dict(betas=(0.9,)), ValueError, "betas must be two numbers"),
    (dict(lr=0), ValueError, "train: lr must be > 0.0"),
    (dict(grad_clip=0.0), ValueError, "train: grad_clip must be > 0.0"),
    (dict(batching="x"), ValueError, r"train: batching must be one of \['bucket', 'pad'\]"),
    (dict(amp="bf16", dtype="float64"), ValueError, "amp needs dtype='float32'"),
    (dict(dim=10, heads=3), ValueError, "divisible by heads"),
    (dict(task="nope"), ValueError, "unknown task 'nope'"),
    (dict(context_parallel=0), ValueError, "train: context_parallel must be >= 1"),
    (dict(context_parallel=2), ValueError, "labels per position; task 'listops' has labels per sequence"),
    (dict(context_parallel=2, task="mqar", pooling="none", method="nystrom"), ValueError,
     "method 'nystrom' has no context-parallel form"),
    (dict(context_parallel=2, task="digit_scenes", pooling="none"), ValueError, "task 'digit_scenes' has images"),
])
def test_config_errors_name_the_field(field, error, match):
    with pytest.raises(error, match=match):
        TrainConfig(**{"method": "linear", **field}).validate()
