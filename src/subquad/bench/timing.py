"""Wall-clock time of a call: the median of ``torch.utils.benchmark``, all of torch's threads.

The Timer synchronises the accelerator around each block, so CUDA kernels are timed, not
just launched. Its block-size estimate runs the call at least once before measuring, which
doubles as the warm-up; a call slower than ``min_run_time`` is then measured once more.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.utils.benchmark as benchmark

__all__ = ["Timing", "median_time"]


@dataclass
class Timing:
    """``seconds``: median seconds per call; ``fastest``: the fastest block's seconds per call;
    ``runs``: calls measured (after the warm-up); ``times``: seconds per call of each measured
    block (``len(times)`` blocks)."""

    seconds: float
    fastest: float
    runs: int
    times: list[float] = field(default_factory=list)


def median_time(fn: Callable[[], object], min_run_time: float, *, num_threads: int | None = None) -> Timing:
    """Median seconds of ``fn()`` from ``Timer.blocked_autorange(min_run_time)``, with
    ``num_threads`` torch threads (default: all of torch's current threads)."""
    threads = torch.get_num_threads() if num_threads is None else num_threads
    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=threads)
    m = timer.blocked_autorange(min_run_time=min_run_time)
    return Timing(seconds=m.median, fastest=min(m.times), runs=m.number_per_run * len(m.raw_times),
                  times=list(m.times))
