"""Training: the trainer (single process or torch.distributed), checkpoints, sampler, CLI."""

from .trainer import PRESETS, TrainConfig, lr_factor, train

__all__ = ["TrainConfig", "PRESETS", "train", "lr_factor"]
