"""Fidelity on long causal attention: every causal method against exact attention on SmolLM2-135M-Instruct's Q, K, V.

    python benchmarks/long_fidelity.py --n 2048 4096 8192 --svd-heads 3 --out benchmarks/results  # every method
    python benchmarks/long_fidelity.py --n 2048 --methods hybrid       # hybrid rows, the limits and sharpness only
    python benchmarks/long_fidelity.py --n 8192 --layers 0 15 --no-limits --methods linear performer
    python benchmarks/long_fidelity.py --n 8192 --no-limits --methods hybrid --rows hybrid:num_blocks=8 \
        hybrid:num_blocks=24 hybrid:score=mass --out /tmp/selection     # selection settings side by side

Inputs: the causal attention inputs of SmolLM2-135M-Instruct (``subquad.data.smollm``: 30 layers, 9
query heads, 3 key/value heads repeated over their groups, head dim 64, q and k after the rotary
embedding, scale 1/8) on the first N tokens of the prose paragraphs of torch's docstrings
(``smollm.long_text(N, tokenizer, part="eval")``), at layers 0, 3, ..., 27 (``--layers``,
``--all-layers``). Captures come from ``smollm.cached_capture`` (``--cache-dir``, float16 on disk):
a capture at N = 8192 takes minutes once, then a second.

Error: ``|out - exact|_F / |exact|_F`` per layer over all heads, against exact causal attention in
float64 (``exact_reference(causal=True)``); methods run in float32 on the float32 capture through
``subquad.attention(q, k, v, method=..., causal=True, **options)``. Tables give the mean over the layers
and each layer; the JSON has per-head errors too.

Rows, per N:

- sharpness of the exact causal attention rows (``attention_sharpness(causal=True)``), mean over queries
  and heads: the entropy in nats and the weight on the 64 largest keys.
- ``rank-r limit``: per head, ``P_r A V`` with ``P_r`` the projection on the top-r left singular
  vectors of the exact causal attention matrix A (float64), that is ``A_r V`` for the best rank-r
  ``A_r`` (as in real_fidelity.py), r in ``--ranks``. The singular vectors come from randomized
  subspace iteration (Halko et al. 2011: 192 columns, 8 power iterations, float32), not a full SVD:
  a full SVD of one 8192 x 8192 head takes minutes on 2 cores. On 6 heads at N = 2048 it matched
  the full SVD's error to within 0.3 % (relative). Exact attention, sharpness and this limit take
  about 12 s a layer at N = 2048 and 140 s at 8192 on the shared 2-core machine (a full run of
  hybrid's rows at 2048: 2.5 minutes); ``--svd-heads K`` computes the limit on K heads per layer
  (evenly spaced, so 3 heads are one per key/value group), and the table then says so.
- every registered method that supports ``causal=True`` (``--methods`` to choose): its defaults, and at
  each budget B in ``--budgets``: a sparse method (hybrid, topk, quest, moba) under its registry
  entry's ``budget_options`` for B exact keys a query (beyond its own block), the others with
  their budget-like option (``num_features``, ``num_landmarks`` or ``block_size``, the first they
  have) = B.
  Stochastic methods get a generator seeded per layer. A row that raises is reported with its error and the run goes on.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

import subquad
from subquad.data import smollm
from subquad.compare.common import machine_info, md_table, source_state
from subquad.compare.fidelity import attention_sharpness, exact_reference
from subquad.compare.workload import full_options
from subquad.cli_base import parse_value

NS = (2048, 4096, 8192)
BUDGETS = (64, 128)
RANKS = (32, 64, 128)
TOP = 64
SEED = 0
BUDGET_OPTIONS = ("num_features", "num_landmarks", "block_size")
SKETCH_OVERSAMPLE = 64
SKETCH_ITERATIONS = 8


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, nargs="+", default=list(NS), help="lengths, at most 8192")
    p.add_argument("--layers", type=int, nargs="+", default=None, help="layers (default 0 3 ... 27)")
    p.add_argument("--all-layers", action="store_true", help="all 30 layers")
    p.add_argument("--methods", nargs="+", default=None, help="causal methods (default: every one)")
    p.add_argument("--budgets", type=int, nargs="+", default=list(BUDGETS))
    p.add_argument("--ranks", type=int, nargs="+", default=list(RANKS), help="r of the rank-r limit")
    p.add_argument("--svd-heads", type=int, default=None, help="heads per layer for the rank-r limit (default all)")
    p.add_argument("--no-limits", action="store_true", help="skip the rank-r limit and the sharpness rows")
    p.add_argument("--rows", nargs="+", default=[], metavar="METHOD:NAME=VALUE,...",
                   help="extra rows, e.g. hybrid:num_blocks=8 hybrid:key_block=64,num_blocks=32")
    p.add_argument("--cache-dir", type=Path, default=Path(smollm.CACHE_DIR))
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args(argv)
    causal = [m.name for m in subquad.list_methods() if m.kind == "attention" and m.causal]
    args.methods = causal if args.methods is None else args.methods
    bad = [m for m in args.methods if m not in causal]
    if bad:
        p.error(f"not causal attention methods: {bad}; the causal ones are {causal}")
    if any(not 1 <= n <= smollm.MAX_TOKENS for n in args.n):
        p.error(f"--n must be in 1..{smollm.MAX_TOKENS}")
    args.layers = (list(range(smollm.NUM_LAYERS)) if args.all_layers else
                   sorted(set(args.layers)) if args.layers else smollm.default_layers())
    return args


def method_rows(methods: list[str], budgets: list[int]) -> list[tuple[str, str, dict]]:
    """``(label, method, options)``: each method's defaults and its budget-like option at each
    budget; rows whose full options repeat an earlier row's are dropped."""
    rows, seen = [], set()
    for name in methods:
        info = subquad.get_method(name)
        knob = next((o for o in BUDGET_OPTIONS if o in info.option_names), None)
        variants = [("defaults", {})]
        for b in budgets if knob or info.budget_options else []:
            if info.budget_options:
                try:
                    options = info.budget_options(info.make_options(), b)
                except ValueError as err:  # below the method's smallest selection at its defaults
                    print(f"skipped: {err}", file=sys.stderr)
                    continue
                variants.append((f"{b} keys: " + ", ".join(f"{n}={x}" for n, x in options.items()), options))
            else:
                variants.append((f"{knob}={b}", {knob: b}))
        for label, options in variants:
            try:
                key = (name, repr(sorted(full_options(info, options).items())))
            except (ValueError, TypeError):
                key = (name, label)
            if key not in seen:
                seen.add(key)
                rows.append((f"{name} ({label})", name, options))
    return rows


def extra_rows(specs: list[str]) -> list[tuple[str, str, dict]]:
    """``--rows``: ``METHOD:NAME=VALUE,NAME=VALUE`` -> ``(label, method, options)``."""
    rows = []
    for spec in specs:
        name, _, pairs = spec.partition(":")
        options = {k: parse_value(v) for k, _, v in (pair.partition("=") for pair in pairs.split(",") if pair)}
        subquad.get_method(name).make_options(**options)  # a typo fails before minutes of capture
        rows.append((f"{name} ({pairs.replace(',', ', ')})", name, options))
    return rows


def _head_errors(out: torch.Tensor, exact: torch.Tensor) -> tuple[float, list[float]]:
    """Relative error over all heads and per head; ``out``, ``exact`` ``(1, H, N, D)``."""
    diff = (out.double() - exact).pow(2).sum(dim=(0, 2, 3))
    ref = exact.pow(2).sum(dim=(0, 2, 3))
    return math.sqrt(diff.sum() / ref.sum()), (diff / ref).sqrt().tolist()


def causal_weights(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """Exact causal attention matrix ``(N, N)`` of one head: float64 softmax, returned in float32
    (for the sketch; its error rows agree with a float64 sketch to 4 digits)."""
    logits = (q.double() @ k.double().T) * scale
    later = torch.ones(logits.shape, dtype=torch.bool).triu(1)
    return torch.softmax(logits.masked_fill(later, float("-inf")), dim=-1).float()


def top_singular_vectors(a: torch.Tensor, rank: int, seed: int) -> torch.Tensor:
    """``(N, rank)`` float64: the top left singular vectors of ``a`` by randomized subspace iteration
    (Halko, Martinsson and Tropp 2011), ``rank + 64`` columns, :data:`SKETCH_ITERATIONS` power
    iterations."""
    gen = torch.Generator().manual_seed(seed)
    y = a @ torch.randn(a.shape[1], rank + SKETCH_OVERSAMPLE, dtype=a.dtype, generator=gen)
    for _ in range(SKETCH_ITERATIONS):
        basis = torch.linalg.qr(y).Q
        y = a @ torch.linalg.qr(a.T @ basis).Q
    basis = torch.linalg.qr(y).Q
    u = torch.linalg.svd(basis.T @ a, full_matrices=False).U
    return (basis @ u[:, :rank]).double()


def head_limits(cap: dict, i: int, h: int, ranks: list[int] | None, sharpness: bool) -> dict:
    """One head of layer index ``i``: its exact causal output ``(N, D)`` float64, its sharpness, and
    (``ranks``) the squared errors of its rank-r limits and of the exact output's squared norm."""
    q, k, v = (cap[t][i][:, h : h + 1] for t in ("q", "k", "v"))
    exact = exact_reference(q, k, v, cap["scale"], causal=True)[0, 0]
    out = {"exact": exact, "ref": exact.pow(2).sum().item()}
    if sharpness:
        out["sharpness"] = attention_sharpness(q, k, cap["scale"], causal=True, top=TOP)
    if ranks:
        u = top_singular_vectors(causal_weights(q[0, 0], k[0, 0], cap["scale"]), max(ranks), SEED + 100 * i + h)
        out["rank"] = {r: (u[:, :r] @ (u[:, :r].T @ exact) - exact).pow(2).sum().item() for r in ranks}
    return out


def layer_limits(cap: dict, i: int, args) -> tuple[torch.Tensor, dict[str, dict]]:
    """Exact attention of layer index ``i`` ``(1, H, N, D)`` float64, and (unless ``--no-limits``) the
    sharpness and rank-r limit rows. Heads run on two worker threads of one torch thread each: on
    this shared 2-core machine kernels split over both cores waited at barriers for a descheduled
    thread and ran the sketch 7 times slower."""
    heads = cap["q"][i].shape[1]
    svd = [] if args.no_limits else _svd_heads(heads, args.svd_heads)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(max(threads, 1)) as pool:
            res = list(pool.map(lambda h: head_limits(cap, i, h, args.ranks if h in svd else None,
                                                      not args.no_limits), range(heads)))
    finally:
        torch.set_num_threads(threads)
    exact = torch.stack([r["exact"] for r in res])[None]
    if args.no_limits:
        return exact, {}
    rows = {"sharpness: entropy (nats)": {"error": sum(r["sharpness"]["entropy"] for r in res) / heads},
            f"sharpness: mass of the top {TOP} keys": {"error": sum(r["sharpness"]["top_mass"] for r in res) / heads}}
    for r in args.ranks:
        diff, ref = [res[h]["rank"][r] for h in svd], [res[h]["ref"] for h in svd]
        rows[f"rank-{r} limit{'' if len(svd) == heads else f' (heads {svd})'}"] = {
            "error": math.sqrt(sum(diff) / sum(ref)), "per_head": [math.sqrt(d / x) for d, x in zip(diff, ref)],
            "heads": svd}
    return exact, rows


def run_method(cap: dict, i: int, name: str, options: dict, exact: torch.Tensor) -> dict:
    info = subquad.get_method(name)
    opts = dict(options)
    if "generator" in info.option_names:
        opts["generator"] = torch.Generator().manual_seed(SEED + i)
    start = time.perf_counter()
    with torch.no_grad():
        out = subquad.attention(cap["q"][i], cap["k"][i], cap["v"][i], method=name,
                                **smollm.call_arguments(cap), **opts)
    seconds = time.perf_counter() - start
    error, per_head = _head_errors(out, exact)
    return {"error": error, "per_head": per_head, "seconds": seconds}


def measure_layer(cap: dict, i: int, rows, args, log) -> dict[str, dict]:
    """Every row at layer index ``i`` of the capture: ``{row label: {"error", "per_head", ...}}``."""
    start = time.perf_counter()
    exact, out = layer_limits(cap, i, args)
    log(f"exact attention{'' if args.no_limits else ', sharpness and rank limits'} in "
        f"{time.perf_counter() - start:.1f} s")
    for label, name, options in rows:
        try:
            out[label] = {"method": name, "options": options, **run_method(cap, i, name, options, exact)}
            log(f"{label}: {out[label]['error']:.4f} in {out[label]['seconds']:.2f} s")
        except Exception as e:  # noqa: BLE001 (reported, the run goes on)
            out[label] = {"method": name, "options": options, "error": None,
                          "failure": f"{type(e).__name__}: {e}"[:300]}
            log(f"{label}: FAILED {out[label]['failure']}")
    return out


def _svd_heads(heads: int, count: int | None) -> list[int]:
    if count is None or count >= heads:
        return list(range(heads))
    return sorted({round(j * (heads - 1) / max(count - 1, 1)) for j in range(count)})


def _collect(per_row: dict[str, dict], layer_rows: dict[str, dict]) -> None:
    """Append one layer's results to the per-row lists."""
    for label, res in layer_rows.items():
        entry = per_row.setdefault(label, {"per_layer": [], "per_head": [], "seconds": [], "failure": None})
        entry.update({key: res[key] for key in ("method", "options", "heads") if key in res})
        entry["per_layer"].append(res["error"])
        entry["per_head"].append(res.get("per_head"))
        entry["seconds"].append(res.get("seconds"))
        entry["failure"] = entry["failure"] or res.get("failure")


def measure_n(n: int, rows, args) -> dict:
    """Every row on every layer at length ``n``: the capture's description, ``"seconds"`` and
    ``"rows"``: ``{label: {"per_layer", "per_head", "seconds", "mean", "failure", ...}}``."""
    start = time.perf_counter()
    cap = smollm.cached_capture(n, args.layers, cache_dir=args.cache_dir, log=lambda s: print(s, file=sys.stderr))
    print(f"N={n}: capture of layers {args.layers} ready in {time.perf_counter() - start:.1f} s "
          f"(check {cap['check']:.1e})", file=sys.stderr)
    per_row: dict[str, dict] = {}
    for i, layer in enumerate(cap["layers"]):
        prefix = f"N={n} layer {layer}: "
        _collect(per_row, measure_layer(cap, i, rows, args,
                                        lambda text, p=prefix: print(p + text, file=sys.stderr, flush=True)))
    for entry in per_row.values():
        ok = [e for e in entry["per_layer"] if e is not None]
        entry["mean"] = sum(ok) / len(ok) if ok and len(ok) == len(entry["per_layer"]) else None
    keys = ("tokens", "text", "check", "check_per_layer", "cached", "seconds", "scale")
    return {"capture": {key: cap[key] for key in keys}, "seconds": time.perf_counter() - start, "rows": per_row}


def _cell(entry: dict, value) -> str:
    if value is None:
        return "FAILED" if entry.get("failure") else "-"
    return f"{value:.3f}" if value >= 1e-3 else f"{value:.1e}"


def markdown(report: dict) -> str:
    cfg = report["config"]
    lines = ["# Fidelity on long causal attention: SmolLM2-135M-Instruct Q, K, V", "",
             f"Model {smollm.MODEL_NAME} ({smollm.NUM_LAYERS} layers, 9 query heads, 3 key/value heads repeated over "
             "their groups, head dim 64, rotary, causal); q and k after the rotary embedding. Text: the first N tokens "
             f"of {next(iter(report['results'].values()))['capture']['text'] if report['results'] else '-'} "
             "(`smollm.long_text`). Error `|out - exact|_F / |exact|_F` per layer over all heads against exact causal "
             "attention in float64; methods in float32 through `subquad.attention(..., causal=True)`. Rank-r limit: "
             f"`A_r V` with the top-r singular subspace of each head's exact attention matrix, by randomized subspace "
             f"iteration ({SKETCH_ITERATIONS} power iterations). Sharpness: mean over queries and heads of the row "
             f"entropy (nats) and of the weight on the {TOP} largest keys. Last column: mean seconds per layer "
             f"(all 9 heads, one call). subquad at {cfg['source']}; torch {cfg['torch']}, {cfg['cpu']}, "
             f"{cfg['threads']} threads, {cfg['date']}, {cfg['seconds']:.0f} s. Command: `{cfg['command']}`", ""]
    for n, res in report["results"].items():
        cap = res["capture"]
        layers = cfg["layers"]
        lines += [f"## N = {n}", "", f"Capture check (exact attention on the capture vs the model's attention "
                  f"output): {cap['check']:.1e}; measured in {res['seconds']:.0f} s.", ""]
        headers = ["row", "mean", *(f"L{layer}" for layer in layers), "s / layer"]
        body = []
        for label, entry in res["rows"].items():
            secs = [s for s in entry["seconds"] if s is not None]
            body.append([label, _cell(entry, entry["mean"]), *(_cell(entry, e) for e in entry["per_layer"]),
                         f"{sum(secs) / len(secs):.2f}" if secs else "-"])
        lines += [md_table(headers, body), ""]
        failures = {label: e["failure"] for label, e in res["rows"].items() if e["failure"]}
        lines += [f"- {label} failed: {msg}" for label, msg in failures.items()] + ([""] if failures else [])
    lines.append("Per-head errors are in the JSON next to this file.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    start = time.perf_counter()
    source = source_state(Path(__file__).parent)
    rows = method_rows(args.methods, args.budgets) + extra_rows(args.rows)
    results = {str(n): measure_n(n, rows, args) for n in args.n}
    info = machine_info(torch.device("cpu"))
    report = {"config": {"n": args.n, "layers": args.layers, "methods": args.methods, "budgets": args.budgets,
                         "ranks": args.ranks, "svd_heads": args.svd_heads, "limits": not args.no_limits,
                         "seed": SEED, "torch": info["torch"], "cpu": info["cpu"], "threads": info["threads"],
                         "source": source, "date": datetime.date.today().isoformat(),
                         "command": "python " + " ".join(["benchmarks/long_fidelity.py", *(argv or sys.argv[1:])]),
                         "seconds": time.perf_counter() - start},
              "results": results}
    text = markdown(report)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, content in (("long_fidelity.json", json.dumps(report, indent=1) + "\n"), ("long_fidelity.md", text)):
        (args.out / name).write_text(content)
    print(text)
    return report


if __name__ == "__main__":
    main()
