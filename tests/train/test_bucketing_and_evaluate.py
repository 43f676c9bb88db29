"""Length-bucketed batches (every sample once per epoch, within the cap, deterministic per seed,
sharded like the global batch), ``subquad evaluate listops`` (agrees with the trainer's own test
numbers, clear errors), and resuming a run copied to another place, as a committed run is."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from subquad.tasks import listops
from subquad.train import checkpoint as ckpt
from subquad.train.cli import main as cli_main
from subquad.train.sampler import BucketBatchSampler
from subquad.train.config import TrainConfig, pad_multiple
from subquad.train.trainer import eval_batches, train

TINY = dict(layers=1, dim=16, heads=2, ffn_dim=32, head_hidden=16, batch_size=8, lr=1e-3, warmup_steps=2,
            pad_to=48, eval_every=3, checkpoint_every=3, log_every=2, progress=False, tensorboard=False)


def _lengths(n=203, seed=0):
    return np.random.default_rng(seed).integers(1, 2000, size=n)


@pytest.mark.parametrize("pool", [1, 3, 64])
def test_bucket_epoch_holds_every_sample_once(pool):
    lengths = _lengths()
    sampler = BucketBatchSampler(lengths, 8, seed=5, pool_batches=pool)
    assert sampler.batches_per_epoch == 25  # 203 // 8: the tail that fills no batch is dropped
    for epoch in range(3):
        batches = [next(sampler) for _ in range(sampler.batches_per_epoch)]
        assert sampler.epoch == epoch
        flat = np.concatenate(batches)
        assert len(flat) == 200 and len(np.unique(flat)) == 200 and flat.min() >= 0 and flat.max() < 203
        assert all(len(b) == 8 for b in batches)


def test_buckets_group_similar_lengths():
    lengths = _lengths(4096)
    sampler = BucketBatchSampler(lengths, 32, seed=0, pool_batches=64)
    batches = [next(sampler) for _ in range(sampler.batches_per_epoch)]
    padded = sum(len(b) * lengths[b].max() for b in batches)
    real = sum(lengths[b].sum() for b in batches)
    assert 1 - real / padded < 0.05  # uniform batches of these lengths are ~48% padding


def test_bucket_batches_are_deterministic_and_resumable():
    lengths = _lengths()
    a, b, c = (BucketBatchSampler(lengths, 8, seed=s) for s in (1, 1, 2))
    first = [next(a) for _ in range(40)]
    assert first == [next(b) for _ in range(40)]
    assert first != [next(c) for _ in range(40)]
    state = a.state_dict()
    expected = [next(a) for _ in range(30)]  # crosses an epoch boundary
    again = BucketBatchSampler(lengths, 8, seed=1)
    again.load_state_dict(state)
    assert [next(again) for _ in range(30)] == expected


def test_bucket_shards_make_the_global_batch():
    lengths = _lengths()
    one = BucketBatchSampler(lengths, 8, seed=3)
    ranks = [BucketBatchSampler(lengths, 4, world_size=2, rank=r, seed=3) for r in range(2)]
    for _ in range(60):
        assert sorted(next(one)) == sorted(next(ranks[0]) + next(ranks[1]))


def test_bucket_sampler_bad_arguments():
    with pytest.raises(ValueError, match="fewer than one global batch"):
        BucketBatchSampler([5, 6, 7], 2, world_size=2)
    with pytest.raises(ValueError, match="pool_batches"):
        BucketBatchSampler(_lengths(), 2, pool_batches=0)
    with pytest.raises(ValueError, match="rank"):
        BucketBatchSampler(_lengths(), 2, world_size=2, rank=2)


def test_bucket_padding_within_the_cap_and_rounded(data_dir):
    data = listops.ListOpsDataset(listops.load_splits(data_dir)["train"])
    cfg = TrainConfig(**TINY, method="sinkhorn", method_options={"block_size": 8})
    assert pad_multiple(cfg) == 64 and pad_multiple(TrainConfig(batching="pad")) is None
    # the method's registry entry says what a length must divide by: Sinkhorn's block size
    assert pad_multiple(TrainConfig(method="sinkhorn", method_options={"block_size": 48})) == 192
    assert pad_multiple(TrainConfig(method="nystrom", method_options={"num_landmarks": 48})) == 64
    sampler = BucketBatchSampler(data.data.lengths(), 8, seed=0, cap=cfg.pad_to)
    for _ in range(sampler.batches_per_epoch):
        idx = next(sampler)
        tokens, pad, labels = data.batch(idx, 40, multiple=16)
        longest = min(40, int(data.data.lengths()[idx].max()))
        assert tokens.shape[1] == min(40, -(-longest // 16) * 16) and tokens.shape[1] <= 40
        assert int((~pad).sum(1).max()) == longest  # no real token lost below the cap
        assert torch.equal(labels, torch.from_numpy(data.data.labels[idx]))
    # evaluation batches: every index once, sorted by length
    seen = np.concatenate([b[2].numpy() for b in eval_batches(data, np.arange(len(data)), 7, cfg)])
    assert len(seen) == len(data)


@pytest.fixture(scope="module")
def finished_run(data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "nystrom"
    results = train(TrainConfig(**TINY, method="nystrom", method_options={"num_landmarks": 4},
                                data_dir=str(data_dir), out_dir=str(out), steps=9, seed=1))
    return out, results


def _evaluate(capsys, *args):
    status = cli_main(["evaluate", "listops", "--no-progress", *args])
    captured = capsys.readouterr()
    return status, captured.out.strip().splitlines(), captured.err


def test_evaluate_agrees_with_the_trainer(finished_run, data_dir, capsys):
    out, results = finished_run
    status, lines, _ = _evaluate(capsys, "--checkpoint", str(out / "model.pt"), "--data", str(data_dir))
    assert status == 0
    final = json.loads(lines[-1])
    assert final["accuracy"] == results["test_accuracy"] and final["n"] == 40
    # the line before it: the accuracy as a percentage, as train prints it
    assert lines[-2].startswith(f"test accuracy {100 * results['test_accuracy']:.2f}%, loss ")
    assert "on 40 samples (nystrom, step 9)" in lines[-2]
    # the same float32 losses, summed in another order on some torch builds (2.11: 2e-8 apart)
    assert final["method"] == "nystrom" and final["step"] == 9 and final["loss"] == pytest.approx(
        results["test_loss"], rel=1e-6)
    status, lines, _ = _evaluate(capsys, "--checkpoint", str(out / "best.pt"), "--data", str(data_dir))
    best = json.loads(lines[-1])
    assert status == 0 and best["accuracy"] == results["test_accuracy_best_val"]
    assert best["step"] == results["best_val_step"]
    status, lines, _ = _evaluate(capsys, "--checkpoint", str(out / "best.pt"), "--data", str(data_dir),
                                 "--split", "val")
    assert status == 0 and json.loads(lines[-1])["accuracy"] == results["best_val_accuracy"]


def test_evaluate_errors(finished_run, data_dir, tmp_path, capsys):
    out, _ = finished_run
    status, _, err = _evaluate(capsys, "--checkpoint", str(tmp_path / "missing.pt"), "--data", str(data_dir))
    assert status == 2 and "missing.pt" in err
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    status, _, err = _evaluate(capsys, "--checkpoint", str(tmp_path / "junk.pt"), "--data", str(data_dir))
    assert status == 2 and "junk.pt" in err
    saved = ckpt.load(out / "model.pt")
    saved["config"]["task"] = "imdb"
    torch.save(saved, tmp_path / "other.pt")
    status, _, err = _evaluate(capsys, "--checkpoint", str(tmp_path / "other.pt"), "--data", str(data_dir))
    assert status == 2 and "imdb" in err
    torch.save({"weights": torch.zeros(2)}, tmp_path / "plain.pt")
    status, _, err = _evaluate(capsys, "--checkpoint", str(tmp_path / "plain.pt"), "--data", str(data_dir))
    assert status == 2 and "not a subquad model file" in err
    status, _, err = _evaluate(capsys, "--checkpoint", str(out / "model.pt"), "--data", str(tmp_path / "nodata"))
    assert status == 2 and "nodata" in err


def test_resume_a_run_copied_elsewhere(data_dir, tmp_path):
    """A stopped run is committed and checked out on another machine (another path): resuming it
    there ends exactly where an uninterrupted run ends."""
    kwargs = dict(TINY, method="performer", method_options={"num_features": 8}, data_dir=str(data_dir),
                  steps=7, dropout=0.1)
    whole = train(TrainConfig(**kwargs, out_dir=str(tmp_path / "whole")))
    first = train(TrainConfig(**kwargs, out_dir=str(tmp_path / "here"), max_minutes=1e-9))
    assert first["stopped"]
    shutil.copytree(tmp_path / "here", tmp_path / "there")
    shutil.rmtree(tmp_path / "here")
    moved = train(TrainConfig(**kwargs, out_dir=str(tmp_path / "there"), resume=True))
    assert moved["test_accuracy"] == whole["test_accuracy"] and moved["test_loss"] == whole["test_loss"]
    a, b = (ckpt.load(tmp_path / d / "model.pt")["model"] for d in ("whole", "there"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not (tmp_path / "there" / "checkpoint.pt").exists()
    again = train(TrainConfig(**kwargs, out_dir=str(tmp_path / "there"), resume=True))  # finished: no retraining
    assert again["test_accuracy"] == moved["test_accuracy"]


def test_checkpoint_from_before_bucketing_resumes_with_the_published_padding(data_dir, tmp_path):
    kwargs = dict(TINY, method="softmax", data_dir=str(data_dir), out_dir=str(tmp_path / "run"), steps=4,
                  batching="pad")
    train(TrainConfig(**kwargs, max_minutes=1e-9))
    state = ckpt.load(tmp_path / "run" / "checkpoint.pt")
    for key in ("batching", "bucket_pool"):
        del state["config"][key]  # as written before these fields existed
    ckpt.save_atomic(state, tmp_path / "run" / "checkpoint.pt")
    with pytest.raises(ValueError, match="batching: checkpoint 'pad' vs now 'bucket'"):
        train(TrainConfig(**{**kwargs, "batching": "bucket"}, resume=True))
    assert train(TrainConfig(**kwargs, resume=True))["steps"] == 4
