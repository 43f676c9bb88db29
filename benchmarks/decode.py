"""Time per generated token of a retrofitted decoder at several context lengths: a recurrent state
(subquad.hf.StateCache) against every key kept (transformers' DynamicCache).

    .venv/bin/python benchmarks/decode.py                               # the committed table
    .venv/bin/python benchmarks/decode.py --quick --out /tmp/decode     # smoke run (seconds)

Model: a random ``LlamaForCausalLM`` (2 layers, hidden 256, 4 heads of 64, 4 key/value heads,
intermediate 512, vocabulary 1000), float32, eval mode, ``torch.manual_seed(0)``, batch 1. Rows:
``exact`` (not retrofitted, SDPA) with transformers' DynamicCache (which concatenates the whole
cache each step) and with its StaticCache (allocated once); ``linear`` through its state; ``linear`` with a
DynamicCache (each new token recomputes the causal linear attention over all kept keys);
``performer`` (128 features) and ``hedgehog`` (no window), both through their state; ``hybrid``
(defaults) through its state (the keys and values, their block sums, the query block's choice). For each N,
every row prefills the same N random token ids into a fresh cache (timed once), then runs
``--steps`` single-token forward calls that each append one more (the same random ids for every
row), under ``torch.no_grad()``; the rows take turns token by token, so a slow spell of the
machine touches all of them. Reported: the median seconds per token with its interquartile range
(and min/max in the JSON), the prefill seconds, and the memory the cache holds after the steps
(``StateCache.nbytes()``; a DynamicCache's or StaticCache's keys and values). Ratios are to the
faster exact row. One untimed warm-up per row (a short
prefill and steps) runs first.

A second table times one layer's attention alone (:func:`attention_steps`: 4 heads of 64, no
model around it), where the whole-token time above is bounded below by the rest of the model
(embedding, MLPs, the transformers call: about 3 ms per token here at any length).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

import subquad.hf as H

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 1000

# row name -> (retrofit method or None for the exact model, its options, the cache it decodes with)
ROWS = {
    "exact": (None, {}, "dynamic"),
    "exact (StaticCache)": (None, {}, "static"),
    "linear": ("linear", {}, "state"),
    "linear (DynamicCache)": ("linear", {}, "dynamic"),
    "performer": ("performer", {"num_features": 128}, "state"),
    "hedgehog": ("hedgehog", {}, "state"),
    "hybrid": ("hybrid", {}, "state"),
}


def build_models(names: list[str], max_positions: int) -> dict[str, torch.nn.Module]:
    """One copy of the same random Llama per row, retrofitted with the row's method (``exact``: SDPA)."""
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, head_dim=64,
                      max_position_embeddings=max_positions, attn_implementation="sdpa")
    base = LlamaForCausalLM(cfg).to(torch.float32).eval()
    models = {}
    for name in names:
        method, options, _ = ROWS[name]
        model = copy.deepcopy(base)
        models[name] = model if method is None else H.retrofit(model, method, **options)
    return models


def new_cache(name: str, model: torch.nn.Module, length: int):
    """The row's cache for ``length`` tokens: a StateCache, transformers' DynamicCache (grown by
    concatenation each step) or StaticCache (allocated once for ``length``)."""
    from transformers import DynamicCache, StaticCache

    kind = ROWS[name][2]
    if kind == "state":
        cache = H.decoding_cache(model)
        assert isinstance(cache, H.StateCache), f"{name}: expected a StateCache, got {type(cache).__name__}"
        return cache
    if kind == "static":
        return StaticCache(config=model.config, max_cache_len=length)
    return DynamicCache()


def cache_bytes(cache) -> int:
    """Memory the cache holds: a StateCache's states, or a DynamicCache's keys and values."""
    if isinstance(cache, H.StateCache):
        return cache.nbytes()
    return sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values) if t is not None)


def _forward_seconds(model: torch.nn.Module, ids: torch.Tensor, cache) -> float:
    """Seconds of one forward call that appends ``ids`` to ``cache``."""
    start = time.perf_counter()
    model(input_ids=ids, **{H.CACHE_ARGUMENT: cache})
    return time.perf_counter() - start


def warm_up(models: dict[str, torch.nn.Module]) -> None:
    """A short prefill and a few steps per row, untimed: first-call allocations and lazy set-up."""
    ids = torch.randint(0, VOCAB, (1, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for name, model in models.items():
            cache = new_cache(name, model, 68)
            model(input_ids=ids, **{H.CACHE_ARGUMENT: cache})
            for t in range(4):
                model(input_ids=ids[:, t: t + 1], **{H.CACHE_ARGUMENT: cache})


def measure(models: dict[str, torch.nn.Module], n: int, steps: int) -> list[dict]:
    """Prefill ``n`` tokens, then ``steps`` single tokens, per row, the rows taking turns."""
    g = torch.Generator().manual_seed(n)
    prompt = torch.randint(0, VOCAB, (1, n), generator=g)
    more = torch.randint(0, VOCAB, (1, steps), generator=g)
    caches = {name: new_cache(name, model, n + steps) for name, model in models.items()}
    prefill, times = {}, {name: [] for name in models}
    with torch.no_grad():
        for name, model in models.items():
            prefill[name] = _forward_seconds(model, prompt, caches[name])
        for t in range(steps):
            for name, model in models.items():
                times[name].append(_forward_seconds(model, more[:, t: t + 1], caches[name]))
    rows = []
    for name, ts in times.items():
        q1, _, q3 = statistics.quantiles(ts, n=4, method="inclusive") if len(ts) > 1 else (ts[0],) * 3
        seen = caches[name].get_seq_length()
        assert seen == n + steps, f"{name}: the cache saw {seen} tokens, expected {n + steps}"
        rows.append({"n": n, "row": name, "s_per_token": statistics.median(ts), "q1": q1, "q3": q3,
                     "min": min(ts), "max": max(ts), "prefill_s": prefill[name],
                     "cache_bytes": cache_bytes(caches[name]), "cache": type(caches[name]).__name__})
    exact = min((r["s_per_token"] for r in rows if ROWS[r["row"]][0] is None), default=None)  # the faster cache
    for r in rows:
        r["ratio_to_exact"] = None if exact is None else r["s_per_token"] / exact
    return rows


def attention_steps(n: int, steps: int, heads: int = 4, dim: int = 64) -> list[dict]:
    """One layer's attention alone for ``steps`` new tokens after ``n`` cached ones (B=1, float32):
    exact (SDPA of the new query over preallocated key and value buffers, as a StaticCache holds
    them), hybrid through :class:`~subquad.ops.hybrid.HybridDecodeState` and linear through
    :class:`~subquad.ops.linear.state.KernelState` (elu + 1 features), taking turns token by token.
    The prefills are not timed."""
    import torch.nn.functional as F

    from subquad.ops.hybrid import HybridDecodeState
    from subquad.ops.linear.state import KernelState

    g = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(1, heads, n + steps, dim, generator=g) for _ in range(3))
    hybrid, linear = HybridDecodeState(), KernelState()
    phi = lambda x: F.elu(x) + 1  # noqa: E731
    with torch.no_grad():
        hybrid.attend(q[:, :, :n], k[:, :, :n], v[:, :, :n])
        linear.attend(phi(q[:, :, :n]), phi(k[:, :, :n]), v[:, :, :n])
        calls = {
            "exact (SDPA)": lambda t: F.scaled_dot_product_attention(q[:, :, t: t + 1], k[:, :, : t + 1],
                                                                     v[:, :, : t + 1]),
            "hybrid": lambda t: hybrid.attend(q[:, :, t: t + 1], k[:, :, t: t + 1], v[:, :, t: t + 1]),
            "linear": lambda t: linear.attend(phi(q[:, :, t: t + 1]), phi(k[:, :, t: t + 1]), v[:, :, t: t + 1]),
        }
        times = {name: [] for name in calls}
        for t in range(n, n + steps):
            for name, call in calls.items():
                start = time.perf_counter()
                call(t)
                times[name].append(time.perf_counter() - start)
    exact = statistics.median(times["exact (SDPA)"])
    rows = []
    for name, ts in times.items():
        q1, _, q3 = statistics.quantiles(ts, n=4, method="inclusive")
        med = statistics.median(ts)
        rows.append({"n": n, "row": name, "s_per_token": med, "q1": q1, "q3": q3, "speedup": exact / med})
    return rows


def _ms(x: float) -> str:
    return f"{x * 1e3:.2f}"


def markdown(res: dict) -> str:
    m = res["meta"]
    out = ["# Decoding speed: time per generated token", "",
           f"{m['model']}. {m['steps']} single-token steps after a prefill of N tokens, batch 1, "
           f"{m['threads']} torch threads, {m['machine']}, torch {m['torch']}, transformers {m['transformers']}, "
           f"{m['date']}. Per token: the median over the steps (ms) and the interquartile range; ratio: the row's "
           "median / exact's (below 1: faster than exact); prefill: one timed call; cache: the memory the cache "
           f"holds after the steps. Command: `{m['command']}`.", ""]
    for n in dict.fromkeys(r["n"] for r in res["rows"]):
        out += [f"## N = {n}", "", "| row | cache | ms / token (median) | IQR (ms) | ratio to exact | prefill s | "
                "cache MiB |", "|---|---|---|---|---|---|---|"]
        for r in (r for r in res["rows"] if r["n"] == n):
            ratio = "-" if r["ratio_to_exact"] is None else f"{r['ratio_to_exact']:.2f}x"
            out.append(f"| {r['row']} | {r['cache']} | {_ms(r['s_per_token'])} | {_ms(r['q1'])} - {_ms(r['q3'])} "
                       f"| {ratio} | {r['prefill_s']:.3f} | {r['cache_bytes'] / 2 ** 20:.3f} |")
        out.append("")
    if res.get("attention"):
        out += ["## One layer's attention alone", "",
                f"{m['attention']}. Per token: the median over the steps (ms) and the interquartile range; "
                "speed-up: exact's median / the row's."
                + (f" Measured again after the table above: `{m['attention_command']}`." if "attention_command" in m
                   else ""), "",
                "| N | row | ms / token (median) | IQR (ms) | speed-up over exact |", "|---|---|---|---|---|"]
        for r in res["attention"]:
            out.append(f"| {r['n']} | {r['row']} | {_ms(r['s_per_token'])} | {_ms(r['q1'])} - {_ms(r['q3'])} "
                       f"| {r['speedup']:.2f}x |")
        out.append("")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, nargs="+", default=[1024, 4096, 16384, 32768, 65536],
                    help="context lengths (prefill tokens)")
    ap.add_argument("--steps", type=int, default=32, help="timed single-token steps after each prefill")
    ap.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="smoke run: --n 256 512 --steps 4")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--attention-only", action="store_true",
                    help="re-measure only the attention-alone table; the model rows stay those of --out's decode.json")
    args = ap.parse_args()
    if args.quick:
        args.n, args.steps = [256, 512], 4
    import transformers

    torch.set_num_threads(args.threads)
    command = "python benchmarks/decode.py " + shlex.join(sys.argv[1:])
    if args.attention_only:
        res = json.loads((args.out / "decode.json").read_text())
        res["attention"] = [r for n in args.n for r in attention_steps(n, 4 * args.steps)]
        res["meta"]["attention_command"] = f"{command} ({time.strftime('%Y-%m-%d')})"
        return _write(res, args.out)
    models = build_models(args.rows, max(65536, max(args.n) + args.steps + 64))
    warm_up(models)
    rows = []
    for n in args.n:
        print(f"N={n}: {', '.join(models)}", flush=True)
        rows += measure(models, n, args.steps)
        for r in rows[-len(models):]:
            print(f"  {r['row']:<22} {_ms(r['s_per_token'])} ms/token, prefill {r['prefill_s']:.3f} s, "
                  f"cache {r['cache_bytes'] / 2 ** 20:.3f} MiB", flush=True)
    attention = []
    for n in args.n:
        attention += attention_steps(n, 4 * args.steps)
        print("  attention alone: " + ", ".join(f"{r['row']} {_ms(r['s_per_token'])} ms" for r in attention[-3:]),
              flush=True)
    res = {"rows": rows, "attention": attention, "meta": {
        "model": "random LlamaForCausalLM, 2 layers, hidden 256, 4 heads of 64 (4 key/value heads), intermediate "
                 "512, vocabulary 1000, float32",
        "options": {name: {"method": ROWS[name][0], "options": ROWS[name][1]} for name in models},
        "attention": f"B=1, 4 heads of 64, float32, {4 * args.steps} single-token steps after N cached tokens, "
                     "the rows taking turns, no model around them",
        "n": args.n, "steps": args.steps, "threads": torch.get_num_threads(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores", "torch": torch.__version__,
        "transformers": transformers.__version__, "date": time.strftime("%Y-%m-%d"),
        "command": command}}
    _write(res, args.out)


def _write(res: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode.json").write_text(json.dumps(res, indent=1))
    (out / "decode.md").write_text(markdown(res))
    print(markdown(res))


if __name__ == "__main__":
    main()
