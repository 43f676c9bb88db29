"""The ``subquad`` command: argument handling, user errors (exit 2) and a tiny end-to-end run."""

import json

import pytest
import torch

import subquad
from conftest import run_cli
from subquad import cli, cli_base
from subquad.compare import compare
from subquad.compare.compare import Config

FAST = ["--min-run-time", "0.001", "--quiet"]




def test_help_exits_0(capsys):
    code, out, _ = run_cli(["compare", "--help"], capsys)
    assert code == 0
    assert "--max-error" in out and "--source" in out and "--peers" in out and "--error-inputs" in out


def test_version(capsys):
    code, out, _ = run_cli(["--version"], capsys)
    assert code == 0 and out.strip() == f"subquad {subquad.__version__}"


@pytest.mark.slow  # a whole command or subprocess run: .ci/run, not make test
def test_python_dash_m_subquad():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "subquad", "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "compare" in proc.stdout and "evaluate" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "subquad", "evaluate", "listops", "--checkpoint", "/nonexistent.pt"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "nonexistent.pt" in proc.stderr


def test_one_parser_for_every_command():
    from subquad.train import cli as train_cli

    names = set(cli.build_parser()._subparsers._group_actions[0].choices)
    assert names == {"compare", "methods", "data", "train", "evaluate", "retrofit"}
    standalone = set(train_cli.build_parser()._subparsers._group_actions[0].choices)
    assert standalone == {"data", "train", "evaluate"}


def test_a_command_is_required(capsys):
    code, _, err = run_cli([], capsys)
    assert code == 2 and "required" in err


def test_unknown_method(capsys):
    code, out, err = run_cli(["compare", "--methods", "nystrom", "flashy"], capsys)
    assert code == 2 and out == ""
    assert "unknown method" in err and "'flashy'" in err and "nystrom" in err


@pytest.mark.parametrize("args, words", [
    (["--n", "0"], "--n values must be positive"),
    (["--n", "128", "-5"], "--n values must be positive"),
    (["--batch", "0"], "--batch must be a positive"),
    (["--heads", "-1"], "--heads must be a positive"),
    (["--dim", "0"], "--dim must be a positive"),
    (["--n", "many"], "invalid int value"),
    (["--dtype", "int8"], "invalid choice"),
    (["--max-error", "0"], "--max-error must be positive"),
    (["--min-run-time", "-1"], "--min-run-time must be positive"),
    (["--device", "tpu"], "--device"),
])
def test_bad_arguments(capsys, args, words):
    code, out, err = run_cli(["compare", *args], capsys)
    assert code == 2 and out == ""
    assert words in err


@pytest.mark.parametrize("option, words", [
    ("nystrom.num_landmarks=0", "num_landmarks"),
    ("nystrom.landmarks=8", "unknown option"),
    ("nystrom", "METHOD.NAME=VALUE"),
    ("nystrom.=3", "METHOD.NAME=VALUE"),
    ("bogus.x=1", "unknown method 'bogus'"),
    ("performer.num_features=8", "not among --methods"),
    ("landmarks=8", "unknown option 'landmarks'"),
    ("num_landmarks=0", "num_landmarks"),
])
def test_bad_options(capsys, option, words):
    code, _, err = run_cli(["compare", "--methods", "nystrom", "--option", option], capsys)
    assert code == 2
    assert words in err


def test_unwritable_out(capsys, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code, out, err = run_cli(["compare", "--n", "16", "--out", str(blocker / "results")], capsys)
    assert code == 2 and out == ""
    assert "cannot write to --out" in err


def test_modes_that_do_not_combine(capsys, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("hello")
    code, _, err = run_cli(["compare", "--text", str(text)], capsys)
    assert code == 2 and "--source minilm" in err
    code, _, err = run_cli(["compare", "--peers", "--source", "minilm"], capsys)
    assert code == 2 and "--peers" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_without_cuda(capsys):
    code, _, err = run_cli(["compare", "--device", "cuda"], capsys)
    assert code == 2 and "CUDA is not available" in err


def test_option_values():
    parse = cli_base.parse_value
    assert parse("32") == 32 and parse("-3") == -3
    assert parse("0.5") == 0.5 and parse("1e-6") == 1e-6
    assert parse("true") is True and parse("False") is False and parse("TRUE") is True
    assert parse("None") is None and parse("null") is None and parse("none") is None
    assert parse("per_matrix") == "per_matrix" and parse("a b") == "a b" and parse("") == ""
    assert parse("(8, 8)") == (8, 8) and parse("[1, 2]") == [1, 2]
    assert parse('"x"') == "x" and parse("'32'") == "32"
    assert parse("Infinity") == float("inf")


def test_option_names():
    assert cli_base.split_option("nystrom.num_landmarks=32") == ("nystrom", "num_landmarks", 32)
    assert cli_base.split_option("conv-kernel-size=35") == (None, "conv_kernel_size", 35)
    assert cli_base.split_option("pinv_init=per_matrix") == (None, "pinv_init", "per_matrix")
    assert cli_base.split_option("eps=1e-6") == (None, "eps", 1e-6)
    for bad in ("num_landmarks", "=3", "nystrom.=3", ".x=3"):
        with pytest.raises(cli_base.OptionError, match="NAME=VALUE"):
            cli_base.split_option(bad)
    assert cli_base.single_method_options(["num_landmarks=4", "nystrom.conv_kernel_size=3"], "nystrom") == {
        "num_landmarks": 4, "conv_kernel_size": 3}
    with pytest.raises(cli_base.OptionError, match="option of method 'nystrom'"):
        cli_base.single_method_options(["nystrom.num_landmarks=4"], "lara")
    known = {"nystrom": ("num_landmarks", "pinv_iterations"), "lara": ("num_landmarks",), "softmax": ("dropout_p",)}
    got = cli_base.multi_method_options(["num_landmarks=8", "nystrom.pinv_iterations=3", "lara.num_landmarks=4"],
                                   known=known, runs=["softmax", "nystrom", "lara"], selected=["nystrom", "lara"])
    assert got == {"nystrom": {"num_landmarks": 8, "pinv_iterations": 3}, "lara": {"num_landmarks": 4}}
    # an unqualified name goes to the selected methods only, not to the softmax baseline
    with pytest.raises(cli_base.OptionError, match="unknown option 'dropout_p'"):
        cli_base.multi_method_options(["dropout_p=0.1"], known=known, runs=["softmax", "nystrom"], selected=["nystrom"])


def test_unqualified_options_reach_every_selected_method(capsys, monkeypatch):
    seen = {}

    def stop(config, show_progress, real_errors=None):
        seen["config"] = config
        raise KeyboardInterrupt

    monkeypatch.setattr(compare, "run", stop)
    with pytest.raises(KeyboardInterrupt):
        cli.main(["compare", "--methods", "nystrom", "lara", "linear", "-o", "num_landmarks=4",
                  "--option", "nystrom.pinv_iterations=3", "--n", "16", "--error-inputs", "iid", "--quiet"])
    config = seen["config"]
    assert config.methods == ["softmax", "nystrom", "lara", "linear"]
    assert config.options == {"nystrom": {"num_landmarks": 4, "pinv_iterations": 3}, "lara": {"num_landmarks": 4}}
    assert config.command.startswith("subquad compare --methods nystrom lara linear -o num_landmarks=4")


@pytest.mark.slow  # a whole command or subprocess run: .ci/run, not make test
def test_end_to_end_writes_every_report_file(capsys, tmp_path):
    out_dir = tmp_path / "report"
    argv = ["compare", "--n", "24", "40", "--batch", "1", "--heads", "2", "--dim", "8",
            "--methods", "nystrom", "--option", "nystrom.num_landmarks=4", "--max-error", "0.9",
            "--error-inputs", "iid", "--out", str(out_dir), *FAST]
    code, out, err = run_cli(argv, capsys)
    assert code == 0, err
    for name in ("results.json", "report.md", "time_vs_n.png", "memory_vs_n.png", "error_vs_time.png"):
        assert (out_dir / name).stat().st_size > 0, name
    res = json.loads((out_dir / "results.json").read_text())
    rows = {(r["method"], r["n"]): r for r in res["rows"]}
    assert set(rows) == {(m, n) for m in ("softmax", "nystrom") for n in (24, 40)}
    for r in rows.values():
        assert r["status"] == "ok", r
        assert r["forward_s"] > 0 and r["forward_backward_s"] > 0
        assert r["forward_bytes"] is not None and r["forward_backward_bytes"] is not None
        assert r["flops"] > 0 and r["flops_source"] == "formula"
    assert rows[("softmax", 40)]["rel_error"] < 1e-5
    assert rows[("softmax", 40)]["speedup_forward"] == 1.0
    assert 0 < rows[("nystrom", 40)]["rel_error"] < 10
    assert res["config"]["options"] == {"nystrom": {"num_landmarks": 4}}
    assert [r["n"] for r in res["recommendations"]] == [24, 40]
    report = (out_dir / "report.md").read_text()
    assert "## N = 40" in report and "![error_vs_time](error_vs_time.png)" in report
    assert "num_landmarks=4" in report
    # the console leaderboard: one table per N and the recommendation
    assert "N = 24" in out and "N = 40" in out and "relative error <= 0.9" in out


def _tiny(**kw):
    base = dict(ns=[16], batch=1, heads=2, dim=8, methods=["softmax", "linear", "efficient"],
                min_run_time=0.001, memory=False)
    return Config(**{**base, **kw})


def test_sweep_rows_are_timed_and_measured_like_methods():
    """--sweep on the timing run: a row per value, with its own time and error (hybrid with fewer
    blocks than the sequence needs is approximate, with every block it is exact); a value the
    method refuses fails its row alone."""
    config = _tiny(ns=[64], methods=["softmax", "hybrid"], options={"hybrid": {"query_block": 8, "key_block": 8}},
                   sweeps=[["hybrid", "num_blocks", [1, 8, -1]]])
    res = compare.run(config, show_progress=False)
    rows = {r["method"]: r for r in res["rows"]}
    assert set(rows) == {"softmax", "hybrid", "hybrid num_blocks=1", "hybrid num_blocks=8", "hybrid num_blocks=-1"}
    assert rows["hybrid num_blocks=1"]["options"] == {"query_block": 8, "key_block": 8, "num_blocks": 1}
    assert rows["hybrid num_blocks=1"]["forward_s"] > 0 and rows["hybrid num_blocks=1"]["rel_error"] > 1e-3
    assert rows["hybrid num_blocks=8"]["rel_error"] < 1e-5
    bad = rows["hybrid num_blocks=-1"]
    assert bad["status"] == "failed" and "num_blocks" in bad["errors"]["options"]


def test_a_failing_method_is_reported_and_the_run_goes_on(monkeypatch):
    real = compare.forward_call

    def flaky(info, *args, **kwargs):
        if info.name == "linear":
            def boom():
                raise RuntimeError("linear broke")
            return boom
        return real(info, *args, **kwargs)

    monkeypatch.setattr(compare, "forward_call", flaky)
    res = compare.run(_tiny(), show_progress=False)
    rows = {r["method"]: r for r in res["rows"]}
    assert rows["linear"]["status"] == "failed"
    assert "linear broke" in rows["linear"]["errors"]["forward"]
    assert rows["efficient"]["status"] == "ok" and rows["softmax"]["status"] == "ok"
    from subquad.compare.report import leaderboard_text, markdown

    assert "linear broke" in leaderboard_text(res)
    assert "FAILED" in markdown(res, [])


def test_a_failing_backward_is_partial(monkeypatch):
    real = compare.forward_backward_call

    def no_grad_for_efficient(info, *args, **kwargs):
        if info.name == "efficient":
            def boom():
                raise RuntimeError("no backward here")
            return boom
        return real(info, *args, **kwargs)

    monkeypatch.setattr(compare, "forward_backward_call", no_grad_for_efficient)
    res = compare.run(_tiny(), show_progress=False)
    row = next(r for r in res["rows"] if r["method"] == "efficient")
    assert row["status"] == "partial" and row["forward_s"] is not None and row["forward_backward_s"] is None
    assert "no backward here" in row["errors"]["forward_backward"]


def test_slow_points_are_skipped_from_the_shorter_length():
    # a 1e-9 s budget: every point after the first length is predicted over it
    config = _tiny(ns=[8, 16], methods=["softmax", "linear"], max_call_seconds=1e-9)
    res = compare.run(config, show_progress=False)
    at16 = [r for r in res["rows"] if r["n"] == 16]
    assert all(r["status"] == "skipped" and "--max-call-seconds" in r["notes"][0] for r in at16)
    at8 = [r for r in res["rows"] if r["n"] == 8]
    assert all(r["forward_s"] is not None and r["forward_backward_s"] is None for r in at8)


def test_the_first_length_is_guarded_by_a_probe(monkeypatch):
    """A first point longer than PROBE_N is predicted from one probe call there, so
    --max-call-seconds applies to it too; the probe is not a result row."""
    monkeypatch.setattr(compare, "PROBE_N", 8)
    res = compare.run(_tiny(ns=[32], methods=["softmax", "linear"], max_call_seconds=1e-9), show_progress=False)
    assert [r["n"] for r in res["rows"]] == [32, 32]
    assert all(r["status"] == "skipped" and "growth from N=8" in r["notes"][0] for r in res["rows"])


def test_points_predicted_over_the_available_memory_are_skipped(monkeypatch):
    monkeypatch.setattr(compare, "measure_in_subprocess", lambda spec, timeout: {"forward_bytes": 10**6})
    monkeypatch.setattr(compare, "available_memory", lambda device: 10**6)
    res = compare.run(_tiny(ns=[8, 16], methods=["softmax", "linear"], memory=True), show_progress=False)
    at8, at16 = ([r for r in res["rows"] if r["n"] == n] for n in (8, 16))
    assert all(r["status"] == "ok" and r["forward_bytes"] == 10**6 for r in at8)
    assert all(r["status"] == "skipped" and "GiB available" in r["notes"][0] for r in at16)


def test_token_mixers_are_timed_without_an_error():
    mixers = [m.name for m in subquad.list_methods() if m.kind == "mixer"]
    if not mixers:
        pytest.skip("no token mixer registered")
    res = compare.run(_tiny(methods=["softmax", mixers[0]]), show_progress=False)
    row = next(r for r in res["rows"] if r["method"] == mixers[0])
    assert row["kind"] == "mixer" and row["forward_s"] > 0 and row["rel_error"] is None
    assert row["flops_source"] == "counted"


@pytest.mark.parametrize("command", [["compare"], ["retrofit"]])
def test_help_states_only_defaults_that_say_something(command, capsys):
    code, out, _ = run_cli([*command, "--help"], capsys)
    assert code == 0
    assert "(default: None)" not in out and "(default: False)" not in out and "(default: [])" not in out
    assert out.count("(default: ") >= 3


def test_methods_lists_every_registered_method(capsys):
    code, out, _ = run_cli(["methods"], capsys)
    assert code == 0
    lines = out.splitlines()
    for m in subquad.list_methods():
        row = next(line.split() for line in lines if line.split()[:1] == [m.name])
        assert row[1:3] == [m.kind, m.complexity]
        assert row[3] == ("yes" if m.causal else "-")
        assert row[6] == ("yes" if m.context_parallel is not None else "-")


def test_methods_name_prints_its_options(capsys):
    code, out, _ = run_cli(["methods", "nystrom"], capsys)
    assert code == 0
    for name, default in subquad.get_method("nystrom").option_defaults().items():
        assert f"  {name} = {default!r}" in out
    code, _, err = run_cli(["methods", "nystrm"], capsys)
    assert code == 2 and "unknown method 'nystrm'" in err


def test_a_slow_dtype_is_announced_before_the_points(capsys, monkeypatch):
    """float16 without a fast path here: the note comes up front on stderr and in the results,
    a roof that would not fit --max-call-seconds is left out, and achieved rates are quoted against
    float32's roof, the faster (the ops compute half-precision inputs in float32)."""
    from subquad.compare import flops
    from subquad.compare.flops import Roof

    def roof(device, dtype, *, max_seconds, size=None, min_run_time=1.0):
        if dtype == torch.float32:
            return Roof(1e11, 2048, {256: 0.001, 512: 0.008}, 0.1)
        return Roof(None, 256, {256: 0.05}, 0.1)

    monkeypatch.setattr(flops, "bounded_matmul_rate", roof)
    order = []
    real_point = compare._measure_point
    monkeypatch.setattr(compare, "_measure_point", lambda *a, **k: (order.append(capsys.readouterr().err),
                                                                     real_point(*a, **k))[1])
    res = compare.run(_tiny(dtype="float16", methods=["softmax", "linear"]), show_progress=False)
    assert "float16 has no fast path on this cpu" in order[0] and "50x" in order[0]
    assert any("no fast path" in note for note in res["notes"])
    assert any("no float16 matmul roof" in note for note in res["notes"])
    assert res["machine"]["matmul_flops_per_s"] == {"float32": 1e11, "run_dtype": None}
    assert all(r["matmul_fraction"] == pytest.approx(r["gflops"] * 1e9 / 1e11) for r in res["rows"])
    from subquad.compare.report import markdown

    assert "not measured in float16" in markdown(res, [])


@pytest.mark.slow  # a whole command in a subprocess
def test_compare_in_float16_shows_progress_at_once_and_finishes():
    """On a CPU without fast float16, the roof's products are bounded by --max-call-seconds (a
    2048 x 2048 float16 product alone takes 20-50 s here): the command shows its progress bar
    within seconds of starting and finishes."""
    import subprocess
    import sys
    import time

    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "subquad", "compare", "--dtype", "float16", "--n", "256",
                             "--methods", "linear", "--error-inputs", "iid", "--no-memory"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = proc.stderr.read(1)
    first_output = time.perf_counter() - start
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, first + err
    assert first_output < 30, f"nothing on stderr for {first_output:.0f} s"  # torch's import included
    assert "subquad compare" in first + err and "linear" in out
    assert time.perf_counter() - start < 300


def test_methods_name_says_what_none_means(capsys):
    """An option whose default is None points to the options' docstring, printed as plain text:
    hedgehog's says a None feature width is the head dim."""
    code, out, _ = run_cli(["methods", "hedgehog"], capsys)
    assert code == 0
    assert "  feature_dim = None  (what None means: below)" in out
    text = " ".join(out.split("what the options mean (HedgehogOptions):")[1].split())
    assert "(None: the head dim;" in text and "``" not in text
    code, out, _ = run_cli(["methods", "efficient"], capsys)  # no options: no docstring section
    assert code == 0 and "what the options mean" not in out


def test_train_help_shows_the_presets_values(capsys):
    """``train TASK --help``: the values of the task's preset, no --data for a task generated in
    memory (ListOps reads files: it keeps it), no reST markup."""
    code, out, _ = run_cli(["train", "mqar", "--help"], capsys)
    assert code == 0
    text = " ".join(out.split())
    assert "--layers LAYERS default: 2, preset mqar" in text and "--betas B1 B2 default: 0.9 0.98, preset mqar" in text
    assert "(default: 3, preset mqar)" in text and "(default: 250, preset mqar)" in text  # conv kernel, eval every
    assert "--data" not in out and "``" not in out and ":func:" not in out
    code, out, _ = run_cli(["evaluate", "mqar", "--help"], capsys)
    assert code == 0 and "--data" not in out
    code, out, _ = run_cli(["train", "listops", "--help"], capsys)
    assert code == 0 and "--data DATA" in out and "default: 2, preset nystromformer" in " ".join(out.split())
