"""Starts the context-parallel tests (tests/distributed/) and the README's example on two processes
with torchrun and gloo."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _torchrun(*args: str, processes: int = 2) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PYTEST_XDIST_WORKER", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}", *args]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-6000:]
    return done.stdout


@pytest.mark.slow  # two processes under torchrun running tests/distributed: about 25 s
def test_context_parallel_on_two_processes():
    out = _torchrun("-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                    str(ROOT / "tests" / "distributed"))
    assert " passed" in out and " failed" not in out, out[-3000:]


@pytest.mark.slow  # the README's example under torchrun: about 35 s
def test_readme_example():
    out = _torchrun(str(ROOT / "examples" / "context_parallel.py"))
    assert "hybrid" in out and "linear" in out, out


@pytest.mark.slow  # two whole training runs (one under torchrun): about 40 s
@pytest.mark.parametrize("processes", [2, 4])
def test_train_with_context_parallel_equals_one_process(tmp_path, processes):
    """`subquad train mqar --context-parallel 2` under torchrun (each sequence split over two
    processes; with 4, two such groups train data-parallel) ends with the parameters one process
    reaches on the same batches."""
    import torch

    args = ["train", "mqar", "--method", "linear", "-t", "seq_len=64", "-t", "num_pairs=4", "-t", "train_size=64",
            "-t", "eval_size=16", "--steps", "4", "--batch-size", "8", "--eval-every", "2", "--threads", "1",
            "--no-progress", "--no-tensorboard"]
    out = _torchrun("-m", "subquad.train.cli", *args, "--context-parallel", "2", "--out", str(tmp_path / "cp"),
                    processes=processes)
    assert "each sequence split over 2 processes" in out, out
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "subquad.train.cli", *args, "--out", str(tmp_path / "one")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    cp, one = (torch.load(tmp_path / d / "model.pt", weights_only=False)["model"] for d in ("cp", "one"))
    assert cp.keys() == one.keys()
    for name in one:
        torch.testing.assert_close(cp[name], one[name], rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
