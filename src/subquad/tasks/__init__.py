"""Tasks the trainer runs (:mod:`subquad.tasks.base` says what a task provides): LRA ListOps,
multi-query associative recall (MQAR) and digit scenes (semantic segmentation of real MNIST digits)."""

from . import digit_scenes, listops, mqar
from .base import IGNORE, Task, TaskData, get_task, list_tasks, make_task, register_task
from .digit_scenes import DigitScenes
from .listops import ListOps, ListOpsDataset, ListOpsSplit, generate_splits, load_splits
from .mqar import MQAR

__all__ = ["digit_scenes", "listops", "mqar", "IGNORE", "Task", "TaskData", "get_task", "list_tasks", "make_task",
           "register_task", "DigitScenes", "ListOps", "MQAR", "ListOpsDataset", "ListOpsSplit", "generate_splits",
           "load_splits"]
