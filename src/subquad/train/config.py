"""A training run's configuration: :class:`TrainConfig`, its presets and checks, and the rules
derived from it (padding multiple, warm-up, learning-rate schedule, what a resumed run must share)."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any

from ..checks import check_choice, check_float, check_int
from ..distributed import supported_methods
from ..models.encoder import NO_MIXING, check_method
from ..tasks import make_task

__all__ = ["TrainConfig", "PRESETS", "SCHEDULES", "BATCHINGS", "TRAJECTORY_FIELDS", "LEGACY_FIELDS", "pad_multiple",
           "warmup_for", "lr_factor", "check_resume"]

BATCHINGS = ("bucket", "pad")
# With batching="bucket", a batch is padded to its longest sample rounded up to a multiple of this
# (and of sinkhorn's block size, which the op would otherwise pad to internally).
PAD_MULTIPLE = 64

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
    # MQAR (Zoology, Arora et al. 2023): their 2-layer, 1-head models, with a width-3 short convolution
    # before each mixer (without it, the model here stayed on the 1/P plateau for 1500 steps at 64
    # tokens and 4 pairs; with it, 97.7 % at step 300; at 256 tokens 2 heads stayed at 1/P for 600
    # steps where 1 head reached 55 %) and a linear head over the vocabulary at every position; AdamW
    # with a short warm-up and linear decay; sized for minutes on a CPU.
    "mqar": dict(task="mqar", layers=2, dim=64, heads=1, ffn_dim=128, positions="learned", dropout=0.0,
                 attention_dropout=0.0, head_hidden=0, pooling="none", conv_kernel_size=3, batch_size=64, lr=1e-3,
                 warmup_steps=100,
                 schedule="linear", steps=2000, weight_decay=0.1, betas=(0.9, 0.98), eps=1e-8, pad_to=1024,
                 eval_every=250),
    # Digit scenes (semantic segmentation, subquad.tasks.digit_scenes) with the segmenter
    # (subquad.models.segmenter): HamNet's layout scaled down (Geng et al. 2021), one context block of
    # width 64 at 1/4 resolution (16 x 16 positions for 64 x 64 images), one head (Hamburger's ham:
    # one group, rank 8); AdamW with a short warm-up and linear decay. Sized for under 45 minutes of
    # one CPU thread (each run's train_seconds: runs/digit_scenes/*/*/*/results.json). ffn_dim, positions,
    # head_hidden and conv_kernel_size are the encoder's and unused here.
    "digit_scenes": dict(task="digit_scenes", layers=1, dim=64, heads=1, ffn_dim=128, positions="learned",
                         dropout=0.0, attention_dropout=0.0, head_hidden=0, pooling="none", conv_kernel_size=0,
                         batch_size=32, lr=2e-3, warmup_steps=200, schedule="linear", steps=6000, weight_decay=1e-4,
                         betas=(0.9, 0.999), eps=1e-8, pad_to=4096, eval_every=500),
}
SCHEDULES = ("linear", "rsqrt", "constant")

# Fields that determine the training trajectory: a resumed run must agree on all of them.
TRAJECTORY_FIELDS = ("task", "task_options", "method", "method_options", "layers", "dim", "heads", "ffn_dim",
                     "positions", "pooling", "conv_kernel_size",
                     "dropout", "attention_dropout", "head_hidden", "batch_size", "lr", "warmup_steps",
                     "schedule", "steps", "weight_decay", "betas", "eps", "grad_clip", "pad_to", "seed",
                     "amp", "dtype", "batching", "bucket_pool", "context_parallel")
# Values of trajectory fields that checkpoints written before the field existed were run with.
LEGACY_FIELDS = {"batching": "pad", "bucket_pool": 64, "pooling": "mean", "task_options": {}, "conv_kernel_size": 0,
                 "context_parallel": 1}


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

    ``task`` and ``task_options``: a registered task (:func:`subquad.tasks.list_tasks`) and its options
    (MQAR's ``seq_len``, ``num_pairs``, ...); ``pooling="none"`` for a task with labels per position.

    ``init_from``: a model file of an earlier run (``best.pt``, ``model.pt`` or ``checkpoint.pt``)
    whose weights replace the initial ones (a warm start, e.g. from a run on shorter inputs; its
    model must have exactly this run's parameter names and shapes). Optimiser, schedule and data
    order start afresh. Used only when the run starts: a resumed run continues from its own
    checkpoint.

    ``context_parallel``: under ``torchrun``, how many processes split each sequence between
    them (:func:`subquad.distributed.context_parallel`; an encoder task with labels per position,
    and a method of :func:`subquad.distributed.supported_methods`); the other factor of the
    process count is data parallelism, over which ``batch_size`` is split.
    """

    method: str = "softmax"
    method_options: dict[str, Any] = field(default_factory=dict)
    task: str = "listops"
    task_options: dict[str, Any] = field(default_factory=dict)
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
    conv_kernel_size: int = 0
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
    context_parallel: int = 1

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
        """ValueError/TypeError naming the first bad field (the checks of :mod:`subquad.checks`)."""
        if not isinstance(self.task_options, dict):
            raise TypeError(f"task_options must be a dict, got {type(self.task_options).__name__}")
        task = make_task(self.task, self.task_options)  # unknown task or option: ValueError naming the known
        check_method(self.method)  # unknown method: ValueError listing the known ones ("none" is no mixing)
        if not isinstance(self.method_options, dict):
            raise TypeError(f"method_options must be a dict, got {type(self.method_options).__name__}")
        for name in ("layers", "dim", "heads", "ffn_dim", "batch_size", "steps", "pad_to", "eval_every",
                     "checkpoint_every", "log_every", "bucket_pool", "context_parallel"):
            check_int("train", name, getattr(self, name), minimum=1)
        for name in ("warmup_steps", "seed", "head_hidden", "conv_kernel_size"):
            check_int("train", name, getattr(self, name), minimum=0)
        for name in ("eval_samples", "threads"):
            if getattr(self, name) is not None:
                check_int("train", name, getattr(self, name), minimum=1)
        for name in ("max_minutes", "grad_clip"):
            if getattr(self, name) is not None:
                check_float("train", name, getattr(self, name), minimum=0.0, inclusive=False)
        if self.init_from is not None and not isinstance(self.init_from, (str, os.PathLike)):
            raise TypeError(f"init_from must be a path or None, got {type(self.init_from).__name__}")
        check_float("train", "lr", self.lr, minimum=0.0, inclusive=False)
        check_float("train", "eps", self.eps, minimum=0.0, inclusive=False)
        check_float("train", "weight_decay", self.weight_decay, minimum=0.0)
        if len(self.betas) != 2:
            raise ValueError(f"train: betas must be two numbers in [0, 1), got {self.betas!r}")
        fractions = [("dropout", self.dropout), ("attention_dropout", self.attention_dropout),
                     ("betas[0]", self.betas[0]), ("betas[1]", self.betas[1])]
        for name, value in fractions:
            check_float("train", name, value, minimum=0.0)
            if value >= 1:
                raise ValueError(f"train: {name} must be < 1, got {value}")
        check_choice("train", "batching", self.batching, BATCHINGS)
        check_choice("train", "schedule", self.schedule, SCHEDULES)
        check_choice("train", "amp", self.amp, ("none", "bf16"))
        check_choice("train", "dtype", self.dtype, ("float32", "float64"))
        if self.amp != "none" and self.dtype != "float32":
            raise ValueError("train: amp needs dtype='float32'")
        if self.dim % self.heads:
            raise ValueError(f"train: dim ({self.dim}) must be divisible by heads ({self.heads})")
        self._check_task(task)

    def _check_task(self, task) -> None:
        """The model's pooling fits the task's labels, and its samples fit ``pad_to``."""
        if task.per_token != (self.pooling == "none"):
            want = "'none'" if task.per_token else "'mean' or 'cls'"
            raise ValueError(f"task {self.task!r} has labels per {'position' if task.per_token else 'sequence'}: "
                             f"pooling must be {want}, got {self.pooling!r}")
        if self.context_parallel > 1:
            if task.model != "encoder" or not task.per_token:
                raise ValueError(f"context parallelism splits token sequences with labels per position; task "
                                 f"{self.task!r} has {'images' if task.model != 'encoder' else 'labels per sequence'}")
            if self.method not in (*supported_methods(), NO_MIXING):
                raise ValueError(f"method {self.method!r} has no context-parallel form; supported: "
                                 f"{supported_methods()}")
        if task.max_length is not None and task.max_length > self.pad_to:
            raise ValueError(f"task {self.task!r} has samples of {task.max_length} tokens, longer than pad_to="
                             f"{self.pad_to}")


def pad_multiple(cfg: TrainConfig) -> int | None:
    """What a batch's length is rounded up to: None (pad to ``pad_to``) with ``batching="pad"``,
    else :data:`PAD_MULTIPLE`, or its least common multiple with the method's ``length_multiple``
    for its options (Sinkhorn's ``block_size``)."""
    if cfg.batching == "pad":
        return None
    info = check_method(cfg.method)
    if info is None or info.length_multiple is None:
        return PAD_MULTIPLE
    options = {k: v for k, v in cfg.method_options.items() if k in info.option_names}  # not module-only options
    return math.lcm(PAD_MULTIPLE, int(info.length_multiple(info.make_options(**options))))


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


def check_resume(saved: dict[str, Any], cfg: TrainConfig, world_size: int, saved_world: int) -> None:
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
