"""What ``subquad retrofit`` measures: rows of a method and its options, each retrofitted in turn
onto one pretrained model and compared with the model's exact attention on held-out text.

An encoder's row: the sentence-embedding agreement with exact attention
(:func:`subquad.hf.compare_to_exact`), zero-shot and after attention transfer
(:func:`subquad.hf.transfer`). A decoder's row: the next-token perplexity at each N
(:func:`subquad.hf.lm_scores`), zero-shot and after transfer, a greedy sample of a prompt, and
greedy generation after a long prompt (:mod:`subquad.hf.generation`). With ``rounds``, the whole
model's forward seconds with the method against exact attention in the same layers. Rows share
the exact baseline and, when several are transferred, one teacher cache (the q, k, v and exact
output of every layer: they do not depend on the method).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor, nn

from ..cli_base import parse_value
from . import generation as G
from .evaluate import compare_to_exact, embed
from .lm import greedy_sample, lm_scores, next_token_losses
from .retrofit import retrofit, set_mode, unretrofit
from .transfer import cache_teacher, transfer

__all__ = ["Plan", "Measurement", "RowRefused", "parse_row", "row_label", "decoder_training_texts", "forward_speed",
           "teacher_cache"]


@dataclass
class Plan:
    """How each row is measured: attention transfer (``steps`` of Adam at ``lr``, ``batch_size``
    texts a step cut at ``max_length`` tokens, a resumable ``checkpoint``), ``rounds`` timed
    forwards (0: none), and for a decoder a greedy sample of ``prompt``, ``new`` tokens generated
    after the long prompt ``prompt_ids`` (None: none) and the decoded perplexity of its last
    ``ppl_tokens``."""

    steps: int = 0
    lr: float = 1e-2
    batch_size: int = 4
    seed: int = 0
    max_length: int = 512
    checkpoint: Path | None = None
    progress: bool = True
    rounds: int = 0
    prompt: str | None = None
    new: int = 32
    prompt_ids: Tensor | None = None
    ppl_tokens: int = 0


def parse_row(spec: str) -> tuple[str, dict[str, Any]]:
    """``"hybrid:key_block=64,num_blocks=24"`` -> ``("hybrid", {"key_block": 64, "num_blocks": 24})``."""
    method, _, rest = spec.partition(":")
    options: dict[str, Any] = {}
    for pair in (p for p in rest.split(",") if p.strip()):
        name, eq, value = pair.partition("=")
        if not (eq and name.strip()):
            raise ValueError(f"{spec!r}: {pair!r} must look like NAME=VALUE (METHOD:NAME=VALUE,NAME=VALUE)")
        options[name.strip().replace("-", "_")] = parse_value(value)
    if not method.strip():
        raise ValueError(f"{spec!r} names no method (METHOD or METHOD:NAME=VALUE,...)")
    return method.strip(), options


def decoder_training_texts(tokenizer, count: int, length: int) -> list[str]:
    """``count`` consecutive windows of ``length`` tokens of the training prose of
    :func:`subquad.data.smollm.long_text` (``part="train"``: numpy's and transformers' docstrings;
    a decoder's held-out text is torch's), as text."""
    from ..data.smollm import long_text

    ids = tokenizer(long_text(count * length + 16, tokenizer, part="train"))["input_ids"]
    return [tokenizer.decode(ids[i * length: (i + 1) * length]) for i in range(count)]


def row_label(method: str, options: dict[str, Any]) -> str:
    """``"hybrid key_block=64 num_blocks=24"``."""
    return method + "".join(f" {k}={v}" for k, v in options.items())


def forward_speed(model: nn.Module, forward: Callable[[], object], rounds: int) -> dict[str, float]:
    """``forward()`` of a retrofitted ``model`` with its method and with exact attention in the same
    layers (``set_mode(model, "exact")``: ``scaled_dot_product_attention``), alternating, after one
    untimed call of each: the median ``seconds`` and ``exact_seconds`` of ``rounds`` calls each,
    and ``speedup`` (exact's over the method's)."""
    times: dict[str, list[float]] = {"exact": [], "approx": []}
    try:
        with torch.no_grad():
            for i in range(rounds + 1):
                for mode, seconds in times.items():
                    set_mode(model, mode)
                    start = time.perf_counter()
                    forward()
                    if i:
                        seconds.append(time.perf_counter() - start)
    finally:
        set_mode(model, "approx")
    method, exact = statistics.median(times["approx"]), statistics.median(times["exact"])
    return {"seconds": method, "exact_seconds": exact, "speedup": exact / method, "rounds": rounds}


def teacher_cache(model: nn.Module, tokenizer, texts: list[str], plan: Plan) -> list:
    """The exact-attention teacher data of ``texts`` (:func:`subquad.hf.cache_teacher`) of a model
    that is not retrofitted, for several rows' transfers."""
    retrofit(model, "softmax")
    try:
        return cache_teacher(model, texts, tokenizer, max_length=plan.max_length, progress=plan.progress)
    finally:
        unretrofit(model)


def _transfer(model: nn.Module, tokenizer, texts: list[str], plan: Plan, cache,
              cache_seconds: float | None) -> dict[str, Any]:
    """:func:`subquad.hf.transfer`'s result; with a shared ``cache``, ``shared_cache_seconds``
    (what making it took)."""
    res = transfer(model, texts, tokenizer, steps=plan.steps, lr=plan.lr, batch_size=plan.batch_size,
                   max_length=plan.max_length, seed=plan.seed, checkpoint=plan.checkpoint, progress=plan.progress,
                   cache=cache)
    return dict(res) if cache is None else {**res, "shared_cache_seconds": cache_seconds}


def _transferred(steps: int, res: dict[str, Any]) -> str:
    return (f"after {steps} transfer steps ({res['seconds']:.0f} s, {res['parameters']} parameters, "
            f"{res['texts']} texts)")


class RowRefused(ValueError):
    """:func:`subquad.hf.retrofit` refused a row's method or options for this model."""


class Measurement:
    """One model, its held-out data and a :class:`Plan`; :meth:`rows` measures each row.

    ``held_out``: an encoder's held-out texts, or a decoder's ``{N: ids (1, N)}``; ``what`` says
    what they are; ``train``: the transfer's training texts (None: no transfer)."""

    def __init__(self, kind: str, model: nn.Module, tokenizer, plan: Plan, held_out, what: str,
                 train: list[str] | None = None):
        self.kind, self.model, self.tokenizer, self.plan = kind, model, tokenizer, plan
        self.held_out, self.what, self.train = held_out, what, train
        self.exact: Any = None  # an encoder's exact embeddings; a decoder's baseline (:meth:`decoder_baseline`)
        self.cache, self.cache_seconds = None, None  # the teacher cache several rows share

    def rows(self, rows: list[tuple[str, dict[str, Any]]], *, keep_last: bool = False) -> list[dict[str, Any]]:
        """Each ``(method, options)`` retrofitted (``seed`` the plan's), measured and removed again;
        a row that fails keeps its message as ``error``. ``keep_last``: the one row's errors are
        raised and its retrofit stays on the model (to be saved)."""
        if self.plan.steps and len(rows) > 1 and self.cache is None:
            start = time.time()
            self.cache = teacher_cache(self.model, self.tokenizer, self.train, self.plan)
            self.cache_seconds = time.time() - start
        if self.kind == "decoder" and self.exact is None:
            self.exact = self.decoder_baseline()
        out = []
        for method, options in rows:
            row: dict[str, Any] = {"method": method, "options": options, "label": row_label(method, options)}
            try:
                try:
                    retrofit(self.model, method, seed=self.plan.seed, **options)
                except (ValueError, TypeError, NotImplementedError) as e:
                    raise RowRefused(str(e)) from e
                try:
                    row.update(self.encoder_row(method, options) if self.kind == "encoder"
                               else self.decoder_row(method, options))
                finally:
                    if not keep_last:
                        unretrofit(self.model)
            except Exception as e:  # noqa: BLE001 (reported in the row; one row raises)
                if keep_last:
                    raise
                row["error"] = f"{type(e).__name__}: {e}"[:300]
                print(f"{row['label']}: {row['error']}", flush=True)
            out.append(row)
        return out

    def encoder_row(self, method: str, options: dict[str, Any]) -> dict[str, Any]:
        """Embedding agreement zero-shot (and after transfer), and the forward's speed."""
        model, tok, held_out, plan = self.model, self.tokenizer, self.held_out, self.plan
        t0 = time.time()
        before = compare_to_exact(model, tok, held_out, exact=self.exact)
        self.exact = before.pop("exact")
        print(f"zero-shot {method} {options}: {_cosines(before)} on {len(held_out)} {self.what} "
              f"({time.time() - t0:.0f} s)", flush=True)
        row: dict[str, Any] = {"zero_shot": before}
        if plan.steps:
            row["transfer"] = _transfer(model, tok, self.train, plan, self.cache, self.cache_seconds)
            row["after"] = compare_to_exact(model, tok, held_out, exact=self.exact)
            row["after"].pop("exact")
            print(f"{_transferred(plan.steps, row['transfer'])}: {_cosines(row['after'])}", flush=True)
        if plan.rounds:
            row["speed"] = forward_speed(model, lambda: embed(model, tok, held_out[:4]), plan.rounds)
            print(f"{method} {options}: {_speed(row['speed'])} (the first {len(held_out[:4])} held-out texts "
                  "as one batch)", flush=True)
        return row

    def decoder_baseline(self) -> dict[str, Any]:
        """The model before any retrofit: perplexity at each N, the sample, the long-prompt
        generation and the decoded perplexity of its last tokens."""
        model, plan = self.model, self.plan
        base: dict[str, Any] = {"ppl": {n: _perplexity(model, ids, "exact attention", self.what, None)
                                        for n, ids in self.held_out.items()}}
        if plan.prompt is not None:
            base["sample"] = greedy_sample(model, self.tokenizer, plan.prompt, plan.new)
        if plan.prompt_ids is not None:
            base["generation"] = G.exact_generation(model, plan.prompt_ids, plan.new, self.tokenizer)
            print(f"exact attention after {plan.prompt_ids.shape[1]} prompt tokens: {_ms(base['generation'])}",
                  flush=True)
            if plan.ppl_tokens:
                base["decoded"] = G.decoded_perplexity(model, plan.prompt_ids, plan.ppl_tokens)
        return base

    def decoder_row(self, method: str, options: dict[str, Any]) -> dict[str, Any]:
        """Perplexity zero-shot (and after transfer) at each N, speed, sample and generation."""
        model, plan, exact = self.model, self.plan, self.exact
        row: dict[str, Any] = {"zero_shot": self._perplexities(f"zero-shot {method} {options}")}
        if plan.steps:
            row["transfer"] = _transfer(model, self.tokenizer, self.train, plan, self.cache, self.cache_seconds)
            row["after"] = self._perplexities(_transferred(plan.steps, row["transfer"]))
        if plan.rounds:
            row["speed"] = {n: forward_speed(model, lambda ids=ids: model(input_ids=ids, use_cache=False), plan.rounds)
                            for n, ids in self.held_out.items()}
            for n, speed in row["speed"].items():
                print(f"{method} {options} at {n} tokens: {_speed(speed)}", flush=True)
        if plan.prompt is not None:
            row["sample"] = greedy_sample(model, self.tokenizer, plan.prompt, plan.new)
            print(f"prompt: {plan.prompt!r}\nexact attention: {exact['sample']!r}\n{method}: {row['sample']!r}")
        if plan.prompt_ids is not None:
            row["generation"] = G.generation_agreement(model, plan.prompt_ids, exact["generation"], self.tokenizer)
            g = row["generation"]
            print(f"{method} {options} after {plan.prompt_ids.shape[1]} prompt tokens: the same token at "
                  f"{100 * g['forced_same']:.1f} % of positions teacher-forced, {100 * g['free_same']:.1f} % "
                  f"free-running (first difference {g['first_difference']}), {_ms(g)}", flush=True)
            if plan.ppl_tokens:
                row["decoded"] = G.decoded_perplexity(model, plan.prompt_ids, plan.ppl_tokens, exact["decoded"]["ppl"])
                print(f"{method} {options} decoding the prompt's last {plan.ppl_tokens} tokens one at a time: "
                      f"perplexity x{row['decoded']['ppl_ratio']:.4f} exact attention's", flush=True)
        return row

    def _perplexities(self, label: str) -> dict[int, dict[str, float]]:
        return {n: _perplexity(self.model, ids, label, self.what, self.exact["ppl"][n])
                for n, ids in self.held_out.items()}


def _perplexity(model: nn.Module, ids: Tensor, label: str, what: str, exact: dict | None) -> dict[str, Any]:
    """Print and return the perplexity row of ``model`` on ``ids`` (with ``"pred"`` for exact)."""
    loss, pred, seconds = next_token_losses(model, ids)
    row = lm_scores(loss, pred, exact)
    line = f"{label}: perplexity {row['ppl']:.3f}, last quarter {row['ppl_last_quarter']:.3f}"
    if exact is None:
        print(f"{line} on {ids.shape[1]} tokens of {what} ({seconds:.1f} s)", flush=True)
        return {**row, "seconds": seconds, "pred": pred}
    print(f"{line} on {ids.shape[1]} tokens: x{row['ppl_ratio']:.4f} and x{row['last_quarter_ratio']:.4f} exact "
          f"attention's, the same greedy next token at {100 * row['same_prediction']:.1f} % of positions "
          f"({seconds:.1f} s)", flush=True)
    return {**row, "seconds": seconds}


def _cosines(r: dict[str, float]) -> str:
    return (f"mean cosine {r['mean_cosine']:.4f}, min {r['min_cosine']:.4f}, top-1 neighbour agreement "
            f"{r['nn_agreement']:.3f}")


def _speed(s: dict[str, float]) -> str:
    return (f"forward {s['seconds']:.3f} s, exact attention {s['exact_seconds']:.3f} s, {s['speedup']:.2f}x "
            f"(medians of {s['rounds']})")


def _ms(g: dict[str, Any]) -> str:
    return "-" if g["s_per_token"] is None else f"{g['s_per_token'] * 1e3:.1f} ms per token"
