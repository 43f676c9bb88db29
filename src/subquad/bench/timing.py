"""Wall-clock time of a call: the median of ``torch.utils.benchmark``, all of torch's threads.

The Timer synchronises the accelerator around each block, so CUDA kernels are timed, not
just launched. Its block-size estimate runs the call at least once before measuring, which
doubles as the warm-up; a call slower than ``min_run_time`` is then measured once more.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.utils.benchmark as benchmark

__all__ = ["Timing", "median_time"]


@dataclass
class Timing:
    """``seconds``: median seconds per call; ``fastest``: the fastest block's seconds per call;
    ``runs``: calls measured (after the warm-up)."""

    seconds: float
    fastest: float
    runs: int


def median_time(fn: Callable[[], object], min_run_time: float) -> Timing:
    """Median seconds of ``fn()`` from ``Timer.blocked_autorange(min_run_time)``."""
    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    m = timer.blocked_autorange(min_run_time=min_run_time)
    return Timing(seconds=m.median, fastest=min(m.times), runs=m.number_per_run * len(m.raw_times))
