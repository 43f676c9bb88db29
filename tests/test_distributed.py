"""Starts the context-parallel tests (tests/distributed/) and the README's example on two processes
with torchrun and gloo."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _torchrun(*args: str) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PYTEST_XDIST_WORKER", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *args]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-6000:]
    return done.stdout


def test_context_parallel_on_two_processes():
    out = _torchrun("-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                    str(ROOT / "tests" / "distributed"))
    assert " passed" in out and " failed" not in out, out[-3000:]


def test_readme_example():
    out = _torchrun(str(ROOT / "examples" / "context_parallel.py"))
    assert "hybrid" in out and "linear" in out, out
