"""MQAR (Zoology's multi-query associative recall): the samples' structure, determinism, batching and
option errors; the encoder's per-position head; a tiny training run through the task interface
(``subquad train mqar`` / ``subquad evaluate mqar``)."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from subquad.models import Encoder
from subquad.tasks import IGNORE, MQAR, get_task, list_tasks, make_task
from subquad.tasks.mqar import make_sample
from subquad.train import TrainConfig, load_model, train
from subquad.train.cli import main as cli_main


def test_registered_tasks():
    assert {"listops", "mqar"} <= set(list_tasks())
    assert get_task("mqar") is MQAR and MQAR.per_token and not get_task("listops").per_token
    with pytest.raises(ValueError, match="unknown task 'nope'.*listops"):
        get_task("nope")
    with pytest.raises(ValueError, match="no option.*pairs.*num_pairs"):
        make_task("mqar", {"pairs": 3})


@pytest.mark.parametrize("seq_len,num_pairs", [(16, 4), (64, 8), (256, 64), (101, 3)])
def test_sample_structure(seq_len, num_pairs):
    task = MQAR(seq_len=seq_len, num_pairs=num_pairs, vocab_size=300)
    half = task.vocab_size // 2
    for index in range(20):
        tokens, labels = make_sample(task, "train", index)
        assert tokens.shape == labels.shape == (seq_len,)
        keys, values = tokens[0:2 * num_pairs:2], tokens[1:2 * num_pairs:2]
        assert len(set(keys.tolist())) == num_pairs and keys.min() >= 2 and keys.max() < half
        assert len(set(values.tolist())) == num_pairs and values.min() >= half and values.max() < task.vocab_size
        assert tokens.min() >= 1 and tokens.max() < task.vocab_size  # 0 is only padding
        queries = np.flatnonzero(labels != IGNORE)
        assert len(queries) == num_pairs
        assert queries.min() >= 2 * num_pairs and np.all((queries - 2 * num_pairs) % 2 == 0)
        answer = dict(zip(keys.tolist(), values.tolist()))
        for q in queries:  # every key is asked once, and its label is its value
            assert labels[q] == answer[int(tokens[q])]
        assert sorted(tokens[queries].tolist()) == sorted(keys.tolist())
        others = np.ones(seq_len, dtype=bool)
        others[:2 * num_pairs] = False
        others[queries] = False
        assert (tokens[others] == 1).all()  # the filler
    tokens, _ = make_sample(MQAR(seq_len=seq_len, num_pairs=num_pairs, vocab_size=300, random_fillers=True),
                            "train", 0)
    assert len(set(tokens[2 * num_pairs:].tolist())) > num_pairs + 1  # fillers drawn from the vocabulary

def test_samples_are_deterministic_and_splits_differ():
    task = MQAR(seq_len=64, num_pairs=8)
    a = make_sample(task, "train", 5)
    assert all(np.array_equal(x, y) for x, y in zip(a, make_sample(task, "train", 5)))
    assert not np.array_equal(a[0], make_sample(task, "train", 6)[0])
    assert not np.array_equal(a[0], make_sample(task, "test", 5)[0])
    assert not np.array_equal(a[0], make_sample(MQAR(seq_len=64, num_pairs=8, data_seed=1), "train", 5)[0])


def test_queries_follow_the_power_law():
    """a = 0.01: the chance of slot s falls like 1 / s, so the first quarter of the query region
    holds far more queries than the last (uniform slots would give each quarter a quarter)."""
    task = MQAR(seq_len=512, num_pairs=8)
    slots = np.concatenate([(np.flatnonzero(make_sample(task, "val", i)[1] != IGNORE) - 16) // 2
                            for i in range(200)])
    n_slots = (512 - 16) // 2
    first, last = (slots < n_slots // 4).mean(), (slots >= 3 * n_slots // 4).mean()
    assert first > 0.45 and last < 0.15


def test_batch_pads_and_refuses_to_cut():
    data = MQAR(seq_len=40, num_pairs=4).load("", None)
    tokens, pad, labels = data.train.batch([3, 1], 128, 32)
    assert tokens.shape == pad.shape == labels.shape == (2, 64)
    assert not pad[:, :40].any() and pad[:, 40:].all() and (tokens[:, 40:] == 0).all()
    assert (labels[:, 40:] == IGNORE).all()
    assert torch.equal(tokens[1, :40], data.train[1][0])
    assert data.train.batch([0], 128, None)[0].shape == (1, 128)
    with pytest.raises(ValueError, match="40 tokens; pad_to=32"):
        data.train.batch([0], 32, 32)
    with pytest.raises(IndexError):
        data.val[len(data.val)]


@pytest.mark.parametrize("options,match", [
    (dict(seq_len=60, num_pairs=16), "seq_len must be >= 64"),
    (dict(num_pairs=0), "num_pairs must be >= 1"),
    (dict(vocab_size=20, num_pairs=16), "vocab_size must be >= 36"),
    (dict(power_a=0.0), "power_a must be > 0"),
])
def test_option_errors(options, match):
    with pytest.raises(ValueError, match=match):
        MQAR(**options)


def test_encoder_select_equals_the_full_head():
    torch.manual_seed(0)
    model = Encoder(50, 50, method="linear", dim=16, heads=2, ffn_dim=32, max_len=32, pooling="none",
                    dropout=0.0).eval()
    tokens = torch.randint(1, 50, (3, 32))
    pad = torch.zeros(3, 32, dtype=torch.bool)
    pad[1, 20:] = True
    select = torch.rand(3, 32) < 0.3
    full = model(tokens, pad)
    assert full.shape == (3, 32, 50)
    torch.testing.assert_close(model(tokens, pad, select), full[select])
    with pytest.raises(ValueError, match="select needs pooling='none'"):
        Encoder(50, 5, dim=16, heads=2, max_len=32)(tokens, pad, select)


TINY = dict(layers=1, dim=16, heads=2, ffn_dim=32, batch_size=8, lr=3e-3, warmup_steps=2, steps=6, pad_to=64,
            eval_every=3, checkpoint_every=3, log_every=2, progress=False, tensorboard=False, threads=1)
TASK = dict(seq_len=48, num_pairs=4, vocab_size=40, train_size=64, eval_size=24)


def test_tiny_training_run_and_evaluate(tmp_path, capsys):
    cfg = TrainConfig.from_preset("mqar", method="performer", task_options=TASK, out_dir=str(tmp_path / "run"),
                                  **TINY)
    results = train(cfg)
    assert results["task"] == "mqar" and results["task_options"] == TASK
    assert results["test_samples"] == 24 and results["test_labels"] == 24 * 4  # accuracy is over queries
    assert results["chance_accuracy"] == pytest.approx(2 / 40) and np.isfinite(results["test_loss"])
    with open(tmp_path / "run" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["split"] == "train"]
    assert [int(r["samples"]) for r in rows] == [16, 16, 16]  # sequences (2 steps of 8), not labels
    model, saved_cfg, saved = load_model(tmp_path / "run" / "model.pt")
    assert saved["kind"] == "subquad.mqar.encoder" and saved_cfg.task_options == TASK
    assert cli_main(["evaluate", "mqar", "--checkpoint", str(tmp_path / "run" / "model.pt"), "--no-progress"]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["n"] == 96 and line["accuracy"] == pytest.approx(results["test_accuracy"])
    assert cli_main(["evaluate", "listops", "--checkpoint", str(tmp_path / "run" / "model.pt")]) == 2
    assert "model of task 'mqar'; use `evaluate mqar`" in capsys.readouterr().err


def test_resume_needs_the_same_task_options(tmp_path):
    cfg = TrainConfig.from_preset("mqar", method="linear", task_options=TASK, out_dir=str(tmp_path / "run"),
                                  max_minutes=1e-9, **TINY)
    assert train(cfg)["stopped"]
    other = TrainConfig.from_preset("mqar", method="linear", task_options={**TASK, "num_pairs": 5},
                                    out_dir=str(tmp_path / "run"), resume=True, **TINY)
    with pytest.raises(ValueError, match="task_options"):
        train(other)


def test_config_checks_pooling_and_length():
    with pytest.raises(ValueError, match="labels per position: pooling must be 'none'"):
        TrainConfig(task="mqar", method="linear", pooling="mean").validate()
    with pytest.raises(ValueError, match="labels per sequence: pooling must be 'mean' or 'cls'"):
        TrainConfig(task="listops", method="linear", pooling="none").validate()
    with pytest.raises(ValueError, match="samples of 256 tokens, longer than pad_to=128"):
        TrainConfig.from_preset("mqar", method="linear", pad_to=128).validate()


def test_cli_train_mqar(tmp_path, capsys):
    out = tmp_path / "cli"
    code = cli_main(["train", "mqar", "--method", "softmax", "--out", str(out), "-t", "seq_len=48", "-t",
                     "num_pairs=4", "-t", "vocab_size=40", "-t", "train_size=64", "-t", "eval_size=16",
                     "--steps", "2", "--batch-size", "8", "--layers", "1", "--dim", "16", "--threads", "1",
                     "--no-progress", "--no-tensorboard"])
    assert code == 0, capsys.readouterr().err
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["preset"] == "mqar" and results["task_options"]["num_pairs"] == 4
    assert cli_main(["train", "mqar", "--method", "softmax", "--out", str(tmp_path / "x"), "-t", "pairs=3"]) == 2
    assert "no option" in capsys.readouterr().err


def test_training_samples_draw_their_pairs_from_the_mixture():
    task = MQAR(seq_len=128, num_pairs=8, train_pairs=[2, 4, 16])
    assert task.train_pairs == (2, 4, 16)  # a JSON list becomes a tuple
    counts = {int((make_sample(task, "train", i)[1] != IGNORE).sum()) for i in range(60)}
    assert counts == {2, 4, 16}
    assert {int((make_sample(task, "test", i)[1] != IGNORE).sum()) for i in range(10)} == {8}
    with pytest.raises(ValueError, match="seq_len must be >= 128"):
        MQAR(seq_len=64, num_pairs=8, train_pairs=(32,))


def test_short_conv_is_causal_and_ignores_padding():
    from subquad.models.encoder import ShortConv

    torch.manual_seed(0)
    conv = ShortConv(6, 3).double()
    x = torch.randn(2, 10, 6, dtype=torch.float64)
    y = conv(x)
    changed = x.clone()
    changed[:, 7:] += 1.0  # later tokens leave earlier outputs as they are
    torch.testing.assert_close(conv(changed)[:, :7], y[:, :7], rtol=0, atol=0)
    assert not torch.allclose(conv(changed)[:, 7:], y[:, 7:])
    pad = torch.zeros(2, 10, dtype=torch.bool)
    pad[:, 3] = True
    moved = x.clone()
    moved[:, 3] = 100.0  # content at a padded position reaches no output
    torch.testing.assert_close(conv(moved, pad), conv(x, pad), rtol=0, atol=0)
    manual = sum(conv.conv.weight[:, 0, 2 - j] * F.pad(x, (0, 0, j, 0))[:, :10] for j in range(3)) + conv.conv.bias
    torch.testing.assert_close(y, manual)


def test_conv_kernel_size_adds_the_conv_and_old_models_load():
    plain = Encoder(20, 5, dim=16, heads=2, max_len=32)
    conv = Encoder(20, 5, dim=16, heads=2, max_len=32, conv_kernel_size=3)
    extra = set(conv.state_dict()) - set(plain.state_dict())
    assert extra and all(".conv." in k or ".norm0." in k for k in extra)
    with pytest.raises(ValueError, match="conv_kernel_size must be a non-negative int"):
        Encoder(20, 5, dim=16, heads=2, conv_kernel_size=-1)


def test_training_lengths_take_turns_and_batches_pad_each_row():
    task = MQAR(seq_len=128, num_pairs=16, train_pairs=(2, 16), train_lengths=(16, 128))
    data = task.load("", None)
    assert data.train.lengths()[:4].tolist() == [16, 128, 16, 128] and task.max_length == 128
    assert (data.test.lengths() == 128).all()
    for i in range(8):
        tokens, labels = make_sample(task, "train", i)
        assert len(tokens) == (16 if i % 2 == 0 else 128)
        assert 4 * int((labels != IGNORE).sum()) <= len(tokens)  # only the pair counts that fit
    tokens, pad, labels = data.train.batch([0, 1], 256, 64)
    assert tokens.shape == (2, 128) and pad[0, 16:].all() and not pad[0, :16].any() and not pad[1].any()
    assert (labels[0, 16:] == IGNORE).all()
    with pytest.raises(ValueError, match="train_lengths must be >= 8"):
        MQAR(seq_len=64, num_pairs=4, train_pairs=(2,), train_lengths=(4,))
