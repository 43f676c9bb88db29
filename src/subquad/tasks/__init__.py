"""Tasks the trainer runs (:mod:`subquad.tasks.base` says what a task provides): LRA ListOps and
multi-query associative recall (MQAR)."""

from . import listops, mqar
from .base import IGNORE, Task, TaskData, get_task, list_tasks, make_task, register_task
from .listops import ListOps, ListOpsDataset, ListOpsSplit, generate_splits, load_splits
from .mqar import MQAR

__all__ = ["listops", "mqar", "IGNORE", "Task", "TaskData", "get_task", "list_tasks", "make_task", "register_task",
           "ListOps", "MQAR", "ListOpsDataset", "ListOpsSplit", "generate_splits", "load_splits"]
