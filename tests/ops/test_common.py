"""Helpers shared by the ops: the one-thread policy for small CPU work."""

from __future__ import annotations

import pytest
import torch

from subquad.ops._common import one_thread


@pytest.fixture
def two_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def test_one_thread_inside_and_restored(two_threads):
    with one_thread(True):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2


def test_inactive_leaves_threads_alone(two_threads):
    with one_thread(False):
        assert torch.get_num_threads() == 2
    assert torch.get_num_threads() == 2


def test_restored_after_an_error(two_threads):
    with pytest.raises(RuntimeError), one_thread(True):
        raise RuntimeError("inside")
    assert torch.get_num_threads() == 2
