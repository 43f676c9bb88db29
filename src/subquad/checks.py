"""Input and option checks, at the bottom of the package (they import nothing from it).

Each raises ``TypeError``/``ValueError`` naming the method, the argument or option, the value given
and what is allowed. Conventions: tensors are ``(B, H, N, D)``; ``key_padding_mask`` is a bool
``(B, M)`` tensor in which **True marks padding**.
"""

from __future__ import annotations

import math
import os
import sys
from typing import Any

import torch
from torch import Tensor

__all__ = ["check_qkv", "check_scale", "check_int", "check_float", "check_choice", "check_bool", "user_stacklevel"]

_INTERNAL = tuple(os.path.dirname(os.path.abspath(f)) + os.sep for f in (torch.__file__, __file__))


def user_stacklevel() -> int:
    """The ``stacklevel`` for a warning raised by the caller of this function that points at the
    first frame outside torch and subquad (the user's line, not ``Module.__call__``)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame, level = frame.f_back, level + 1
    return level


def check_qkv(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_padding_mask: Tensor | None,
    *,
    name: str,
    cross_attention: bool = True,
) -> None:
    """Validate shapes, dtypes and devices; raise ``TypeError``/``ValueError`` naming the
    argument, what was given and what is allowed."""
    for arg, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name}: {arg} must be a torch.Tensor, got {type(t).__name__}")
        if t.ndim != 4:
            raise ValueError(
                f"{name}: {arg} must have 4 dimensions (B, H, L, D), got shape {tuple(t.shape)}"
            )
        if not t.is_floating_point():
            raise TypeError(f"{name}: {arg} must be a floating-point tensor, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{name}: q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"{name}: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}"
        )
    B, H, N, D = q.shape
    if k.shape[0] != B or v.shape[0] != B:
        raise ValueError(
            f"{name}: batch sizes differ: q {B}, k {k.shape[0]}, v {v.shape[0]}"
        )
    if k.shape[1] != H or v.shape[1] != H:
        raise ValueError(f"{name}: head counts differ: q {H}, k {k.shape[1]}, v {v.shape[1]}")
    if k.shape[3] != D:
        raise ValueError(f"{name}: q and k must share the head dim, got {D} and {k.shape[3]}")
    M = k.shape[2]
    if v.shape[2] != M:
        raise ValueError(f"{name}: k and v must have the same length, got {M} and {v.shape[2]}")
    if N == 0 or M == 0:
        raise ValueError(f"{name}: sequence lengths must be at least 1, got N={N}, M={M}")
    if D == 0 or v.shape[3] == 0:
        raise ValueError(
            f"{name}: head dims must be at least 1, got D={D} (q, k) and Dv={v.shape[3]} (v)"
        )
    if not cross_attention and N != M:
        raise ValueError(
            f"{name}: supports self-attention only (query and key lengths equal), got N={N}, M={M}"
        )
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, Tensor):
            raise TypeError(
                f"{name}: key_padding_mask must be a bool tensor, got {type(key_padding_mask).__name__}"
            )
        if key_padding_mask.dtype != torch.bool:
            raise TypeError(
                f"{name}: key_padding_mask must have dtype torch.bool (True = padding), "
                f"got {key_padding_mask.dtype}"
            )
        if tuple(key_padding_mask.shape) != (B, M):
            raise ValueError(
                f"{name}: key_padding_mask must have shape (B, M) = {(B, M)}, "
                f"got {tuple(key_padding_mask.shape)}"
            )
        if key_padding_mask.device != q.device:
            raise ValueError(
                f"{name}: key_padding_mask is on {key_padding_mask.device}, q on {q.device}"
            )


def check_scale(name: str, scale: Any) -> float:
    """``scale`` as a float; ValueError unless it is a positive, finite real number. (Finite as
    ``scale - scale == 0``, not ``math.isfinite``: torch.compile turns a scale that changes
    between calls into a symbolic float, which it can compare but not pass to ``math``.)"""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (scale > 0 and scale - scale == 0):
        raise ValueError(f"{name}: scale must be a positive finite number, got {scale!r}")
    return scale if isinstance(scale, float) else float(scale)


def check_int(method: str, name: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{method}: {name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{method}: {name} must be >= {minimum}, got {value}")


def check_float(method: str, name: str, value: Any, *, minimum: float, inclusive: bool = True) -> None:
    """A finite real number >= ``minimum`` (> when not ``inclusive``): inf and nan are refused,
    as no option of the library has a meaning there."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{method}: {name} must be a number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{method}: {name} must be a finite number, got {value}")
    ok = value >= minimum if inclusive else value > minimum
    if not ok:
        sign = ">=" if inclusive else ">"
        raise ValueError(f"{method}: {name} must be {sign} {minimum}, got {value}")


def check_share(method: str, name: str, value: Any) -> None:
    """A share in (0, 1], such as a top-p."""
    check_float(method, name, value, minimum=0.0, inclusive=False)
    if value > 1:
        raise ValueError(f"{method}: {name} must be at most 1, got {value}")


def check_choice(method: str, name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{method}: {name} must be one of {list(choices)}, got {value!r}")


def check_bool(method: str, name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{method}: {name} must be a bool, got {type(value).__name__} {value!r}")
