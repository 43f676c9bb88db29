"""Helpers shared by the ops: the one-thread policy for small CPU work, and independent chains
spread over threads of their own."""

from __future__ import annotations

import threading

import pytest
import torch

from subquad.ops._common import one_thread, over_threads


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


def test_over_threads_runs_every_item_once_on_one_torch_thread_each(two_threads):
    seen, lock = [], threading.Lock()

    def work(i):
        with lock:
            seen.append((i, torch.get_num_threads(), threading.get_ident()))

    over_threads(work, 7)
    assert sorted(i for i, _, _ in seen) == list(range(7))
    assert {t for _, t, _ in seen} == {1}
    assert threading.get_ident() not in {ident for _, _, ident in seen}
    assert torch.get_num_threads() == 2


def test_over_threads_writes_disjoint_outputs_like_a_loop(two_threads):
    x = torch.randn(6, 50, 40)
    out = torch.empty(6, 50, 50)

    def work(i):
        torch.matmul(x[i], x[i].t(), out=out[i])

    over_threads(work, 6)
    torch.testing.assert_close(out, x @ x.transpose(1, 2))


def test_over_threads_raises_the_error_of_a_call(two_threads):
    def work(i):
        if i == 3:
            raise ValueError("item 3")

    with pytest.raises(ValueError, match="item 3"):
        over_threads(work, 5)
    assert torch.get_num_threads() == 2


def test_over_threads_stays_in_the_caller_on_one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        idents = []
        over_threads(lambda i: idents.append(threading.get_ident()), 3)
        assert idents == [threading.get_ident()] * 3
    finally:
        torch.set_num_threads(threads)


def test_a_new_pool_after_a_fork(two_threads, monkeypatch):
    import subquad.ops._common as common

    over_threads(lambda i: None, 2)
    before = common._pool[2]
    monkeypatch.setattr(common.os, "getpid", lambda: -1)  # as in a forked child: the parent's threads are gone
    over_threads(lambda i: None, 2)
    assert common._pool[2] is not before


def test_over_threads_stays_in_the_caller_under_a_mode(two_threads):
    """Dispatch and function modes are per thread: with one active (here the FLOP counter) the
    work runs in the caller, where the mode sees it."""
    from torch.utils.flop_counter import FlopCounterMode

    x = torch.randn(4, 8, 8)
    out = torch.empty(4, 8, 8)
    idents = []

    def work(i):
        idents.append(threading.get_ident())
        torch.matmul(x[i], x[i], out=out[i])

    with FlopCounterMode(display=False) as counter:
        over_threads(work, 4)
    assert set(idents) == {threading.get_ident()}
    assert counter.get_total_flops() == 4 * 2 * 8**3


def test_over_threads_runs_work_in_the_callers_grad_and_inference_mode(two_threads):
    seen, lock = [], threading.Lock()

    def work(i):
        with lock:
            seen.append((torch.is_grad_enabled(), torch.is_inference_mode_enabled()))

    with torch.no_grad():
        over_threads(work, 2)
    with torch.inference_mode():
        over_threads(work, 2)
    over_threads(work, 2)
    assert seen == [(False, False)] * 2 + [(False, True)] * 2 + [(True, False)] * 2
