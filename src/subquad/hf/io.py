"""Save and restore a retrofit: only what it added, plus the method and its options.

The file (``torch.save``; read back with ``torch.load(weights_only=True)``) holds
``{"format", "method", "options", "model_class", "layers": {attention module name: state
dict of its RetrofitAttention}, "meta"}``. It never holds pretrained weights, so it is small,
and :func:`load_retrofit` on a freshly loaded pretrained model rebuilds the retrofitted model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from .retrofit import attention_modules, retrofit, retrofit_layers

__all__ = ["save_retrofit", "load_retrofit", "FORMAT"]

FORMAT = "subquad-retrofit/1"
# parameter names of files written before hedgehog was a registered method (its feature map was a
# child module then; its tensors are now options of the op, kept under those names)
_RENAMED = {"feature_map.weight": "weight", "feature_map.bias": "bias"}


def save_retrofit(model: nn.Module, path: str | Path, *, meta: dict[str, Any] | None = None) -> Path:
    """Write the retrofit of ``model`` to ``path``; ``meta``: JSON-like notes (texts, steps, scores)."""
    info = getattr(model, "_subquad_retrofit", None)
    layers = retrofit_layers(model)
    if info is None or not layers:
        raise ValueError("save_retrofit needs a model retrofitted with subquad.hf.retrofit")
    adapter = any(r.adapter for _, r in layers)
    options = {**info["options"], **({"adapter": True} if adapter else {})}
    state = {
        "format": FORMAT,
        "method": info["method"],
        "options": options,
        "model_class": type(model).__name__,
        "layers": {name: {k: v.detach().cpu().clone() for k, v in r.state_dict().items()} for name, r in layers},
        "meta": dict(meta or {}),
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)
    return path


def read_retrofit(path: str | Path) -> dict[str, Any]:
    """The stored dict (weights_only load); ValueError if it is not a subquad retrofit."""
    state = torch.load(Path(path), weights_only=True, map_location="cpu")
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"{path} is not a subquad retrofit file (format {FORMAT!r})")
    return state


def load_retrofit(model: nn.Module, path: str | Path) -> nn.Module:
    """Retrofit ``model`` (freshly loaded, pretrained) as stored in ``path`` and load the added
    parameters; the attention module names must match the saved ones."""
    state = read_retrofit(path)
    names = [n for n, _ in attention_modules(model)]
    if sorted(names) != sorted(state["layers"]):
        raise ValueError(f"{path} was saved from a model with attention modules {sorted(state['layers'])[:3]}..., "
                         f"this model has {sorted(names)[:3]}...")
    retrofit(model, state["method"], **state["options"])
    for name, r in retrofit_layers(model):
        r.load_state_dict({_RENAMED.get(k, k): v for k, v in state["layers"][name].items()}, strict=True)
    return model
