"""CONTRIBUTING.md's example method runs as written and is swept like a built-in one.

The doc's python blocks (each opens with a comment naming its file) are executed as the modules
they would be, under a scratch name (:data:`NAME`, for the method and the package), so the method
registers itself. Then: the op through ``subquad.attention`` against the doc's naive reference,
the doc's own test file, ``subquad.MultiheadAttention`` forward and backward, ``subquad compare``
finding it and reporting its error, and the generic sweeps (``tests/test_generic.py`` and the
others in :data:`SWEEPS`) restricted to it in a subprocess (``SUBQUAD_EXTRA_METHODS``, see
``tests/conftest.py``, imports a module there that calls :func:`load_method`). The registry and
``sys.modules`` are restored afterwards.

This module must not import ``conftest`` at import time: the subprocess imports it from there.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import subquad
from subquad import registry

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "CONTRIBUTING.md"
NAME = "doc_window"  # the scratch name the example method and its package get here
PACKAGE = f"subquad.ops.{NAME}"
OP_FILE = "src/subquad/ops/window/__init__.py"
NAIVE_FILE = "src/subquad/ops/window/naive.py"
TEST_FILE = "tests/ops/test_window.py"


def doc_blocks() -> dict[str, str]:
    """The doc's python blocks, by the file named on their first line."""
    blocks = re.findall(r"```python\n# (\S+)\n(.*?)```", DOC.read_text(), flags=re.S)
    return dict(blocks)


def _renamed(code: str, name: str) -> str:
    """The doc's code with the method's name (``"window"`` as the first argument of a call:
    ``register_method``, the checks) and its package replaced by the scratch ones."""
    code = re.sub(r'(\w\()"window"', lambda m: m.group(1) + repr(name), code)
    return code.replace("subquad.ops.window", f"subquad.ops.{name}")


def _exec_module(modname: str, path: str, *, package: str, is_package: bool = False) -> types.ModuleType:
    """Execute the doc's block for ``path`` as module ``modname`` (relative imports resolve from
    ``package``, as they would in the file) and leave it in ``sys.modules``."""
    module = types.ModuleType(modname)
    module.__package__ = package
    if is_package:
        module.__path__ = []
    sys.modules[modname] = module
    exec(compile(_renamed(doc_blocks()[path], NAME), f"CONTRIBUTING.md ({path})", "exec"), module.__dict__)
    return module


def load_method() -> tuple[types.ModuleType, types.ModuleType]:
    """Register the doc's method as :data:`NAME`: its op module and its naive module."""
    op = _exec_module(PACKAGE, OP_FILE, package=PACKAGE, is_package=True)
    naive = _exec_module(f"{PACKAGE}.naive", NAIVE_FILE, package=PACKAGE)
    return op, naive


def unload_method() -> None:
    if NAME in {m.name for m in subquad.list_methods()}:
        registry.unregister(NAME)
    sys.modules.pop(f"{PACKAGE}.naive", None)
    sys.modules.pop(PACKAGE, None)


@pytest.fixture(scope="module")
def toy():
    """The doc's method, registered as :data:`NAME` for this module's tests only."""
    assert NAME not in {m.name for m in subquad.list_methods()}
    try:
        op, naive = load_method()
        yield types.SimpleNamespace(op=op, naive=naive)
    finally:
        unload_method()
    assert NAME not in {m.name for m in subquad.list_methods()}


def _mask(n: int) -> torch.Tensor:
    mask = torch.zeros(2, n, dtype=torch.bool)
    mask[0, -3:] = True
    mask[1, 2:5] = True
    return mask


def test_doc_has_the_three_files():
    assert {OP_FILE, NAIVE_FILE, TEST_FILE} <= set(doc_blocks())


def test_registered_with_its_entry(toy):
    info = subquad.get_method(NAME)
    assert info.op is toy.op.window_attention
    assert (info.causal, info.cross_attention, info.key_padding, info.complexity) == (True, False, True, "linear")
    assert info.option_defaults() == {"window": 16}
    assert info.flops(1, 2, 10, 10, 8, 4, {"window": 3}) == 2 * 2 * 10 * 7 * 12
    with pytest.raises(ValueError, match=f"{NAME}: window must be >= 1"):
        subquad.attention(*torch.randn(3, 1, 1, 4, 8).unbind(), method=NAME, window=0)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("window", [1, 4, 30])
def test_attention_matches_naive(toy, window, causal):
    """(a) ``subquad.attention(..., method=NAME)`` equals the doc's naive reference, with padding;
    values and gradients."""
    g = torch.Generator().manual_seed(window)
    q, k, v = (torch.randn(2, 3, 11, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = _mask(11)
    out = subquad.attention(q, k, v, method=NAME, key_padding_mask=mask, causal=causal, window=window, scale=0.4)
    ref = toy.naive.window_attention_reference(q, k, v, mask, causal, 0.4, window=window)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    cot = torch.randn(out.shape, generator=g, dtype=out.dtype)
    grads = torch.autograd.grad((out * cot).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * cot).sum(), (q, k, v))
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_doc_test_file_runs(toy):
    """The doc's tests/ops/test_window.py, executed against the scratch method."""
    namespace = {"__name__": "doc_test_window"}
    exec(compile(_renamed(doc_blocks()[TEST_FILE], NAME), f"CONTRIBUTING.md ({TEST_FILE})", "exec"), namespace)
    tests = [fn for name, fn in namespace.items() if name.startswith("test_") and callable(fn)]
    assert len(tests) >= 2
    for fn in tests:
        fn()


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_multihead_attention(toy, is_causal):
    """(b) ``subquad.MultiheadAttention(method=NAME)``: the op on the module's projections,
    forward and backward."""
    torch.manual_seed(0)
    mha = subquad.MultiheadAttention(16, 2, method=NAME, window=2, batch_first=True, dtype=torch.float64)
    x = torch.randn(2, 9, 16, dtype=torch.float64, requires_grad=True)
    pad = _mask(9)
    out, weights = mha(x, x, x, key_padding_mask=pad, is_causal=is_causal)
    assert weights is None and out.shape == x.shape
    q, k, v = (t.unflatten(-1, (2, 8)).transpose(1, 2) for t in torch.nn.functional.linear(
        x, mha.in_proj_weight, mha.in_proj_bias).chunk(3, dim=-1))
    ref = toy.naive.window_attention_reference(q, k, v, pad, is_causal, window=2)
    torch.testing.assert_close(out, mha.out_proj(ref.transpose(1, 2).flatten(2)), rtol=1e-12, atol=1e-12)
    out[~pad].square().sum().backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in mha.parameters())


def test_compare_reports_it(toy, tmp_path, capsys, fake_minilm):
    """(c) ``subquad compare --methods NAME`` (the CLI's Python entry) runs it beside exact
    attention and reports its time, error and FLOPs from the entry's formula."""
    from subquad import cli

    out_dir = tmp_path / "compare"
    code = cli.main(["compare", "--methods", NAME, "-o", "window=4", "--n", "32", "--heads", "2", "--dim", "8",
                     "--min-run-time", "0.001", "--no-memory", "--quiet", "--out", str(out_dir)])
    assert code == 0
    rows = {r["method"]: r for r in json.loads((out_dir / "results.json").read_text())["rows"]}
    assert set(rows) == {"softmax", NAME}
    row = rows[NAME]
    assert row["status"] == "ok", row["errors"]
    assert row["options"] == {"window": 4}
    assert row["forward_s"] > 0 and row["forward_backward_s"] > 0
    assert 0 < row["rel_error"] < float("inf")  # approximate: a real error against exact attention
    assert (row["flops"], row["flops_source"]) == (2 * 1 * 2 * 32 * 9 * 16, "formula")
    assert f"\n{NAME} " in capsys.readouterr().out


# the sweeps over every registered method, and how many tests each must pass for the doc's method
SWEEPS = {"tests/test_generic.py": 50, "tests/test_errors.py": 25, "tests/test_registry.py": 4,
          "tests/layers/test_mha_parity.py": 60, "tests/test_compile.py": 6}


@pytest.mark.slow  # a whole command or subprocess run: .ci/run, not make test
def test_generic_sweep_runs_it(tmp_path):
    """(d) The generic sweeps (:data:`SWEEPS`) restricted to NAME with ``-k``, in a subprocess where
    ``SUBQUAD_EXTRA_METHODS`` registers it (slow ones too, but the long-sequence test): every test
    passes, and each file really ran on it."""
    (tmp_path / "doc_window_method.py").write_text("import test_contributing\n\ntest_contributing.load_method()\n")
    path = [str(tmp_path), str(ROOT / "tests"), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = dict(os.environ, SUBQUAD_EXTRA_METHODS="doc_window_method", PYTHONPATH=os.pathsep.join(path))
    cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", *SWEEPS, "-k",
           f"{NAME} and not test_long_sequence_linear_memory"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    tail = proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    for file, at_least in SWEEPS.items():
        passed = re.findall(rf"^{re.escape(file)}::\S*{NAME}\S* PASSED", proc.stdout, flags=re.M)
        assert len(passed) >= at_least, f"{file}: {len(passed)} tests passed for {NAME}\n{tail}"
    assert not re.search(r"\d+ (failed|errors?)\b", proc.stdout), tail


TASK_FILE = "src/subquad/tasks/first_token.py"


def test_doc_task_trains(tmp_path):
    """The doc's example task registers, and the trainer, model files and ``evaluate`` take it."""
    from subquad.tasks import base, get_task
    from subquad.train import TrainConfig, load_model, train
    from subquad.train.trainer import evaluate_model

    name = "doc_first_token"
    code = doc_blocks()[TASK_FILE].replace('"first_token"', repr(name))
    module = types.ModuleType(f"subquad.tasks.{name}")
    module.__package__ = "subquad.tasks"
    sys.modules[module.__name__] = module
    try:
        exec(compile(code, f"CONTRIBUTING.md ({TASK_FILE})", "exec"), module.__dict__)
        assert get_task(name).__name__ == "FirstToken"
        cfg = TrainConfig(task=name, task_options={"seq_len": 24, "size": 64}, method="linear", layers=1, dim=16,
                          heads=2, ffn_dim=32, head_hidden=0, batch_size=8, steps=4, warmup_steps=1, pad_to=32,
                          eval_every=2, out_dir=str(tmp_path / "run"), progress=False, tensorboard=False, threads=1)
        results = train(cfg)
        assert results["task"] == name and results["test_samples"] == results["test_labels"] == 64
        model, saved_cfg, _ = load_model(tmp_path / "run" / "model.pt")
        data = get_task(name)(**saved_cfg.task_options).load("", None)
        _, accuracy, n = evaluate_model(model, saved_cfg, data.test)
        assert n == 64 and accuracy == pytest.approx(results["test_accuracy"])
    finally:
        base._TASKS.pop(name, None)
        sys.modules.pop(module.__name__, None)
