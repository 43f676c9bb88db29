"""Wall-clock time of a call: the median of at least ``min_runs`` timed blocks of calls, with
all of torch's threads (or ``num_threads``).

One call runs first, untimed (the warm-up, and the estimate that sizes the blocks); then blocks
of ``number`` calls (as many as fit ``min_run_time / min_runs``, at least one) are timed until
there are ``min_runs`` of them and ``min_run_time`` has passed, so a call of several seconds is
measured ``min_runs`` times, never once. The accelerator is synchronised around each block, so
CUDA kernels are timed, not just launched. (``torch.utils.benchmark.Timer.timeit`` runs two
untimed calls before every block it times, which would triple the cost of a multi-second point.)
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

__all__ = ["Timing", "median_time", "MIN_RUNS", "BusyNeighbours"]

#: blocks of calls every timed point is the median of
MIN_RUNS = 5


@dataclass
class Timing:
    """``seconds``: median seconds per call over the blocks; ``fastest``: the fastest block's
    seconds per call; ``runs``: calls measured (after the warm-up); ``times``: seconds per call of
    each block; ``first``: the warm-up call's seconds; ``spread``: ``(slowest - fastest) / median``
    of the blocks (0 for one block)."""

    seconds: float
    fastest: float
    runs: int
    times: list[float] = field(default_factory=list)
    first: float | None = None  # the warm-up call's seconds (with a compiled op: compiling it)

    @property
    def spread(self) -> float:
        return (max(self.times) - min(self.times)) / self.seconds if len(self.times) > 1 else 0.0


def median_time(fn: Callable[[], object], min_run_time: float, *, num_threads: int | None = None,
                min_runs: int = MIN_RUNS) -> Timing:
    """Median seconds of ``fn()`` over at least ``min_runs`` timed blocks and ``min_run_time``
    seconds, with ``num_threads`` torch threads (default: all of torch's current threads)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() and torch.cuda.is_initialized() else (lambda: None)

    def block(number: int) -> float:
        sync()
        start = time.perf_counter()
        for _ in range(number):
            fn()
        sync()
        return (time.perf_counter() - start) / number

    threads = torch.get_num_threads()
    torch.set_num_threads(threads if num_threads is None else num_threads)
    try:
        first = block(1)  # the warm-up, untimed in the result
        number = max(1, int(min_run_time / max(min_runs, 1) / max(first, 1e-9)))
        times: list[float] = []
        while len(times) < min_runs or sum(times) * number < min_run_time:
            times.append(block(number))
    finally:
        torch.set_num_threads(threads)
    return Timing(seconds=statistics.median(times), fastest=min(times), runs=number * len(times), times=times,
                  first=first)



class BusyNeighbours:
    """``with BusyNeighbours(count):`` ``count`` processes each spinning on a core (a bare Python
    loop, in an interpreter that imports nothing: what a data loader or a second job does to a
    shared machine) for the duration of the block; nothing for ``count == 0``."""

    def __init__(self, count: int):
        self.count = count
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> "BusyNeighbours":
        self.procs = [subprocess.Popen([sys.executable, "-S", "-c", "while True: pass"])
                      for _ in range(self.count)]
        if self.procs:
            time.sleep(0.2)  # let them start spinning
        return self

    def __exit__(self, *exc) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()
