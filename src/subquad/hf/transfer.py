"""Attention transfer: train only what the retrofit added, layer by layer, to match exact attention.

The teacher is the same model with exact attention. One pass over the training texts with every
retrofitted layer in ``"record"`` mode caches, per layer and text, the q/k/v that reach attention
and the exact attention output; the student (the method, with its parameters) is then trained on
those cached inputs to reproduce the cached outputs, each layer independently (teacher forcing,
as in LoLCATs: Zhang et al. 2024, "LoLCATs: On Low-Rank Linearizing of Large Language Models",
Section 3.1 "attention transfer"). No transformer block runs during training, so it is fast on a
CPU. The loss of a layer is ``|student - teacher|^2 / |teacher|^2`` summed over its outputs.

What is trained: Hedgehog's feature maps (Zhang et al. 2024, "The Hedgehog & the Porcupine",
Section 4.1) for ``method="hedgehog"``; for a registry method the per-head q/k adapters of
:class:`~subquad.hf.retrofit.RetrofitAttention`, switched on here if the retrofit had none.
Pretrained weights never receive a gradient.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .retrofit import RetrofitAttention, retrofit_layers, set_mode

__all__ = ["transfer", "cache_teacher", "layer_losses", "trainable_parameters"]


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters the retrofit added (feature maps, adapters, ...), in layer order."""
    return [p for _, r in retrofit_layers(model) for p in r.parameters()]


def _enable_adapter(r: RetrofitAttention) -> None:
    ref = next(iter(r.buffers()), None)
    eye = torch.eye(r.head_dim, device=None if ref is None else ref.device)
    eye = eye.expand(r.heads, r.head_dim, r.head_dim).clone()
    r.adapter = True
    r.q_adapter = nn.Parameter(eye.clone())
    r.k_adapter = nn.Parameter(eye)


def cache_teacher(model: nn.Module, texts: list[str], tokenizer, *, max_length: int = 512,
                  progress: bool = True) -> list[list[dict[str, Any]]]:
    """Run the model with exact attention on each text (one at a time, no padding) and return,
    per retrofitted layer, a list of ``{"q", "k", "v", "out", "mask", "causal", "scale"}`` with
    ``(1, H, N, D)`` tensors, one per text."""
    layers = retrofit_layers(model)
    was_training = model.training
    model.eval()
    set_mode(model, "record")
    for _, r in layers:
        r.records = []
    try:
        bar = _bar(len(texts), "teacher cache", progress)
        with torch.no_grad():
            for text in texts:
                enc = tokenizer(text, return_tensors="pt", truncation=True, max_length=max_length)
                enc = {k: v.to(_device(model)) for k, v in enc.items()}
                model(**enc)
                bar.update(1)
        bar.close()
        return [r.records for _, r in layers]
    finally:
        set_mode(model, "approx")
        for _, r in layers:
            r.records = []
        model.train(was_training)


def _device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return torch.device("cpu") if p is None else p.device


def _bar(total: int, desc: str, show: bool):
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover
        tqdm = None
    if tqdm is None or not show:
        class _Null:
            def update(self, n=1):
                pass

            def set_postfix_str(self, s):
                pass

            def close(self):
                pass

        return _Null()
    return tqdm(total=total, desc=desc, leave=False, dynamic_ncols=True)


def _loss(r: RetrofitAttention, rec: dict[str, Any]) -> Tensor:
    out = r.approx(rec["q"], rec["k"], rec["v"], rec["mask"], rec["causal"], rec["scale"])
    target = rec["out"]
    return (out - target).pow(2).sum() / target.pow(2).sum().clamp_min(1e-12)


def layer_losses(model: nn.Module, cache: list[list[dict[str, Any]]]) -> list[float]:
    """Mean relative squared error of each retrofitted layer on the cached teacher data."""
    with torch.no_grad():
        return [sum(_loss(r, rec).item() for rec in recs) / max(len(recs), 1)
                for (_, r), recs in zip(retrofit_layers(model), cache)]


def transfer(model: nn.Module, texts: list[str], tokenizer, *, steps: int = 200, lr: float = 1e-2,
             batch_size: int = 4, max_length: int = 512, seed: int = 0, checkpoint: str | Path | None = None,
             checkpoint_every: int = 50, progress: bool = True, cache=None) -> dict[str, Any]:
    """Train the retrofit's own parameters so each layer's attention matches exact attention.

    Args:
        model: a model retrofitted with :func:`subquad.hf.retrofit`.
        texts: training texts (use third-party docstrings, :func:`subquad.hf.texts.third_party_texts`;
            keep the standard library's for evaluation). Each is cut at ``max_length`` tokens.
        tokenizer: the model's tokenizer.
        steps: optimisation steps (Adam, ``lr``); each step uses ``batch_size`` texts, all layers.
        seed: seeds the order of the texts.
        checkpoint: a file to save progress to every ``checkpoint_every`` steps; if it exists,
            training resumes from it (same texts and options expected).
        cache: teacher data from :func:`cache_teacher`, to reuse across runs.

    Returns a dict with ``loss_before`` / ``loss_after`` (per layer), ``steps``, ``seconds``
    (teacher cache + training), ``cache_seconds`` and ``parameters`` (count trained).
    """
    if steps < 0 or batch_size < 1:
        raise ValueError(f"steps must be >= 0 and batch_size >= 1, got steps={steps}, batch_size={batch_size}")
    layers = retrofit_layers(model)
    if not layers:
        raise ValueError("transfer needs a model retrofitted with subquad.hf.retrofit")
    if not texts:
        raise ValueError("transfer needs at least one training text")
    for _, r in layers:
        if not any(True for _ in r.parameters()):
            _enable_adapter(r)
    start = time.time()
    if cache is None:
        cache = cache_teacher(model, texts, tokenizer, max_length=max_length, progress=progress)
    cache_seconds = time.time() - start
    params = trainable_parameters(model)
    opt = torch.optim.Adam(params, lr=lr)
    gen = torch.Generator().manual_seed(seed)
    ckpt = Path(checkpoint) if checkpoint is not None else None
    with _only_trainable(model, params):
        first = _resume(ckpt, params, opt, gen)
        before = layer_losses(model, cache) if first == 0 else None
        last = _steps(layers, cache, params, opt, gen, range(first, steps), batch_size=batch_size, ckpt=ckpt,
                      checkpoint_every=checkpoint_every, progress=progress)
    after = layer_losses(model, cache)
    return {"loss_before": before, "loss_after": after, "steps": steps, "resumed_from": first,
            "seconds": time.time() - start, "cache_seconds": cache_seconds, "texts": len(cache[0]),
            "parameters": sum(p.numel() for p in params), "last_batch_loss": last}


@contextlib.contextmanager
def _only_trainable(model: nn.Module, params: list[nn.Parameter]):
    """``params`` require grad and every other parameter of ``model`` does not; restored after."""
    frozen = [p for p in model.parameters() if all(p is not q for q in params)]
    saved_flags = [p.requires_grad for p in frozen]
    for p in frozen:
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    try:
        yield
    finally:
        for p, flag in zip(frozen, saved_flags):
            p.requires_grad_(flag)


def _resume(ckpt: Path | None, params: list[nn.Parameter], opt: torch.optim.Optimizer,
            gen: torch.Generator) -> int:
    """Restore parameters, optimiser and text order from ``ckpt`` if it exists; the step to start at."""
    if ckpt is None or not ckpt.exists():
        return 0
    state = torch.load(ckpt, weights_only=True)
    with torch.no_grad():
        for p, value in zip(params, state["params"]):
            p.copy_(value)
    opt.load_state_dict(state["optimizer"])
    gen.set_state(state["generator"])
    return int(state["step"])


def _steps(layers: list, cache: list[list[dict[str, Any]]], params: list[nn.Parameter], opt: torch.optim.Optimizer,
           gen: torch.Generator, steps: range, *, batch_size: int, ckpt: Path | None, checkpoint_every: int,
           progress: bool) -> float:
    """The optimisation steps ``steps`` (a checkpoint every ``checkpoint_every``); the mean layer
    loss of the last batch (NaN when there was no step)."""
    n_texts = len(cache[0])
    bar = _bar(len(steps), "attention transfer", progress)
    last = float("nan")
    try:
        for step in steps:
            idx = torch.randperm(n_texts, generator=gen)[:batch_size].tolist()
            opt.zero_grad(set_to_none=True)
            total = 0.0
            for (_, r), recs in zip(layers, cache):
                loss = sum(_loss(r, recs[i]) for i in idx) / len(idx)
                loss.backward()
                total += loss.item()
            opt.step()
            last = total / len(layers)
            bar.update(1)
            bar.set_postfix_str(f"loss {last:.4f}")
            if ckpt is not None and (step + 1) % checkpoint_every == 0:
                ckpt.parent.mkdir(parents=True, exist_ok=True)
                torch.save({"step": step + 1, "params": [p.detach().clone() for p in params],
                            "optimizer": opt.state_dict(), "generator": gen.get_state()}, ckpt)
    finally:
        bar.close()
    return last
