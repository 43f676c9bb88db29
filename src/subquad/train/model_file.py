"""The model of a run: built from its config and task, and saved / loaded as a model file
(weights, the run's config and the step). The task names the model family (``Task.model``):
:data:`MODEL_FAMILIES` builds it."""

from __future__ import annotations

import dataclasses
import os
import pickle
from pathlib import Path
from typing import Any

import torch

from ..models.encoder import Encoder, supports_attention_dropout
from ..models.segmenter import Segmenter
from ..tasks import get_task, make_task
from . import checkpoint as ckpt
from .config import LEGACY_FIELDS, TrainConfig

__all__ = ["FINAL_MODEL", "BEST_MODEL", "MODEL_FAMILIES", "model_kind", "build_model", "save_model", "load_model",
           "read_model_file"]

FINAL_MODEL = "model.pt"
BEST_MODEL = "best.pt"


def model_kind(task: str) -> str:
    """The ``kind`` a model file of ``task`` records: the task and its model family
    (``subquad.listops.encoder`` for ListOps, ``subquad.digit_scenes.segmenter``)."""
    return f"subquad.{task}.{get_task(task).model}"


def build_model(cfg: TrainConfig, device: torch.device | str = "cpu") -> tuple[torch.nn.Module, float]:
    """The model of ``cfg`` for its task, of the family the task names (:data:`MODEL_FAMILIES`), and
    the attention dropout it applies (0 for a method without attention weights)."""
    task = make_task(cfg.task, cfg.task_options)
    attn_dropout = cfg.attention_dropout if supports_attention_dropout(cfg.method) else 0.0
    dtype = torch.float64 if cfg.dtype == "float64" else torch.float32
    return MODEL_FAMILIES[task.model](cfg, task, attn_dropout, device, dtype), attn_dropout


def _encoder(cfg: TrainConfig, task, attn_dropout: float, device, dtype) -> Encoder:
    """Token sequences: vocabulary, classes, a head per position or pooled."""
    return Encoder(task.vocab_size, task.num_classes, method=cfg.method,
                   method_options=cfg.method_options, dim=cfg.dim, depth=cfg.layers, heads=cfg.heads,
                   ffn_dim=cfg.ffn_dim, max_len=cfg.pad_to,
                   positions=cfg.positions, dropout=cfg.dropout, attention_dropout=attn_dropout,
                   head_hidden=cfg.head_hidden, pooling=cfg.pooling, conv_kernel_size=cfg.conv_kernel_size,
                   device=device, dtype=dtype)


def _segmenter(cfg: TrainConfig, task, attn_dropout: float, device, dtype) -> Segmenter:
    """Images labelled per pixel: ``task.in_channels`` channels in, ``cfg.layers`` context blocks
    of width ``cfg.dim`` (the encoder's ``ffn_dim``, ``positions``, ``head_hidden`` and
    ``conv_kernel_size`` do not apply)."""
    return Segmenter(task.in_channels, task.num_classes, method=cfg.method, method_options=cfg.method_options,
                     dim=cfg.dim, depth=cfg.layers, heads=cfg.heads, dropout=cfg.dropout,
                     attention_dropout=attn_dropout, device=device, dtype=dtype)


#: ``Task.model`` -> ``builder(cfg, task, attention_dropout, device, dtype) -> nn.Module``: the model's
#: ``forward(inputs, key_padding_mask, select=None)`` takes a batch as the task's datasets give it
MODEL_FAMILIES = {"encoder": _encoder, "segmenter": _segmenter}


def save_model(path: Path, cfg: TrainConfig, state: dict[str, torch.Tensor], step: int, **extra: Any) -> None:
    """A model file: weights, the run's config and the step; all :func:`load_model` needs."""
    ckpt.save_atomic({"kind": model_kind(cfg.task), "format": 1, "config": cfg.to_dict(), "step": step,
                      "model": {k: v.detach().cpu() for k, v in state.items()}, **extra}, path)


def load_model(path: str | os.PathLike, device: str | torch.device = "cpu"
               ) -> tuple[torch.nn.Module, TrainConfig, dict]:
    """Rebuild the model saved by a run (``model.pt``, ``best.pt`` or ``checkpoint.pt``) in eval
    mode; returns ``(model, config, file contents)``. A file that is not a model file of this
    trainer raises ValueError."""
    saved, cfg = read_model_file(path)
    model, _ = build_model(cfg, torch.device(device))
    model.load_state_dict(saved["model"])
    model.eval()
    return model, cfg, saved


def read_model_file(path: str | os.PathLike) -> tuple[dict, TrainConfig]:
    """The contents of a run's model file and the config it was written with (ValueError for a file
    that is not one, or of a task this version does not know)."""
    try:
        saved = ckpt.load(path, map_location="cpu")
    except (RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError) as e:
        if isinstance(e, FileNotFoundError):
            raise
        raise ValueError(f"{str(path)!r} is not a readable checkpoint ({str(e).splitlines()[0]})") from None
    if not isinstance(saved, dict) or not isinstance(saved.get("config"), dict) or "model" not in saved:
        raise ValueError(f"{str(path)!r} is not a subquad model file (no config and model)")
    values = {**LEGACY_FIELDS, **saved["config"]}
    values.setdefault("task", "listops")
    try:
        make_task(values["task"], values["task_options"])
    except (ValueError, TypeError) as e:
        raise ValueError(f"{str(path)!r} is a model file of a task this version cannot build: {e}") from None
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    values = {k: v for k, v in values.items() if k in known}
    values["betas"] = tuple(values.get("betas", (0.9, 0.999)))
    return saved, TrainConfig(**values)
