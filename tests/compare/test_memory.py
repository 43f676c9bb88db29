"""Peak memory of one point, in this process and in a fresh one (subquad.compare.memory)."""

import json

import pytest
import torch

from subquad.compare import memory

SPEC = {"method": "linear", "options": {}, "batch": 1, "heads": 2, "n": 2048, "dim": 32, "dtype": "float32",
        "device": "cpu", "seed": 0, "backward": True, "threads": 1}


def test_measure_in_process_reports_both_phases():
    # in this process memory freed by earlier tests may be reused, so only the shape of the answer
    out = memory.measure(SPEC)
    assert out["forward_error"] is None and out["backward_error"] is None
    assert out["forward_bytes"] >= 0 and out["forward_backward_bytes"] >= 0


def test_measure_reports_a_failing_method_instead_of_raising():
    out = memory.measure({**SPEC, "options": {"chunk_size": 0}})
    assert out["forward_bytes"] is None
    assert "chunk_size" in out["forward_error"]


def test_no_backward_phase_when_not_asked():
    out = memory.measure({**SPEC, "method": "softmax", "backward": False})
    assert out["forward_bytes"] is not None and out["forward_backward_bytes"] is None


def test_measure_in_a_fresh_process():
    out = memory.measure_in_subprocess({**SPEC, "method": "softmax"}, timeout=120)
    assert out["forward_error"] is None, out
    # the forward allocates at least its output (B, H, N, D) float32, the backward three gradients
    output_bytes = 1 * 2 * 2048 * 32 * 4
    assert out["forward_bytes"] >= output_bytes
    assert out["forward_backward_bytes"] >= 3 * output_bytes


@pytest.mark.slow  # a subprocess that fails on purpose
def test_a_failing_subprocess_is_reported():
    out = memory.measure_in_subprocess({**SPEC, "method": "no-such-method"}, timeout=120)
    assert out["forward_bytes"] is None
    assert "no-such-method" in out["forward_error"]


def test_main_prints_one_json_line(capsys):
    assert memory.main([json.dumps({**SPEC, "n": 64, "backward": False})]) == 0
    line = capsys.readouterr().out.strip()
    assert json.loads(line)["forward_bytes"] is not None
    assert memory.main([]) == 2
    torch.set_num_threads(1)  # measure() set it from the spec; keep the suite's setting
