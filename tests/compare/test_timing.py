"""subquad.compare.timing: every point is a median of several timed blocks, and report.py says
when the machine was loaded or a point's blocks spread wide."""

import time

from subquad.compare.report import timing_warnings
from subquad.compare.timing import MIN_RUNS, median_time


def test_a_slow_call_is_still_timed_min_runs_times():
    calls = []

    def slow():
        calls.append(1)
        time.sleep(0.02)

    t = median_time(slow, min_run_time=0.01)  # one call outlasts min_run_time
    assert len(t.times) == MIN_RUNS and t.runs == MIN_RUNS
    assert len(calls) == MIN_RUNS + 1  # plus the untimed warm-up
    assert 0.015 < t.seconds < 0.2 and t.fastest <= t.seconds
    assert t.spread >= 0.0


def test_a_fast_call_runs_in_blocks_for_min_run_time():
    t = median_time(lambda: sum(range(100)), min_run_time=0.05)
    assert len(t.times) >= MIN_RUNS and t.runs > len(t.times)
    assert sum(t.times) * (t.runs // len(t.times)) >= 0.05


def _result(load_1min, spread):
    row = {"n": 1024, "method": "linear", "forward_spread": spread, "forward_backward_spread": None}
    load = {"load_1min": load_1min, "cores": 2}
    return {"machine": {"threads": 2, "load": {"before": load, "after": load}}, "rows": [row]}


def test_timing_warnings_name_a_loaded_machine_and_a_wide_spread():
    assert timing_warnings(_result(0.3, 0.1)) == []
    loaded = timing_warnings(_result(1.9, 0.1))
    assert len(loaded) == 2 and "load average 1.9 on 2 cores" in loaded[0]
    (wide,) = timing_warnings(_result(0.3, 0.8))
    assert wide == "N=1024 linear: forward runs spread 80 % of their median"


def test_a_rate_over_the_roof_is_named():
    res = _result(0.3, 0.1)
    res["rows"][0]["matmul_fraction"] = 1.33
    (warning,) = timing_warnings(res)
    assert warning.startswith("N=1024 linear: 133 % of the matmul roof")


def test_least_memory_says_when_exact_attention_wins():
    from subquad.compare.report import least_memory_lines

    rows = [{"n": 1024, "method": "softmax", "forward_bytes": 1 << 20},
            {"n": 1024, "method": "linear", "forward_bytes": 2 << 20},
            {"n": 4096, "method": "softmax", "forward_bytes": 8 << 20},
            {"n": 4096, "method": "linear", "forward_bytes": 4 << 20}]
    lines = least_memory_lines({"rows": rows})
    assert lines[0] == "## Memory"
    assert "N=1024: least forward peak memory: softmax" in lines[2] and "exact attention uses less" in lines[2]
    assert "N=4096: least forward peak memory: linear" in lines[3] and "exact attention 8" in lines[3]
