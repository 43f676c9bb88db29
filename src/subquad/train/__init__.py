"""Training on a task (:mod:`subquad.tasks`): the configuration, the loop (single process or
torch.distributed), model files, metrics, checkpoints, the batch samplers and the CLI.

The names below load on first use (PEP 562): ``subquad train --help`` reads this package's command
line without importing the trainer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_module

#: public name -> the submodule that defines it
_LAZY = {"PRESETS": "config", "TrainConfig": "config", "lr_factor": "config", "build_model": "model_file",
         "load_model": "model_file", "save_model": "model_file", "evaluate_model": "trainer", "train": "trainer",
         "evaluate_checkpoint": "evaluation"}

__all__ = ["TrainConfig", "PRESETS", "train", "lr_factor", "build_model", "load_model", "save_model",
           "evaluate_model", "evaluate_checkpoint"]

__getattr__, __dir__ = lazy_module(__name__, _LAZY, __all__)

if TYPE_CHECKING:  # what static tools see; at run time __getattr__ imports these
    from .config import PRESETS, TrainConfig, lr_factor  # noqa: F401
    from .evaluation import evaluate_checkpoint  # noqa: F401
    from .model_file import build_model, load_model, save_model  # noqa: F401
    from .trainer import evaluate_model, train  # noqa: F401
