"""Train the encoder on LRA ListOps with any registered method, on one process or many.

:func:`train` runs one configuration (:class:`TrainConfig`) end to end: load the splits,
build :class:`subquad.models.Encoder`, AdamW with warm-up and decay, validation every
``eval_every`` steps, test accuracy at the end in the same process (for the final model and for
the best-validation model), metrics to ``metrics.csv`` (and TensorBoard when installed),
checkpoints every ``checkpoint_every`` steps, and ``results.json``.

Defaults are the Nyströmformer LRA ListOps configuration (preset ``"nystromformer"``); the
original LRA configuration is preset ``"lra"``. See :data:`PRESETS`.

Resuming (``resume=True``) restores model, optimizer, scheduler, step, the RNG states of every
process and the data position from ``OUT/checkpoint.pt``, so a run that was killed and resumed
ends with the same parameters as one that never stopped (same device, threads and world size).

Under ``torchrun --nproc_per_node=N`` the same call trains with DistributedDataParallel:
``batch_size`` is the global batch, split evenly over the processes; each process reads its
shard of every batch (:class:`ShardedBatchSampler`); only rank 0 writes files.
"""

from __future__ import annotations

import copy
import csv
import dataclasses
import json
import math
import os
import pickle
import random
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel

from ..models.encoder import Encoder, cross_entropy, supports_attention_dropout
from ..registry import get_method
from ..tasks import listops
from . import checkpoint as ckpt
from .distributed import DistributedContext, setup
from .sampler import BucketBatchSampler, ShardedBatchSampler

__all__ = ["TrainConfig", "PRESETS", "train", "lr_factor", "TRAJECTORY_FIELDS", "pad_multiple", "save_model",
           "load_model", "evaluate_model"]

CHECKPOINT = "checkpoint.pt"
METRICS = "metrics.csv"
RESULTS = "results.json"
FINAL_MODEL = "model.pt"
BEST_MODEL = "best.pt"
MODEL_KIND = "subquad.listops.encoder"
BATCHINGS = ("bucket", "pad")
# With batching="bucket", a batch is padded to its longest sample rounded up to a multiple of this
# (and of sinkhorn's block size, which the op would otherwise pad to internally).
PAD_MULTIPLE = 64
METRIC_COLUMNS = ("step", "split", "loss", "accuracy", "samples", "lr", "samples_per_s", "tokens_per_s",
                  "elapsed_s")

# Nyströmformer's PyTorch LRA ListOps config (mlpen/Nystromformer LRA/code/lra_config.py, run_tasks.py):
# AdamW(0.9, 0.999, eps 1e-6), warm-up then linear decay, MLP classifier head, attention dropout
# on softmax only (their other attentions have none).
# LRA's own ListOps config (google-research/long-range-arena, lra_benchmarks/listops/configs/
# base_listops_config.py and models/transformer): 6 layers, dim 512, 8 heads, MLP 2048, a CLS token
# whose final state feeds Dense(2048), ReLU, Dense(10); fixed sinusoidal positions; Adam(0.9, 0.98,
# eps 1e-9) with decoupled weight decay 0.1, lr 0.05 * min(1, step / 1000) / sqrt(max(step, 1000)),
# inputs up to 2000 tokens. Not reproduced: its token embedding init (N(0, 1)) and Flax's defaults
# for the dense layers' initialisation.
PRESETS: dict[str, dict[str, Any]] = {
    "nystromformer": dict(layers=2, dim=64, heads=2, ffn_dim=128, positions="learned", dropout=0.1,
                          attention_dropout=0.1, head_hidden=128, pooling="mean", batch_size=32, lr=1e-4,
                          warmup_steps=1000,
                          schedule="linear", steps=5000, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-6,
                          pad_to=2048, eval_every=50),
    "lra": dict(layers=6, dim=512, heads=8, ffn_dim=2048, positions="sinusoidal", dropout=0.1,
                attention_dropout=0.1, head_hidden=2048, pooling="cls", batch_size=32, lr=0.05, warmup_steps=1000,
                schedule="rsqrt", steps=5000, weight_decay=0.1, betas=(0.9, 0.98), eps=1e-9, pad_to=2000,
                eval_every=50),
}
SCHEDULES = ("linear", "rsqrt", "constant")

# Fields that determine the training trajectory: a resumed run must agree on all of them.
TRAJECTORY_FIELDS = ("task", "method", "method_options", "layers", "dim", "heads", "ffn_dim", "positions", "pooling",
                     "dropout", "attention_dropout", "head_hidden", "batch_size", "lr", "warmup_steps",
                     "schedule", "steps", "weight_decay", "betas", "eps", "grad_clip", "pad_to", "seed",
                     "amp", "dtype", "batching", "bucket_pool")
# Values of trajectory fields that checkpoints written before the field existed were run with.
LEGACY_FIELDS = {"batching": "pad", "bucket_pool": 64, "pooling": "mean"}


@dataclass
class TrainConfig:
    """One training run. Model/optimizer defaults are preset ``"nystromformer"``.

    ``batch_size`` is the global batch (all processes together). ``attention_dropout`` applies
    only to methods with attention weights (``softmax``); for others it is recorded as 0.
    ``eval_samples`` limits validation and the final test to the first N samples of each (None:
    all). ``steps`` counts optimizer updates; the learning-rate warm-up lasts ``warmup_steps``
    updates but at most half the run (:func:`warmup_for`), so a short run reaches its learning
    rate. ``max_minutes`` stops this process (after writing a checkpoint) once that much wall time
    has passed; ``resume`` then continues the same run, so a long run can be done in slices.

    ``batching="bucket"`` (default) draws batches of samples of similar length
    (:class:`~subquad.train.sampler.BucketBatchSampler`, pools of ``bucket_pool`` batches) and pads
    each batch to its longest sample, rounded up to :func:`pad_multiple` and capped at ``pad_to``;
    validation and test batches are the samples sorted by length. ``batching="pad"`` is the
    published input pipeline: uniform batches, every sequence padded to ``pad_to``.

    ``init_from``: a model file of an earlier run (``best.pt``, ``model.pt`` or ``checkpoint.pt``)
    whose weights replace the initial ones (a warm start, e.g. from a run on shorter inputs; its
    model must have exactly this run's parameter names and shapes). Optimiser, schedule and data
    order start afresh. Used only when the run starts: a resumed run continues from its own
    checkpoint.
    """

    method: str = "softmax"
    method_options: dict[str, Any] = field(default_factory=dict)
    task: str = "listops"
    data_dir: str = "out/data/listops"
    out_dir: str = "out/listops/run"
    preset: str = "nystromformer"
    layers: int = 2
    dim: int = 64
    heads: int = 2
    ffn_dim: int = 128
    positions: str = "learned"
    dropout: float = 0.1
    attention_dropout: float = 0.1
    head_hidden: int = 128
    pooling: str = "mean"
    batch_size: int = 32
    lr: float = 1e-4
    warmup_steps: int = 1000
    schedule: str = "linear"
    steps: int = 5000
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-6
    grad_clip: float | None = None
    pad_to: int = 2048
    batching: str = "bucket"
    bucket_pool: int = 64
    eval_every: int = 50
    eval_samples: int | None = None
    checkpoint_every: int = 500
    log_every: int = 50
    seed: int = 0
    threads: int | None = None
    device: str = "auto"
    amp: str = "none"
    dtype: str = "float32"
    resume: bool = False
    max_minutes: float | None = None
    progress: bool | None = None
    tensorboard: bool | None = None
    init_from: str | None = None

    @classmethod
    def from_preset(cls, preset: str = "nystromformer", **overrides: Any) -> "TrainConfig":
        """The preset's values, then ``overrides`` (None values are ignored)."""
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; presets are {sorted(PRESETS)}")
        values = dict(PRESETS[preset])
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(preset=preset, **values)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["betas"] = list(self.betas)
        return out

    def validate(self) -> None:
        """ValueError/TypeError naming the first bad field."""
        if self.task != "listops":
            raise ValueError(f"task must be 'listops', got {self.task!r}")
        get_method(self.method)  # unknown method: ValueError listing the known ones
        if not isinstance(self.method_options, dict):
            raise TypeError(f"method_options must be a dict, got {type(self.method_options).__name__}")
        for name in ("layers", "dim", "heads", "ffn_dim", "batch_size", "steps", "pad_to", "eval_every",
                     "checkpoint_every", "log_every", "bucket_pool"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name in ("warmup_steps", "seed", "head_hidden"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        n = self.eval_samples
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n <= 0):
            raise ValueError(f"eval_samples must be a positive int or None, got {self.eval_samples!r}")
        if self.max_minutes is not None and not (isinstance(self.max_minutes, (int, float))
                                                 and self.max_minutes > 0):
            raise ValueError(f"max_minutes must be a positive number or None, got {self.max_minutes!r}")
        if self.init_from is not None and not isinstance(self.init_from, (str, os.PathLike)):
            raise TypeError(f"init_from must be a path or None, got {type(self.init_from).__name__}")
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads <= 0):
            raise ValueError(f"threads must be a positive int or None, got {self.threads!r}")
        if not (isinstance(self.lr, (int, float)) and self.lr > 0):
            raise ValueError(f"lr must be a positive number, got {self.lr!r}")
        for name in ("weight_decay",):
            if not (isinstance(getattr(self, name), (int, float)) and getattr(self, name) >= 0):
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("dropout", "attention_dropout"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0 <= v < 1):
                raise ValueError(f"{name} must be in [0, 1), got {v!r}")
        clip = self.grad_clip
        if clip is not None and not (isinstance(clip, (int, float)) and clip > 0):
            raise ValueError(f"grad_clip must be a positive number or None, got {self.grad_clip!r}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {self.betas!r}")
        if not self.eps > 0:
            raise ValueError(f"eps must be > 0, got {self.eps!r}")
        if self.pooling not in ("mean", "cls"):
            raise ValueError(f"pooling must be 'mean' or 'cls', got {self.pooling!r}")
        if self.batching not in BATCHINGS:
            raise ValueError(f"batching must be one of {list(BATCHINGS)}, got {self.batching!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {list(SCHEDULES)}, got {self.schedule!r}")
        if self.amp not in ("none", "bf16"):
            raise ValueError(f"amp must be 'none' or 'bf16', got {self.amp!r}")
        if self.dtype not in ("float32", "float64"):
            raise ValueError(f"dtype must be 'float32' or 'float64', got {self.dtype!r}")
        if self.amp != "none" and self.dtype != "float32":
            raise ValueError("amp needs dtype='float32'")
        if self.dim % self.heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by heads ({self.heads})")


def pad_multiple(cfg: TrainConfig) -> int | None:
    """What a batch's length is rounded up to: None (pad to ``pad_to``) with ``batching="pad"``,
    else :data:`PAD_MULTIPLE`, or its least common multiple with the method's ``length_multiple``
    for its options (Sinkhorn's ``block_size``)."""
    if cfg.batching == "pad":
        return None
    info = get_method(cfg.method)
    if info.length_multiple is None:
        return PAD_MULTIPLE
    options = {k: v for k, v in cfg.method_options.items() if k in info.option_names}  # not module-only options
    return math.lcm(PAD_MULTIPLE, int(info.length_multiple(info.make_options(**options))))


def eval_batches(data: listops.ListOpsDataset, indices: np.ndarray, batch_size: int, cfg: TrainConfig):
    """The evaluation batches of ``indices``: in the given order with ``batching="pad"``, sorted by
    length (stable) with ``batching="bucket"``; each as ``data.batch`` returns it."""
    indices = np.asarray(indices, dtype=np.int64)
    if cfg.batching == "bucket":
        indices = indices[np.argsort(data.data.lengths()[indices], kind="stable")]
    multiple = pad_multiple(cfg)
    for a in range(0, len(indices), batch_size):
        yield data.batch(indices[a:a + batch_size], cfg.pad_to, multiple)


def warmup_for(cfg: "TrainConfig") -> int:
    """The warm-up a run uses: ``warmup_steps``, at most half of ``steps`` (``--steps 20`` with the
    presets' 1000 warm-up steps would otherwise end before the learning rate passed 2 %)."""
    return min(cfg.warmup_steps, cfg.steps // 2)


def lr_factor(step: int, *, warmup: int, total: int, schedule: str) -> float:
    """Multiplier of the base learning rate for update ``step`` (1-based).

    ``linear``: ``step / warmup`` up to ``warmup``, then linear decay reaching ``1 / (total -
    warmup + 1)`` at the last update. ``rsqrt`` (LRA): ``min(1, step / warmup) / sqrt(max(step,
    warmup))``. ``constant``: linear warm-up, then 1.
    """
    warm = min(1.0, step / warmup) if warmup > 0 else 1.0
    if schedule == "rsqrt":
        return warm / math.sqrt(max(step, warmup, 1))
    if schedule == "constant" or step <= warmup:
        return warm
    return max(0.0, (total - step + 1) / (total - warmup + 1))


class _MetricsWriter:
    """``metrics.csv`` (one row per log / evaluation) and, if installed, TensorBoard."""

    def __init__(self, out_dir: Path, *, resume_step: int | None, tensorboard: bool | None):
        self.path = out_dir / METRICS
        rows = []
        if resume_step is not None and self.path.is_file():
            with open(self.path, newline="") as f:
                rows = [r for r in csv.DictReader(f)
                        if int(r["step"]) <= resume_step and r["split"] in ("train", "val")]
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w", newline="") as f:  # keep only what the checkpoint has seen
            writer = csv.DictWriter(f, fieldnames=METRIC_COLUMNS)
            writer.writeheader()
            writer.writerows(rows)
        os.replace(tmp, self.path)
        self.file = open(self.path, "a", newline="")
        self.writer = csv.DictWriter(self.file, fieldnames=METRIC_COLUMNS)
        self.tb = None
        if tensorboard is not False:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                if tensorboard:
                    raise ValueError("tensorboard=True but the tensorboard package is not installed "
                                     "(pip install 'subquad[train]')") from None
            else:
                purge = None if resume_step is None else resume_step + 1
                self.tb = SummaryWriter(str(out_dir / "tensorboard"), purge_step=purge)

    def write(self, row: dict[str, Any]) -> None:
        self.writer.writerow({k: row.get(k, "") for k in METRIC_COLUMNS})
        self.file.flush()
        if self.tb is not None:
            for key in ("loss", "accuracy", "lr", "samples_per_s"):
                if row.get(key) not in (None, ""):
                    self.tb.add_scalar(f"{row['split']}/{key}", float(row[key]), int(row["step"]))

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()


class _Progress:
    """tqdm bar when available and wanted (``use_tqdm`` not False), else a plain line every
    ``log_every`` steps; evaluation lines either way. Silent only when not ``enabled`` (the
    processes of a distributed run other than the first)."""

    def __init__(self, enabled: bool, use_tqdm: bool | None, total: int, initial: int):
        self.enabled = enabled
        self.bar = None
        if enabled and use_tqdm is not False:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                interactive = sys.stderr.isatty()
                self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True,
                                mininterval=0.5 if interactive else 30.0)

    def update(self, step: int, info: dict[str, Any], plain: bool) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(info, refresh=False)
        elif plain:
            print(f"step {step}: " + ", ".join(f"{k} {v}" for k, v in info.items()), flush=True)

    def write(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed % (1 << 32))
    random.seed(seed)


def _build_model(cfg: TrainConfig, device: torch.device) -> tuple[Encoder, float]:
    attn_dropout = cfg.attention_dropout if supports_attention_dropout(cfg.method) else 0.0
    dtype = torch.float64 if cfg.dtype == "float64" else torch.float32
    model = Encoder(listops.VOCAB_SIZE, listops.NUM_CLASSES, method=cfg.method,
                    method_options=cfg.method_options, dim=cfg.dim, depth=cfg.layers, heads=cfg.heads,
                    ffn_dim=cfg.ffn_dim, max_len=cfg.pad_to,
                    positions=cfg.positions, dropout=cfg.dropout, attention_dropout=attn_dropout,
                    head_hidden=cfg.head_hidden, pooling=cfg.pooling, device=device, dtype=dtype)
    return model, attn_dropout


@torch.no_grad()
def _evaluate(model: torch.nn.Module, data: listops.ListOpsDataset, indices: np.ndarray, batch_size: int,
              cfg: TrainConfig, ctx: DistributedContext, progress: bool = False) -> tuple[float, float, int]:
    """Mean loss, accuracy and count over ``indices``, sharded over processes. Runs in eval
    mode under a forked, fixed RNG, so it is reproducible and leaves the training RNG as is."""
    was_training = model.training
    model.eval()
    shard = indices[ctx.rank::ctx.world_size]
    loss_sum = correct = 0.0
    devices = [ctx.device.index] if ctx.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(cfg.seed + 12345)
        batches = eval_batches(data, shard, batch_size, cfg)
        if progress:
            from tqdm.auto import tqdm
            batches = tqdm(batches, total=-(-len(shard) // batch_size), unit="batch", file=sys.stderr)
        for tokens, pad, labels in batches:
            tokens, pad, labels = tokens.to(ctx.device), pad.to(ctx.device), labels.to(ctx.device)
            with torch.autocast(ctx.device.type, dtype=torch.bfloat16, enabled=cfg.amp == "bf16"):
                logits = model(tokens, pad)
            loss_sum += torch.nn.functional.cross_entropy(logits.float(), labels, reduction="sum").item()
            correct += (logits.argmax(-1) == labels).sum().item()
    loss_sum, correct, count = ctx.all_reduce_sum([loss_sum, correct, float(len(shard))])
    model.train(was_training)
    count = int(round(count))
    return loss_sum / max(count, 1), correct / max(count, 1), count


def _atomic_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def _check_resume_config(saved: dict[str, Any], cfg: TrainConfig, world_size: int, saved_world: int) -> None:
    saved = {**LEGACY_FIELDS, **saved}
    now = cfg.to_dict()
    diff = [k for k in TRAJECTORY_FIELDS if _normal(saved.get(k)) != _normal(now.get(k))]
    if diff:
        detail = ", ".join(f"{k}: checkpoint {saved.get(k)!r} vs now {now.get(k)!r}" for k in diff)
        raise ValueError(f"cannot resume: the checkpoint was written by a different configuration ({detail})")
    if saved_world != world_size:
        raise ValueError(f"cannot resume: the checkpoint was written by {saved_world} process(es), "
                         f"this run has {world_size}")


def _normal(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_normal(v) for v in value]
    if isinstance(value, dict):
        return {k: _normal(v) for k, v in sorted(value.items())}
    return value


def save_model(path: Path, cfg: TrainConfig, state: dict[str, torch.Tensor], step: int, **extra: Any) -> None:
    """A model file: weights, the run's config and the step; all :func:`load_model` needs."""
    ckpt.save_atomic({"kind": MODEL_KIND, "format": 1, "config": cfg.to_dict(), "step": step,
                      "model": {k: v.detach().cpu() for k, v in state.items()}, **extra}, path)


def load_model(path: str | os.PathLike, device: str | torch.device = "cpu") -> tuple[Encoder, TrainConfig, dict]:
    """Rebuild the encoder saved by a run (``model.pt``, ``best.pt`` or ``checkpoint.pt``) in eval
    mode; returns ``(model, config, file contents)``. A file that is not a ListOps model of this
    trainer raises ValueError."""
    saved, cfg = _read_model_file(path)
    model, _ = _build_model(cfg, torch.device(device))
    model.load_state_dict(saved["model"])
    model.eval()
    return model, cfg, saved


def _read_model_file(path: str | os.PathLike) -> tuple[dict, TrainConfig]:
    """The contents of a run's model file and the config it was written with."""
    try:
        saved = ckpt.load(path, map_location="cpu")
    except (RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError) as e:
        if isinstance(e, FileNotFoundError):
            raise
        raise ValueError(f"{str(path)!r} is not a readable checkpoint ({str(e).splitlines()[0]})") from None
    if not isinstance(saved, dict) or not isinstance(saved.get("config"), dict) or "model" not in saved:
        raise ValueError(f"{str(path)!r} is not a subquad ListOps checkpoint (no config and model)")
    values = {**LEGACY_FIELDS, **saved["config"]}
    if values.get("task") != "listops":
        raise ValueError(f"{str(path)!r} is a checkpoint of task {values.get('task')!r}, not 'listops'")
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    values = {k: v for k, v in values.items() if k in known}
    values["betas"] = tuple(values.get("betas", (0.9, 0.999)))
    return saved, TrainConfig(**values)


def evaluate_model(model: torch.nn.Module, cfg: TrainConfig, data: listops.ListOpsDataset,
                   indices: np.ndarray | None = None, *, progress: bool = False) -> tuple[float, float, int]:
    """Mean loss, accuracy and count of ``model`` on ``data`` (all of it by default) with the
    run's input pipeline, batch size and autocast: the numbers the trainer reports."""
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
    _check_resume_config(results["config"], cfg, ctx.world_size, results.get("world_size", 1))
    if ctx.is_main:
        print(f"{out_dir} is finished ({results['steps']} steps): test accuracy "
              f"{100 * results['test_accuracy']:.2f}%", flush=True)
    return results


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Run ``cfg``; returns the results dict (also written to ``OUT/results.json`` by rank 0)."""
    cfg.validate()
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    ctx = setup(cfg.device)
    try:
        return _train(cfg, ctx)
    finally:
        ctx.cleanup()


def _train(cfg: TrainConfig, ctx: DistributedContext) -> dict[str, Any]:
    """The phases of a run: resume state (:func:`_read_checkpoint`), data and model (:class:`_Run`),
    the loop of :meth:`_Run.train_step` with :meth:`_Run.validate` and :meth:`_Run.save_checkpoint`,
    then :meth:`_Run.finish` (test, model.pt, results.json) or :meth:`_Run.stop` (out of time)."""
    out_dir = Path(cfg.out_dir)
    if cfg.batch_size % ctx.world_size:
        raise ValueError(f"batch_size ({cfg.batch_size}) must be divisible by the number of processes "
                         f"({ctx.world_size})")
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
    _check_resume_config(state["config"], cfg, ctx.world_size, state["world_size"])
    return state


@dataclass
class _Splits:
    """The three ListOps splits of a run and the numbers reported about them."""

    train: listops.ListOpsDataset
    val: listops.ListOpsDataset
    test: listops.ListOpsDataset
    val_idx: np.ndarray
    test_idx: np.ndarray
    majority_class: int
    majority_test: float
    majority_val: float

    @classmethod
    def load(cls, cfg: TrainConfig) -> "_Splits":
        splits = listops.load_splits(cfg.data_dir)
        val = listops.ListOpsDataset(splits["val"])
        test = listops.ListOpsDataset(splits["test"])
        n_val, n_test = (len(x) if cfg.eval_samples is None else min(cfg.eval_samples, len(x)) for x in (val, test))
        majority_class, majority_test = listops.majority_baseline(splits["train"].labels,
                                                                  splits["test"].labels[:n_test])
        _, majority_val = listops.majority_baseline(splits["train"].labels, splits["val"].labels[:n_val])
        return cls(listops.ListOpsDataset(splits["train"]), val, test, np.arange(n_val), np.arange(n_test),
                   majority_class, majority_test, majority_val)

    def label_distribution(self, split: str) -> list[float]:
        return listops.label_distribution(getattr(self, split).data.labels)


class _Run:
    """One process of a training run: data, model, optimiser and sampler, and the loop state that a
    checkpoint saves (step, best validation, metric window, elapsed time, RNG)."""

    def __init__(self, cfg: TrainConfig, ctx: DistributedContext, resume_state: dict[str, Any] | None):
        self.t_start = time.perf_counter()
        self.cfg, self.ctx = cfg, ctx
        self.out_dir = Path(cfg.out_dir)
        self.ckpt_path = self.out_dir / CHECKPOINT
        self.local_batch = cfg.batch_size // ctx.world_size
        self.say = print if ctx.is_main else (lambda *a, **k: None)
        self.data = _Splits.load(cfg)
        _seed_all(cfg.seed)  # the initial weights
        self._build_model()
        if resume_state is None and cfg.init_from is not None:
            self._warm_start(cfg.init_from)
        self._build_sampler()
        _seed_all(cfg.seed + 1 + ctx.rank)  # training randomness (dropout, stochastic methods), per process
        self.step = 0
        self.best: dict[str, Any] = {"accuracy": -1.0, "step": 0}
        self.best_state: dict[str, torch.Tensor] | None = None
        self.window = dict.fromkeys(("loss", "correct", "samples", "tokens", "seconds"), 0.0)
        self.elapsed_before = 0.0
        if resume_state is not None:
            self._resume(resume_state)
        self.metrics = None
        if ctx.is_main:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self.metrics = _MetricsWriter(self.out_dir, resume_step=self.step if resume_state is not None else None,
                                          tensorboard=cfg.tensorboard)
        self._announce()
        # progress=False drops the bar, not the lines: a line every log_every steps and one per evaluation
        self.progress = _Progress(ctx.is_main, cfg.progress, cfg.steps, self.step)
        self.net.train()

    def _build_model(self) -> None:
        """Model (wrapped for DDP), optimiser and learning-rate schedule."""
        cfg, ctx = self.cfg, self.ctx
        self.model, self.attn_dropout = _build_model(cfg, ctx.device)
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
        saved, source = _read_model_file(path)
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
        lengths = self.data.train.data.lengths()
        if cfg.batching == "bucket":
            self.sampler = BucketBatchSampler(lengths, self.local_batch, world_size=ctx.world_size, rank=ctx.rank,
                                              seed=cfg.seed, pool_batches=cfg.bucket_pool, cap=cfg.pad_to)
        else:
            self.sampler = ShardedBatchSampler(len(lengths), self.local_batch, world_size=ctx.world_size,
                                               rank=ctx.rank, seed=cfg.seed)
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
        self.window = dict(state["window"])
        self.elapsed_before = float(state["elapsed_s"])
        self.say(f"resuming {self.out_dir} from step {self.step}", flush=True)

    def _announce(self) -> None:
        cfg, ctx, data = self.cfg, self.ctx, self.data
        self.say(f"listops: {len(data.train)} train / {len(data.val)} val / {len(data.test)} test; majority class "
                 f"{data.majority_class} = {100 * data.majority_test:.2f}% of test; train labels "
                 + " ".join(f"{c}:{100 * p:.1f}%" for c, p in enumerate(data.label_distribution("train"))),
                 flush=True)
        too_long = int((data.train.data.lengths() > cfg.pad_to).sum())
        if too_long:
            self.say(f"note: {too_long} training sequences are longer than pad_to={cfg.pad_to} and are truncated")
        opts = ", ".join(f"{k}={v!r}" for k, v in cfg.method_options.items())
        n_params = sum(p.numel() for p in self.model.parameters())
        self.say(f"model: method={cfg.method}" + (f" ({opts})" if opts else "")
                 + f", {cfg.layers} layers, dim {cfg.dim}, {cfg.heads} heads, ffn {cfg.ffn_dim}, "
                 f"{n_params} parameters; attention dropout {self.attn_dropout}; "
                 f"{ctx.world_size} process(es) on {ctx.device}, batch {cfg.batch_size} "
                 f"({self.local_batch} per process)", flush=True)

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
        tokens, pad, labels = self.data.train.batch(next(self.sampler), cfg.pad_to, self.multiple)
        tokens, pad, labels = tokens.to(ctx.device), pad.to(ctx.device), labels.to(ctx.device)
        with torch.autocast(ctx.device.type, dtype=torch.bfloat16, enabled=cfg.amp == "bf16"):
            logits = self.net(tokens, pad)
        loss = cross_entropy(logits, labels)
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
        w["loss"] += loss.item() * len(labels)
        w["correct"] += (logits.argmax(-1) == labels).sum().item()
        w["samples"] += len(labels)
        w["tokens"] += (~pad).sum().item()
        w["seconds"] += time.perf_counter() - t0
        rate = w["samples"] / max(w["seconds"], 1e-9)
        info = {"loss": f"{w['loss'] / max(w['samples'], 1):.4f}", "lr": f"{lr:.2e}",
                "samples/s": f"{rate * ctx.world_size:.1f}"}
        log_now = self.step % cfg.log_every == 0 or self.step == cfg.steps
        self.progress.update(self.step, info, plain=log_now)
        if log_now:
            loss_sum, correct, samples, tokens_n, seconds = ctx.all_reduce_sum(
                [w["loss"], w["correct"], w["samples"], w["tokens"], w["seconds"]])
            seconds /= ctx.world_size
            self.log_row("train", loss_sum / samples, correct / samples, int(samples), lr=lr,
                         samples_per_s=samples / max(seconds, 1e-9), tokens_per_s=tokens_n / max(seconds, 1e-9))
            self.window = dict.fromkeys(w, 0.0)

    def validate(self) -> None:
        """Validation accuracy; a new best is kept in memory and written to ``best.pt``."""
        v_loss, v_acc, v_n = _evaluate(self.model, self.data.val, self.data.val_idx, self.local_batch, self.cfg,
                                       self.ctx)
        if v_acc > self.best["accuracy"]:
            self.best = {"accuracy": v_acc, "step": self.step}
            self.best_state = {k: v.detach().clone().cpu() for k, v in self.model.state_dict().items()}
            if self.ctx.is_main:
                save_model(self.out_dir / BEST_MODEL, self.cfg, self.best_state, self.step, val_accuracy=v_acc)
        self.log_row("val", v_loss, v_acc, v_n)
        self.progress.write(f"step {self.step}: val loss {v_loss:.4f}, accuracy {100 * v_acc:.2f}% "
                            f"(best {100 * self.best['accuracy']:.2f}% at step {self.best['step']})")

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

    def test(self) -> tuple[float, float, int, float]:
        """Test loss, accuracy and count of the final model, and the accuracy of the best-validation
        model (the same model when the best validation was the last one)."""
        cfg, ctx, data = self.cfg, self.ctx, self.data
        test_idx = data.test_idx
        t_loss, t_acc, t_n = _evaluate(self.model, data.test, test_idx, self.local_batch, cfg, ctx)
        self.log_row("test", t_loss, t_acc, t_n)
        if self.best_state is None or self.best["step"] == self.step:
            return t_loss, t_acc, t_n, t_acc
        final_state = copy.deepcopy(self.model.state_dict())
        self.model.load_state_dict(self.best_state)
        b_loss, b_acc, _ = _evaluate(self.model, data.test, test_idx, self.local_batch, cfg, ctx)
        self.model.load_state_dict(final_state)
        self.log_row("test_best_val", b_loss, b_acc, t_n)
        return t_loss, t_acc, t_n, b_acc

    def stop(self) -> dict[str, Any]:
        """Out of time before the last step: the checkpoint is written; say how to continue."""
        self.say(f"stopped at step {self.step} of {self.cfg.steps} after {self.cfg.max_minutes} minutes; the "
                 f"checkpoint is in {self.ckpt_path}: run again with resume (--resume) to continue", flush=True)
        return {"stopped": True, "step": self.step, "steps": self.cfg.steps, "checkpoint": str(self.ckpt_path)}

    def finish(self) -> dict[str, Any]:
        """Test, then ``model.pt`` and ``results.json``; the resume checkpoint is removed."""
        self.progress.close()
        train_seconds = self.elapsed()
        t_loss, t_acc, t_n, best_test = self.test()
        results = self._results(t_loss, t_acc, t_n, best_test, train_seconds)
        if self.ctx.is_main:
            save_model(self.out_dir / FINAL_MODEL, self.cfg, self.model.state_dict(), self.step)
            _atomic_json(self.out_dir / RESULTS, results)
            self.ckpt_path.unlink()  # the run is complete: model.pt, best.pt and results.json remain
            self.say(f"test accuracy {100 * t_acc:.2f}% (final model), {100 * best_test:.2f}% (best validation "
                     f"model, step {self.best['step']}); majority baseline {100 * self.data.majority_test:.2f}%; "
                     f"{self.step} steps in {train_seconds:.0f} s (+ {results['wall_seconds'] - train_seconds:.0f} "
                     "s of testing)", flush=True)
        self.ctx.barrier()
        return results

    def _results(self, t_loss: float, t_acc: float, t_n: int, best_test: float, train_seconds: float) -> dict:
        cfg, data = self.cfg, self.data
        return {
            "task": "listops", "method": cfg.method, "method_options": cfg.method_options, "preset": cfg.preset,
            "steps": self.step, "test_accuracy": t_acc, "test_loss": t_loss, "test_accuracy_best_val": best_test,
            "best_val_accuracy": self.best["accuracy"], "best_val_step": self.best["step"],
            "val_samples": int(len(data.val_idx)), "test_samples": t_n, "majority_class": data.majority_class,
            "majority_test_accuracy": data.majority_test, "majority_val_accuracy": data.majority_val,
            "train_label_distribution": data.label_distribution("train"),
            "test_label_distribution": data.label_distribution("test"),
            "parameters": sum(p.numel() for p in self.model.parameters()),
            "attention_dropout_applied": self.attn_dropout, "train_seconds": round(train_seconds, 1),
            "wall_seconds": round(self.elapsed(), 1), "world_size": self.ctx.world_size,
            "device": str(self.ctx.device), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "config": cfg.to_dict(), "command": shlex.join(sys.argv),
        }

    def close(self) -> None:
        self.progress.close()
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
