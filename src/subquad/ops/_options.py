"""Small validators for options dataclasses: each raises ValueError/TypeError that names the
method, the option, the value given and what is allowed."""

from __future__ import annotations

import math
from typing import Any


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


def check_choice(method: str, name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{method}: {name} must be one of {list(choices)}, got {value!r}")


def check_bool(method: str, name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{method}: {name} must be a bool, got {type(value).__name__} {value!r}")
