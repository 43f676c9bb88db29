"""The options of ``subquad compare``'s timing run on random inputs: ``--causal``, ``--compile``,
``--busy``, ``--objective decode`` and the speed-up ceiling column."""

import json

import pytest
import torch

import subquad
from subquad.compare.decode import WARMUP_TOKENS, decode_time, decoding_form
from subquad.compare.timing import BusyNeighbours
from subquad.compare.workload import forward_call, make_qkv

from conftest import run_cli

TINY = ["--heads", "2", "--dim", "8", "--min-run-time", "0.001", "--max-call-seconds", "1", "--no-memory", "--quiet",
        "--error-inputs", "iid"]


def _results(tmp_path, capsys, *argv):
    code, out, err = run_cli(["compare", *TINY, *argv, "--out", str(tmp_path)], capsys)
    assert code == 0, err
    return json.loads((tmp_path / "results.json").read_text()), out


def test_causal_decode_runs_causal_methods_against_causal_exact_attention(tmp_path, capsys):
    res, out = _results(tmp_path, capsys, "--n", "48", "--methods", "linear", "hybrid", "sinkhorn", "nystrom",
                        "--causal", "--no-backward", "--objective", "decode", "--decode-steps", "3")
    rows = {r["method"]: r for r in res["rows"]}
    assert set(rows) == {"softmax", "linear", "hybrid", "sinkhorn"}  # nystrom has no causal form
    assert any("nystrom" in note for note in res["notes"])
    # exact attention is exact against the causal reference; the non-causal one would be far off
    assert rows["softmax"]["rel_error"] < 1e-5
    q, k, v = make_qkv(1, 2, 48, 8, seed=48)
    exact = subquad.attention(q, k, v, method="softmax", causal=True)
    linear = forward_call(subquad.get_method("linear"), q, k, v, {}, causal=True)()
    expected = float((linear - exact).norm() / exact.norm())
    assert rows["linear"]["rel_error"] == pytest.approx(expected, rel=1e-3)
    # decode: a time per token for each decoding form, none for sinkhorn
    for name in ("softmax", "linear", "hybrid"):
        assert rows[name]["decode_s"] > 0 and rows[name]["cache_bytes"] > 0, name
    assert rows["softmax"]["decoding"] == "keys" and rows["linear"]["decoding"] == "state"
    assert rows["softmax"]["speedup_decode"] == 1.0
    assert "no decoding form" in rows["sinkhorn"]["errors"]["decode"]
    assert "decode per token ms" in out and "decode ms/token" in out


@pytest.mark.slow  # compiles two ops, forward only
def test_compile_adds_a_compiled_twin_with_the_same_output(tmp_path, capsys):
    res, _ = _results(tmp_path, capsys, "--n", "32", "--methods", "linear", "--compile", "--no-backward")
    rows = {r["method"]: r for r in res["rows"]}
    assert set(rows) == {"softmax", "softmax compiled", "linear", "linear compiled"}
    assert rows["linear compiled"]["rel_error"] == pytest.approx(rows["linear"]["rel_error"], rel=1e-4)
    assert all(r["forward_first_s"] > 0 for r in rows.values())
    assert "first call ms" in (tmp_path / "report.md").read_text()


@pytest.mark.parametrize("method", ["softmax", "linear", "hybrid"])
def test_decoding_computes_the_causal_output(method, monkeypatch):
    """The steps :func:`decode_time` times compute the parallel causal op's last outputs."""
    info = subquad.get_method(method)
    n, steps = 20, 3
    q, k, v = make_qkv(1, 2, n + WARMUP_TOKENS + steps, 8, seed=1)
    outputs = []
    import subquad.compare.decode as decode

    step_state, step_keys = decode._state_step, decode._keys_step

    def record_state(*a):
        attend, nbytes = step_state(*a)
        return (lambda *t: outputs.append(attend(*t)) or outputs[-1]), nbytes

    def record_keys(*a):
        attend, nbytes = step_keys(*a)
        return (lambda *t: outputs.append(attend(*t)) or outputs[-1]), nbytes

    monkeypatch.setattr(decode, "_state_step", record_state)
    monkeypatch.setattr(decode, "_keys_step", record_keys)
    decode_time(info, {}, q, k, v, steps)
    parallel = subquad.attention(q, k, v, method=method, causal=True)
    last = torch.cat(outputs[-(WARMUP_TOKENS + steps):], dim=2)
    torch.testing.assert_close(last, parallel[:, :, n:], atol=1e-5, rtol=1e-4)
    assert decoding_form(info, {}) == ("keys" if method == "softmax" else "state")


def test_busy_neighbours_spin_for_the_block_only():
    with BusyNeighbours(2) as busy:
        assert len(busy.procs) == 2 and all(proc.poll() is None for proc in busy.procs)  # running
    assert all(proc.poll() is not None for proc in busy.procs)  # stopped and reaped
    with BusyNeighbours(0) as idle:
        assert idle.procs == []


def test_busy_run_and_the_ceiling_column(tmp_path, capsys):
    """The ceiling is exact attention's time over the method's FLOPs at the matmul roof."""
    res, _ = _results(tmp_path, capsys, "--n", "64", "--methods", "linear", "--busy", "1", "--no-backward")
    assert res["config"]["busy"] == 1 and any("busy neighbour" in note for note in res["notes"])
    roof = max(r for r in res["machine"]["matmul_flops_per_s"].values() if r)
    exact = next(r for r in res["rows"] if r["method"] == "softmax")
    linear = next(r for r in res["rows"] if r["method"] == "linear")
    assert linear["speedup_ceiling"] == pytest.approx(exact["forward_s"] / (linear["flops"] / roof))
    assert "ceiling vs exact" in (tmp_path / "report.md").read_text()


def test_rounds_take_the_median_over_interleaved_rounds(tmp_path, capsys):
    """--rounds R: every timed point R times, its time the median over them, exact attention's too."""
    res, _ = _results(tmp_path, capsys, "--n", "32", "48", "--methods", "linear", "--rounds", "3")
    assert res["config"]["rounds"] == 3
    for row in res["rows"]:
        assert set(row["rounds"]) == {"forward_s", "forward_backward_s"}, row["method"]
        for key, times in row["rounds"].items():
            assert len(times) == 3 and all(t > 0 for t in times)
            assert row[key] == sorted(times)[1]
        exact = next(r for r in res["rows"] if r["method"] == "softmax" and r["n"] == row["n"])
        assert row["speedup_forward"] == pytest.approx(exact["forward_s"] / row["forward_s"])
    assert "median over 3 rounds" in (tmp_path / "report.md").read_text()


@pytest.mark.parametrize("argv, message", [
    (["--causal", "--peers"], "random inputs"),
    (["--busy", "-1"], "--busy must be"),
    (["--objective", "decode", "--decode-steps", "0"], "--decode-steps"),
    (["--causal", "--error-inputs", "real"], "drop --error-inputs real"),
])
def test_timing_options_refuse_what_does_not_combine(argv, message, capsys):
    code, _, err = run_cli(["compare", "--n", "16", "--quiet", *argv], capsys)
    assert code == 2 and message in err


def test_base_forwards_the_command_line_without_what_it_drives():
    from subquad.compare.cli import _forwarded

    argv = ["compare", "--n", "32", "--base", "HEAD~1", "--rounds=2", "--out", "d", "--quiet", "--methods", "linear"]
    assert _forwarded(argv) == ["--n", "32", "--methods", "linear"]


def test_base_table_takes_medians_per_side():
    from subquad.compare.base import _table

    def res(*times):
        return {"rows": [{"n": 8, "method": "linear", "forward_s": t, "forward_backward_s": None} for t in times]}

    (row,) = _table([res(1.0), res(3.0), res(2.0)], [res(4.0), res(6.0)])
    assert row["head_forward_s"] == 2.0 and row["base_forward_s"] == 5.0 and row["speedup_forward_s"] == 2.5
    assert row["speedup_forward_backward_s"] is None


def test_base_refuses_an_unknown_revision(capsys):
    code, _, err = run_cli(["compare", "--n", "16", "--quiet", "--base", "no-such-revision-xyz"], capsys)
    assert code == 2 and "no-such-revision-xyz" in err


@pytest.mark.slow  # four compare processes
def test_base_runs_both_sides_alternating(tmp_path, capsys):
    code, out, err = run_cli(["compare", *TINY, "--n", "16", "--methods", "linear", "--no-backward", "--no-gate",
                              "--base", "HEAD", "--rounds", "2", "--out", str(tmp_path)], capsys)
    assert code == 0, err
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["kind"] == "compare_base" and not res["failures"]
    assert {r["method"] for r in res["rows"]} == {"softmax", "linear"}
    assert all(r["speedup_forward_s"] > 0 for r in res["rows"])
    assert sorted(p.name for p in (tmp_path / "rounds").iterdir()) == ["base_0", "base_1", "head_0", "head_1"]
    assert "base / head" in out and "base / head" in (tmp_path / "report.md").read_text()
