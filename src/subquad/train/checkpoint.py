"""Checkpoints that lose nothing, written atomically and read without running code.

:func:`save_atomic` writes to a temporary file in the same directory, flushes it to disk, then
``os.replace``-s it over the target, so a crash at any moment leaves either the old or the new
checkpoint, never a torn one. :func:`load` uses ``torch.load(..., weights_only=True)``: only
tensors and plain containers of numbers and strings can come back. RNG states (torch, CUDA,
numpy, Python) are converted to such values by :func:`rng_state` and restored by
:func:`set_rng_state`.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["save_atomic", "load", "rng_state", "set_rng_state"]


def save_atomic(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save(obj, path)`` through a temporary file and ``os.replace``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    try:  # make the rename itself durable
        fd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def load(path: str | os.PathLike, map_location: Any = "cpu") -> Any:
    """Read a checkpoint with ``weights_only=True`` (no pickled code can run)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {str(path)!r}")
    return torch.load(path, map_location=map_location, weights_only=True)


def rng_state() -> dict[str, Any]:
    """The global RNG states of torch (CPU and every CUDA device), numpy and Python, as
    tensors and plain values."""
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    version, py_state, py_gauss = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {"kind": str(np_kind), "keys": torch.from_numpy(np_keys.astype(np.int64)),
                  "pos": int(np_pos), "has_gauss": int(np_has_gauss), "gauss": float(np_gauss)},
        "python": {"version": int(version), "state": list(py_state), "gauss": py_gauss},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` captured."""
    torch.set_rng_state(state["torch"].cpu())
    n = state["numpy"]
    keys = n["keys"].numpy().astype(np.uint32)
    np.random.set_state((n["kind"], keys, n["pos"], n["has_gauss"], n["gauss"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])
