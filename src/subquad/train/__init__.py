"""Training on a task (:mod:`subquad.tasks`): the configuration, the loop (single process or
torch.distributed), model files, metrics, checkpoints, the batch samplers and the CLI."""

from .config import PRESETS, TrainConfig, lr_factor
from .model_file import build_model, load_model, save_model
from .trainer import evaluate_model, train

__all__ = ["TrainConfig", "PRESETS", "train", "lr_factor", "build_model", "load_model", "save_model",
           "evaluate_model"]
