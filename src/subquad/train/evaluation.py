"""A saved model evaluated on a split of its task, as ``subquad evaluate`` and ``subquad train report
--evaluate`` run it: the model file's config, its task options (or some of them changed, such as
MQAR's ``num_pairs``) and the run's input pipeline.

:func:`evaluate_checkpoint` evaluates one model file; :func:`sweep_checkpoint` the same model at
each value of one task option (MQAR's recall at 16, 32 and 64 pairs of a model trained on a
mixture of them), ``{value: scores}`` as ``subquad evaluate --sweep`` writes it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["check_data", "evaluate_checkpoint", "sweep_checkpoint", "parse_sweep"]


def check_data(task, data_dir: str | os.PathLike) -> None:
    """A task that reads files needs its data directory (FileNotFoundError naming the command that
    writes it)."""
    hint = task.data_hint(str(data_dir))
    if hint and not Path(data_dir).is_dir():
        raise FileNotFoundError(f"data directory {str(data_dir)!r} does not exist; create it with {hint}")


def evaluate_checkpoint(checkpoint: str | os.PathLike, *, data_dir: str | os.PathLike | None = None,
                        split: str = "test", task_options: dict[str, Any] | None = None, task: str | None = None,
                        device: str = "cpu", progress: bool = False,
                        cache: dict | None = None) -> dict[str, Any]:
    """The scores of a model file on ``split`` (``loss``, ``accuracy``, ``n`` and the task's own,
    such as ``miou``), with ``method``, ``method_options``, ``step``, ``split``, ``checkpoint`` and
    the ``task_options`` it was evaluated with (the saved ones, updated by ``task_options``).
    ``task``: the task the file must be of (ValueError otherwise); ``data_dir``: default
    ``out/data/TASK``; ``cache``: a dict kept between calls, so the data of a task with the same
    options is read once."""
    from ..tasks import make_task
    from .model_file import load_model
    from .trainer import evaluate_scores

    if split not in ("val", "test"):
        raise ValueError(f"split must be 'val' or 'test', got {split!r}")
    model, cfg, saved = load_model(checkpoint, device=device)
    if task is not None and cfg.task != task:
        raise ValueError(f"{str(checkpoint)!r} is a model of task {cfg.task!r}; use `evaluate {cfg.task}`")
    options = {**cfg.task_options, **(task_options or {})}
    made = make_task(cfg.task, options)
    data_dir = str(data_dir or f"out/data/{cfg.task}")
    key = (cfg.task, json.dumps(options, sort_keys=True, default=str), data_dir)
    cache = {} if cache is None else cache
    if key not in cache:
        check_data(made, data_dir)
        cache[key] = made.load(data_dir, None)
    scores = evaluate_scores(model, cfg, getattr(cache[key], split), progress=progress)
    return {**scores, "method": cfg.method, "method_options": cfg.method_options,
            "step": int(saved.get("step", -1)), "split": split, "checkpoint": str(checkpoint),
            "task_options": options}


def parse_sweep(spec: str) -> tuple[str, list[Any]]:
    """``"num_pairs=16,32,64"`` -> ``("num_pairs", [16, 32, 64])`` (values as ``-t`` reads them)."""
    from ..cli_base import parse_value

    name, sep, values = spec.partition("=")
    if not sep or not name.strip() or not values.strip():
        raise ValueError(f"--sweep {spec!r} is not NAME=V1,V2,...")
    return name.strip(), [parse_value(v) for v in values.split(",")]


def sweep_checkpoint(checkpoint: str | os.PathLike, option: str, values: list[Any], *,
                     task_options: dict[str, Any] | None = None, **kwargs: Any) -> dict[str, dict[str, Any]]:
    """``{str(value): scores}``: :func:`evaluate_checkpoint` with task option ``option`` set to each
    of ``values`` (on top of ``task_options``); each entry holds ``loss``, ``accuracy``, ``n`` and
    the task's scores."""
    out = {}
    cache = kwargs.pop("cache", None)
    cache = {} if cache is None else cache
    for value in values:
        scores = evaluate_checkpoint(checkpoint, task_options={**(task_options or {}), option: value},
                                     cache=cache, **kwargs)
        out[str(value)] = {k: v for k, v in scores.items()
                           if k not in ("method", "method_options", "step", "split", "checkpoint", "task_options")}
    return out
