"""Tasks for training encoders: data generators, files and datasets (LRA ListOps)."""

from . import listops
from .listops import ListOpsDataset, ListOpsSplit, generate_splits, load_splits

__all__ = ["listops", "ListOpsDataset", "ListOpsSplit", "generate_splits", "load_splits"]
