"""The context-parallel tests run on several processes: under ``torchrun`` (``tests/test_distributed.py``
starts ``torchrun --nproc_per_node=2 -m pytest tests/distributed`` on gloo), where this file joins
the process group once per process. Collected by a plain ``pytest``, they are skipped."""

from __future__ import annotations

import datetime
import os

import pytest
import torch.distributed as dist

UNDER_TORCHRUN = "WORLD_SIZE" in os.environ


def pytest_collection_modifyitems(config, items):
    if UNDER_TORCHRUN:
        return
    skip = pytest.mark.skip(reason="runs under torchrun (tests/test_distributed.py starts it)")
    for item in items:
        if "tests/distributed/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def process_group():
    if not UNDER_TORCHRUN:
        yield None
        return
    # a rank that fails between collectives leaves the others waiting: time out, never hang
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    yield dist.group.WORLD
    dist.destroy_process_group()
