"""The training loop: one task (:mod:`subquad.tasks`), the encoder with any registered method, on
one process or many.

:func:`train` runs one configuration (:class:`~subquad.train.config.TrainConfig`) end to end: load
the task's splits, build the model (:mod:`subquad.train.model_file`), AdamW with warm-up and decay,
validation every ``eval_every`` steps, test accuracy at the end in the same process (for the final
model and for the best-validation model), metrics to ``metrics.csv`` (and TensorBoard when
installed, :mod:`subquad.train.metrics`), checkpoints every ``checkpoint_every`` steps, and
``results.json``. Accuracy counts labels: one per sequence (ListOps) or one per labelled position
(MQAR's queries, the pixels of a segmentation). A task's own scores (``Task.scores``: the mIoU of a
segmentation) are reported beside it, and ``Task.best_by`` picks the best-validation model.

Resuming (``resume=True``) restores model, optimizer, scheduler, step, the RNG states of every
process and the data position from ``OUT/checkpoint.pt``, so a run that was killed and resumed
ends with the same parameters as one that never stopped (same device, threads and world size).

Under ``torchrun --nproc_per_node=N`` the same call trains with DistributedDataParallel:
``batch_size`` is the global batch, split evenly over the processes; each process reads its
shard of every batch (:class:`ShardedBatchSampler`); only rank 0 writes files. With
``context_parallel=C`` each group of C consecutive processes reads the same samples and holds one
contiguous part of every sequence (:func:`subquad.distributed.context_parallel`); the batch is
split over the ``N / C`` groups. The loss is the mean over every labelled position of the global
batch either way, so one process, data parallelism and context parallelism train the same model
(up to rounding, without dropout).
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import random
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel

from ..distributed import context_parallel, shard
from ..tasks import IGNORE, TaskData, make_task
from . import checkpoint as ckpt
from .config import TrainConfig, check_resume, lr_factor, pad_multiple, warmup_for
from .distributed import DistributedContext, setup
from .metrics import MetricsWriter, Progress, loss_and_correct
from .model_file import BEST_MODEL, FINAL_MODEL, build_model, read_model_file, save_model
from .sampler import BucketBatchSampler, ShardedBatchSampler

__all__ = ["train", "evaluate_model", "evaluate_scores", "eval_batches", "CHECKPOINT", "RESULTS"]

CHECKPOINT = "checkpoint.pt"
RESULTS = "results.json"
WINDOW = ("loss", "correct", "labels", "samples", "tokens", "seconds")  # sums between two train log rows


def eval_batches(data, indices: np.ndarray, batch_size: int, cfg: TrainConfig):
    """The evaluation batches of ``indices``: in the given order with ``batching="pad"``, sorted by
    length (stable) with ``batching="bucket"``; each as ``data.batch`` returns it."""
    indices = np.asarray(indices, dtype=np.int64)
    if cfg.batching == "bucket":
        indices = indices[np.argsort(data.lengths()[indices], kind="stable")]
    multiple = pad_multiple(cfg)
    for a in range(0, len(indices), batch_size):
        yield data.batch(indices[a:a + batch_size], cfg.pad_to, multiple)


def _seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed % (1 << 32))
    random.seed(seed)


@torch.no_grad()
def _evaluate(model: torch.nn.Module, data, indices: np.ndarray, batch_size: int,
              cfg: TrainConfig, ctx: DistributedContext, progress: bool = False) -> dict[str, Any]:
    """Mean ``loss``, ``accuracy`` and count ``n`` over ``indices``, and the task's scores, sharded
    over processes. Runs in eval mode under a forked, fixed RNG, so it is reproducible and leaves
    the training RNG as is."""
    task = make_task(cfg.task, cfg.task_options)
    was_training = model.training
    model.eval()
    mine = indices[ctx.data_rank::ctx.data_size]
    loss_sum = correct = count = 0.0
    counts = _empty_counts(task)
    devices = [ctx.device.index] if ctx.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(cfg.seed + 12345)
        batches = eval_batches(data, mine, batch_size, cfg)
        if progress:
            from tqdm.auto import tqdm
            batches = tqdm(batches, total=-(-len(mine) // batch_size), unit="batch", file=sys.stderr)
        for batch in batches:
            with torch.autocast(ctx.device.type, dtype=torch.bfloat16, enabled=cfg.amp == "bf16"):
                logits, labels = _forward(model, *_on_device(batch, ctx), ctx)
            loss, right, labelled = loss_and_correct(logits, labels)
            loss_sum += loss.item()
            correct += right.item()
            count += labelled.item()
            if counts is not None:
                counts = counts + task.score_counts(logits, labels)
    sums = ctx.all_reduce_sum([loss_sum, correct, float(count), *([] if counts is None else counts.tolist())])
    model.train(was_training)
    loss_sum, correct, count = sums[0], sums[1], int(round(sums[2]))
    scores = {} if counts is None else task.score_values(torch.tensor(sums[3:], dtype=torch.float64))
    return {"loss": loss_sum / max(count, 1), "accuracy": correct / max(count, 1), "n": count, **scores}


def _empty_counts(task) -> torch.Tensor | None:
    """The task's score counts of no labels (zeros), None for a task without scores."""
    if not task.scores:
        return None
    return task.score_counts(torch.zeros(0, task.num_classes), torch.zeros(0, dtype=torch.int64))


def _on_device(batch, ctx: DistributedContext) -> tuple[torch.Tensor, ...]:
    """A batch's tensors on this process's device; with context parallelism, its part of each
    sequence (``tensor_split`` along the positions, in the sequence group's rank order)."""
    batch = tuple(t.to(ctx.device) for t in batch)
    if ctx.sequence_group is None:
        return batch
    return tuple(shard(t, 1, ctx.sequence_group) for t in batch)


def _forward(model: torch.nn.Module, tokens: torch.Tensor, pad: torch.Tensor, labels: torch.Tensor,
             ctx: DistributedContext) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and their labels: per sequence, or (labels per position) at the labelled positions only."""
    with (contextlib.nullcontext() if ctx.sequence_group is None else context_parallel(model, ctx.sequence_group)):
        if labels.dim() == 1:
            return model(tokens, pad), labels
        select = labels != IGNORE
        return model(tokens, pad, select), labels[select]


def _atomic_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def evaluate_model(model: torch.nn.Module, cfg: TrainConfig, data,
                   indices: np.ndarray | None = None, *, progress: bool = False) -> tuple[float, float, int]:
    """Mean loss, accuracy and count of ``model`` on ``data`` (all of it by default) with the
    run's input pipeline, batch size and autocast: the numbers the trainer reports."""
    out = evaluate_scores(model, cfg, data, indices, progress=progress)
    return out["loss"], out["accuracy"], out["n"]


def evaluate_scores(model: torch.nn.Module, cfg: TrainConfig, data,
                    indices: np.ndarray | None = None, *, progress: bool = False) -> dict[str, Any]:
    """:func:`evaluate_model` as a dict, ``loss``, ``accuracy`` and ``n``, with the task's own
    scores (``Task.scores``, e.g. ``miou``) beside them."""
    indices = np.arange(len(data)) if indices is None else np.asarray(indices)
    ctx = DistributedContext(device=next(model.parameters()).device)
    return _evaluate(model, data, indices, cfg.batch_size, cfg, ctx, progress=progress)


def _finished_run(cfg: TrainConfig, ctx: DistributedContext, out_dir: Path) -> dict[str, Any]:
    """``OUT`` holds a finished run (results.json, no checkpoint): with ``resume``, return its
    results if it was run with this configuration."""
    results = json.loads((out_dir / RESULTS).read_text())
    if not cfg.resume:
        raise ValueError(f"{str(out_dir)!r} holds a finished run: pass resume=True (--resume) to read its "
                         "results, or choose another output directory")
    check_resume(results["config"], cfg, ctx.world_size, results.get("world_size", 1))
    if ctx.is_main:
        scores = "".join(f", {name} {100 * results[f'test_{name}']:.2f}%"
                         for name in make_task(cfg.task, cfg.task_options).scores if f"test_{name}" in results)
        print(f"{out_dir} is finished ({results['steps']} steps): test accuracy "
              f"{100 * results['test_accuracy']:.2f}%{scores}", flush=True)
    return results


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Run ``cfg``; returns the results dict (also written to ``OUT/results.json`` by rank 0)."""
    cfg.validate()
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    ctx = setup(cfg.device, cfg.context_parallel)
    try:
        results = _train(cfg, ctx)
    except BaseException:
        ctx.cleanup()
        raise
    ctx.cleanup(synchronize=True)
    return results


def _train(cfg: TrainConfig, ctx: DistributedContext) -> dict[str, Any]:
    """The phases of a run: resume state (:func:`_read_checkpoint`), data and model (:class:`_Run`),
    the loop of :meth:`_Run.train_step` with :meth:`_Run.validate` and :meth:`_Run.save_checkpoint`,
    then :meth:`_Run.finish` (test, model.pt, results.json) or :meth:`_Run.stop` (out of time)."""
    out_dir = Path(cfg.out_dir)
    if cfg.batch_size % ctx.data_size:
        raise ValueError(f"batch_size ({cfg.batch_size}) must be divisible by the number of data-parallel "
                         f"processes ({ctx.data_size})")
    if not (out_dir / CHECKPOINT).is_file() and (out_dir / RESULTS).is_file():
        return _finished_run(cfg, ctx, out_dir)
    run = _Run(cfg, ctx, _read_checkpoint(cfg, ctx, out_dir / CHECKPOINT))
    try:
        while run.step < cfg.steps:
            run.train_step()
            if run.step % cfg.eval_every == 0 or run.step == cfg.steps:
                run.validate()
            out_of_time = run.out_of_time()
            if run.step % cfg.checkpoint_every == 0 or run.step == cfg.steps or out_of_time:
                run.save_checkpoint()
            if out_of_time and run.step < cfg.steps:
                return run.stop()
        return run.finish()
    finally:
        run.close()


def _read_checkpoint(cfg: TrainConfig, ctx: DistributedContext, path: Path) -> dict[str, Any] | None:
    """The resume state at ``path`` (None when there is none), checked against ``cfg``."""
    if not path.is_file():
        return None
    if not cfg.resume:
        raise ValueError(f"{str(path)!r} exists: pass resume=True (--resume) to continue that run, "
                         "or choose another output directory")
    state = ckpt.load(path, map_location="cpu")
    check_resume(state["config"], cfg, ctx.world_size, state["world_size"])
    return state


class _Run:
    """One process of a training run: data, model, optimiser and sampler, and the loop state that a
    checkpoint saves (step, best validation, metric window, elapsed time, RNG)."""

    def __init__(self, cfg: TrainConfig, ctx: DistributedContext, resume_state: dict[str, Any] | None):
        self.t_start = time.perf_counter()
        self.cfg, self.ctx = cfg, ctx
        self.out_dir = Path(cfg.out_dir)
        self.ckpt_path = self.out_dir / CHECKPOINT
        self.local_batch = cfg.batch_size // ctx.data_size
        self.say = print if ctx.is_main else (lambda *a, **k: None)
        self.task = make_task(cfg.task, cfg.task_options)
        self.data: TaskData = self.task.load(cfg.data_dir, cfg.eval_samples)
        _seed_all(cfg.seed)  # the initial weights
        self._build_model()
        if resume_state is None and cfg.init_from is not None:
            self._warm_start(cfg.init_from)
        self._build_sampler()
        _seed_all(cfg.seed + 1 + ctx.rank)  # training randomness (dropout, stochastic methods), per process
        self.step = 0
        self.best: dict[str, Any] = {"accuracy": -1.0, "step": 0}
        self.best_state: dict[str, torch.Tensor] | None = None
        self.window = dict.fromkeys(WINDOW, 0.0)
        self.elapsed_before = 0.0
        if resume_state is not None:
            self._resume(resume_state)
        self.metrics = None
        if ctx.is_main:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self.metrics = MetricsWriter(self.out_dir, resume_step=self.step if resume_state is not None else None,
                                          tensorboard=cfg.tensorboard, scores=self.task.scores)
        self._announce()
        # progress=False drops the bar, not the lines: a line every log_every steps and one per evaluation
        self.progress = Progress(ctx.is_main, cfg.progress, cfg.steps, self.step)
        self.net.train()

    def _build_model(self) -> None:
        """Model (wrapped for DDP), optimiser and learning-rate schedule."""
        cfg, ctx = self.cfg, self.ctx
        self.model, self.attn_dropout = build_model(cfg, ctx.device)
        self.net: torch.nn.Module = self.model
        if ctx.distributed:
            device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
            self.net = DistributedDataParallel(self.model, device_ids=device_ids)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                                           weight_decay=cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda e: lr_factor(e + 1, warmup=warmup_for(cfg), total=cfg.steps, schedule=cfg.schedule))

    def _warm_start(self, path: str | os.PathLike) -> None:
        """Initial weights from another run's model file (``init_from``)."""
        saved, source = read_model_file(path)
        mine = self.model.state_dict()
        theirs = saved["model"]
        missing, extra = sorted(set(mine) - set(theirs)), sorted(set(theirs) - set(mine))
        shapes = [f"{k}: {tuple(theirs[k].shape)} vs {tuple(v.shape)}" for k, v in mine.items()
                  if k in theirs and theirs[k].shape != v.shape]
        if missing or extra or shapes:
            detail = "; ".join(x for x in (
                f"missing {', '.join(missing[:3])}" if missing else "",
                f"unexpected {', '.join(extra[:3])}" if extra else "",
                f"shapes differ: {', '.join(shapes[:3])}" if shapes else "") if x)
            raise ValueError(f"init_from {str(path)!r} (method {source.method!r}, step {saved.get('step')}) "
                             f"does not fit this run's model: {detail}")
        self.model.load_state_dict(theirs)
        self.say(f"initial weights from {path} (method {source.method}, step {saved.get('step')})", flush=True)

    def _build_sampler(self) -> None:
        """This process's stream of training batches and what their length is rounded up to."""
        cfg, ctx = self.cfg, self.ctx
        lengths = self.data.train.lengths()
        if cfg.batching == "bucket":
            self.sampler = BucketBatchSampler(lengths, self.local_batch, world_size=ctx.data_size,
                                              rank=ctx.data_rank, seed=cfg.seed, pool_batches=cfg.bucket_pool,
                                              cap=cfg.pad_to)
        else:
            self.sampler = ShardedBatchSampler(len(lengths), self.local_batch, world_size=ctx.data_size,
                                               rank=ctx.data_rank, seed=cfg.seed)
        self.multiple = pad_multiple(cfg)

    def _resume(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint: weights, optimiser, schedule, data position, RNG, loop state."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.sampler.load_state_dict(state["sampler"])
        ckpt.set_rng_state(state["rng"][self.ctx.rank])
        self.step = int(state["step"])
        self.best = dict(state["best"])
        self.best_state = state.get("best_model")
        # a checkpoint from before per-position labels counted one label per sample
        self.window = {"labels": state["window"]["samples"], **state["window"]}
        self.elapsed_before = float(state["elapsed_s"])
        self.say(f"resuming {self.out_dir} from step {self.step}", flush=True)

    def _announce(self) -> None:
        cfg, ctx, data = self.cfg, self.ctx, self.data
        self.say(data.description, flush=True)
        too_long = int((data.train.lengths() > cfg.pad_to).sum())
        if too_long:
            self.say(f"note: {too_long} training sequences are longer than pad_to={cfg.pad_to} and are truncated")
        opts = ", ".join(f"{k}={v!r}" for k, v in cfg.method_options.items())
        n_params = sum(p.numel() for p in self.model.parameters())
        self.say(f"model: method={cfg.method}" + (f" ({opts})" if opts else "")
                 + f", {cfg.layers} layers, dim {cfg.dim}, {cfg.heads} heads, ffn {cfg.ffn_dim}, "
                 f"{n_params} parameters; attention dropout {self.attn_dropout}; "
                 f"{ctx.world_size} process(es) on {ctx.device}, batch {cfg.batch_size} "
                 f"({self.local_batch} per process)" + (f"; each sequence split over {ctx.context_parallel} "
                                                        "processes" if ctx.sequence_group is not None else ""),
                 flush=True)

    def elapsed(self) -> float:
        return self.elapsed_before + time.perf_counter() - self.t_start

    def log_row(self, split: str, loss: float, acc: float, samples: int, **extra: Any) -> None:
        if self.metrics is None:
            return
        row = {"step": self.step, "split": split, "loss": f"{loss:.6f}", "accuracy": f"{acc:.6f}",
               "samples": samples, "elapsed_s": f"{self.elapsed():.1f}"}
        row.update({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in extra.items()})
        self.metrics.write(row)

    def train_step(self) -> None:
        """One optimizer update, its metrics, and a ``train`` row every ``log_every`` steps."""
        cfg, ctx = self.cfg, self.ctx
        t0 = time.perf_counter()
        batch = self.data.train.batch(next(self.sampler), cfg.pad_to, self.multiple)
        tokens, pad, labels = _on_device(batch, ctx)
        with torch.autocast(ctx.device.type, dtype=torch.bfloat16, enabled=cfg.amp == "bf16"):
            logits, labels = _forward(self.net, tokens, pad, labels, ctx)
        loss_sum, correct, labelled = loss_and_correct(logits, labels)
        # the mean over every process's labels: DDP averages the gradients of the processes' losses,
        # so each divides its sum by the global count / world size (labels per position vary by shard)
        labels_total = ctx.all_reduce_sum([float(labelled)])[0] if ctx.distributed else float(labelled)
        loss = loss_sum * (ctx.world_size / max(labels_total, 1.0))
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        self.optimizer.step()
        lr = self.optimizer.param_groups[0]["lr"]
        self.scheduler.step()
        self.step += 1
        if not math.isfinite(loss.item()):
            raise FloatingPointError(f"the training loss is {loss.item()} at step {self.step}")
        w = self.window
        w["loss"] += loss_sum.item()
        w["correct"] += correct.item()
        w["labels"] += labelled.item()
        w["samples"] += len(tokens) if ctx.sequence_rank == 0 else 0  # a sequence group's samples once
        w["tokens"] += (~pad).sum().item()
        w["seconds"] += time.perf_counter() - t0
        rate = w["samples"] / max(w["seconds"], 1e-9)
        info = {"loss": f"{w['loss'] / max(w['labels'], 1):.4f}", "lr": f"{lr:.2e}",
                "samples/s": f"{rate * ctx.data_size:.1f}"}
        log_now = self.step % cfg.log_every == 0 or self.step == cfg.steps
        self.progress.update(self.step, info, plain=log_now)
        if log_now:
            loss_sum, correct, labels_n, samples, tokens_n, seconds = ctx.all_reduce_sum(
                [w["loss"], w["correct"], w["labels"], w["samples"], w["tokens"], w["seconds"]])
            seconds /= ctx.world_size
            self.log_row("train", loss_sum / labels_n, correct / labels_n, int(samples), lr=lr,
                         samples_per_s=samples / max(seconds, 1e-9), tokens_per_s=tokens_n / max(seconds, 1e-9))
            self.window = dict.fromkeys(w, 0.0)

    def validate(self) -> None:
        """Validation accuracy and scores; a new best (by the task's ``best_by``) is kept in memory
        and written to ``best.pt``."""
        r = _evaluate(self.model, self.data.val, self.data.val_idx, self.local_batch, self.cfg, self.ctx)
        by = self.task.best_by
        if r[by] > self.best.get("score", self.best["accuracy"]):
            self.best = {"accuracy": r["accuracy"], "score": r[by], "step": self.step}
            self.best_state = {k: v.detach().clone().cpu() for k, v in self.model.state_dict().items()}
            if self.ctx.is_main:
                save_model(self.out_dir / BEST_MODEL, self.cfg, self.best_state, self.step,
                           val_accuracy=r["accuracy"], **{f"val_{name}": r[name] for name in self.task.scores})
        scores = {name: r[name] for name in self.task.scores}
        self.log_row("val", r["loss"], r["accuracy"], r["n"], **scores)
        shown = "".join(f", {name} {100 * value:.2f}%" for name, value in scores.items())
        best = "" if by == "accuracy" else f"{by} "
        self.progress.write(f"step {self.step}: val loss {r['loss']:.4f}, accuracy {100 * r['accuracy']:.2f}%{shown} "
                            f"(best {best}{100 * self.best.get('score', self.best['accuracy']):.2f}% at step "
                            f"{self.best['step']})")

    def out_of_time(self) -> bool:
        """``max_minutes`` has passed (agreed by every process, so that all stop at the same step)."""
        if self.cfg.max_minutes is None:
            return False
        out = time.perf_counter() - self.t_start > 60 * self.cfg.max_minutes
        if self.ctx.distributed:
            out = bool(self.ctx.all_reduce_sum([float(out)])[0])
        return out

    def save_checkpoint(self) -> None:
        rng_states = self.ctx.all_gather_object(ckpt.rng_state())
        if self.ctx.is_main:
            ckpt.save_atomic({
                "format": 1, "step": self.step, "config": self.cfg.to_dict(), "world_size": self.ctx.world_size,
                "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "sampler": self.sampler.state_dict(), "rng": rng_states,
                "best": self.best, "best_model": self.best_state, "window": self.window,
                "elapsed_s": self.elapsed(),
            }, self.ckpt_path)
        self.ctx.barrier()

    def test(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """Test loss, accuracy, count and scores of the final model and of the best-validation model
        (the same model when the best validation was the last one)."""
        cfg, ctx, data = self.cfg, self.ctx, self.data
        test_idx = data.test_idx
        final = _evaluate(self.model, data.test, test_idx, self.local_batch, cfg, ctx)
        self._log_test("test", final)
        if self.best_state is None or self.best["step"] == self.step:
            return final, final
        final_state = copy.deepcopy(self.model.state_dict())
        self.model.load_state_dict(self.best_state)
        best = _evaluate(self.model, data.test, test_idx, self.local_batch, cfg, ctx)
        self.model.load_state_dict(final_state)
        self._log_test("test_best_val", best)
        return final, best

    def _log_test(self, split: str, r: dict[str, Any]) -> None:
        self.log_row(split, r["loss"], r["accuracy"], r["n"], **{name: r[name] for name in self.task.scores})

    def stop(self) -> dict[str, Any]:
        """Out of time before the last step: the checkpoint is written; say how to continue."""
        self.say(f"stopped at step {self.step} of {self.cfg.steps} after {self.cfg.max_minutes} minutes; the "
                 f"checkpoint is in {self.ckpt_path}: run again with resume (--resume) to continue", flush=True)
        return {"stopped": True, "step": self.step, "steps": self.cfg.steps, "checkpoint": str(self.ckpt_path)}

    def finish(self) -> dict[str, Any]:
        """Test, then ``model.pt`` and ``results.json``; the resume checkpoint is removed."""
        self.progress.close()
        train_seconds = self.elapsed()
        final, best = self.test()
        results = self._results(final, best, train_seconds)
        if self.ctx.is_main:
            save_model(self.out_dir / FINAL_MODEL, self.cfg, self.model.state_dict(), self.step)
            _atomic_json(self.out_dir / RESULTS, results)
            self.ckpt_path.unlink()  # the run is complete: model.pt, best.pt and results.json remain
            scores = "".join(f"; test {name} {100 * final[name]:.2f}% (final), {100 * best[name]:.2f}% (best "
                             "validation)" for name in self.task.scores)
            self.say(f"test accuracy {100 * final['accuracy']:.2f}% (final model), {100 * best['accuracy']:.2f}% "
                     f"(best validation model, step {self.best['step']}){scores}; {self._baseline()}"
                     f"{self.step} steps in {train_seconds:.0f} s (+ {results['wall_seconds'] - train_seconds:.0f} "
                     "s of testing)", flush=True)
        self.ctx.barrier()
        return results

    def _results(self, final: dict[str, Any], best: dict[str, Any], train_seconds: float) -> dict:
        cfg, data, task = self.cfg, self.data, self.task
        scores = {f"test_{name}": final[name] for name in task.scores}
        scores.update({f"test_{name}_best_val": best[name] for name in task.scores})
        if task.best_by != "accuracy":
            scores[f"best_val_{task.best_by}"] = self.best.get("score", self.best["accuracy"])
        return {
            "task": cfg.task, "task_options": cfg.task_options, "method": cfg.method,
            "method_options": cfg.method_options, "preset": cfg.preset,
            "steps": self.step, "test_accuracy": final["accuracy"], "test_loss": final["loss"],
            "test_accuracy_best_val": best["accuracy"], **scores,
            "best_val_accuracy": self.best["accuracy"], "best_val_step": self.best["step"],
            "val_samples": int(len(data.val_idx)), "test_samples": int(len(data.test_idx)), "test_labels": final["n"],
            **data.facts,
            "parameters": sum(p.numel() for p in self.model.parameters()),
            "attention_dropout_applied": self.attn_dropout, "train_seconds": round(train_seconds, 1),
            "wall_seconds": round(self.elapsed(), 1), "world_size": self.ctx.world_size,
            "context_parallel": self.ctx.context_parallel,
            "device": str(self.ctx.device), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "config": cfg.to_dict(), "command": shlex.join(sys.argv),
        }

    def _baseline(self) -> str:
        facts = self.data.facts
        if "majority_test_accuracy" in facts:
            return f"majority baseline {100 * facts['majority_test_accuracy']:.2f}%; "
        if "chance_accuracy" in facts:
            return f"chance {100 * facts['chance_accuracy']:.2f}%; "
        return ""

    def close(self) -> None:
        self.progress.close()
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
