"""Fidelity on real, sharp attention: every method against exact attention on all-MiniLM-L6-v2's Q, K, V.

    python benchmarks/real_fidelity.py --out benchmarks/results          # full run (a few minutes on 2 cores)
    python benchmarks/real_fidelity.py --quick --out /tmp/real_fidelity  # smoke run: 2 layers, budgets 32 and 64

Inputs: the Q, K, V of all 6 layers x 12 heads of all-MiniLM-L6-v2 (``subquad.data.minilm``:
forward hooks on the query/key/value projections, float32) on English text of exactly 512 tokens:
the prose paragraphs of the Python standard library's docstrings
(``subquad.hf.texts.stdlib_paragraphs``), concatenated in order with blank lines until the tokenizer
gives more than 512 tokens; ``capture_qkv`` cuts the text at 512.

Error: the relative Frobenius error ``|out - exact| / |exact|`` against float64 exact attention
(``exact_reference``), per layer over all heads, then the mean over the layers (the convention of
``subquad compare --source minilm``). Methods run in float32 on the float32 capture.

Rows, at budget B in {32, 64, 128}:

- ``rank-r limit (SVD)``: for each head, the best rank-r approximation A_r of the exact attention
  matrix A (float64 SVD, r = B); the error of A_r V. No method whose output is a rank-r matrix
  times V does better.
- ``block-local``: exact attention restricted to the query's own contiguous block of B keys (a
  baseline computed here on the float64 logits, not a method of subquad).
- ``nystrom``, ``lara`` (B landmarks), ``performer`` (B features, a generator seeded per layer),
  ``sinkhorn`` (block size B).
- ``hybrid`` at B keys per query: 8 blocks of B/8 keys (the sink block, the query block's own
  block and its two neighbours, and 4 blocks chosen by score) or 16 blocks of B/16 (12 chosen),
  each with its ``score="mean"`` default and with ``score="mass"``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

import subquad
from subquad.compare.common import machine_info, md_table, source_state
from subquad.compare.fidelity import exact_reference, relative_error
from subquad.data.minilm import MAX_TOKENS, MODEL_NAME, capture_qkv, load_minilm
from subquad.hf.texts import stdlib_paragraphs

BUDGETS = (32, 64, 128)
QUICK_BUDGETS = (32, 64)
QUICK_LAYERS = 2
SEED = 0
SVD_ROW = "rank-r limit (SVD of exact attention, r = budget)"
HYBRID_ROW = "hybrid (8 blocks of B/8 keys: sink, own, 2 neighbours, 4 by score=mean)"

#: hybrid rows: (label, blocks of the budget, options besides the blocks). A block count c splits
#: B keys into c blocks of B/c keys: the sink block, the query block's own block and its two
#: neighbours, and c - 4 blocks selected by score.
HYBRID_VARIANTS = [
    (HYBRID_ROW, 8, {}),
    ("hybrid (8 blocks of B/8, score=mass)", 8, {"score": "mass"}),
    ("hybrid (16 blocks of B/16: sink, own, 2 neighbours, 12 by score=mean)", 16, {}),
    ("hybrid (16 blocks of B/16, score=mass)", 16, {"score": "mass"}),
]


def hybrid_options(budget: int, blocks: int) -> dict:
    """hybrid's options for ``blocks`` blocks of ``budget / blocks`` keys per query (queries in
    blocks of the same size)."""
    size = budget // blocks
    return {"query_block": size, "key_block": size, "num_blocks": blocks - 4, "sinks": 1, "local": 1}


def stdlib_text(tokenizer, tokens: int = MAX_TOKENS) -> tuple[str, int]:
    """Standard-library docstring paragraphs, in order, joined by blank lines until the tokenizer
    gives more than ``tokens`` tokens: ``(text, paragraphs used)``."""
    parts: list[str] = []
    for para in stdlib_paragraphs():
        parts.append(para)
        text = "\n\n".join(parts)
        if tokenizer(text, return_tensors="pt")["input_ids"].shape[1] > tokens:
            return text, len(parts)
    raise RuntimeError(f"the standard library's docstrings give fewer than {tokens} tokens")


def _weights(q, k) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 logits ``s q k^T`` and exact attention weights ``(1, H, N, M)``."""
    logits = (q.double() @ k.double().transpose(-2, -1)) * q.shape[-1] ** -0.5
    return logits, torch.softmax(logits, dim=-1)


class OneThread:
    """``with OneThread():`` torch on one thread. A batched SVD splits the batch over threads, and
    on a CPU whose other cores are busy that is a hundred times slower (about 100 s instead of 1 s
    for 12 matrices of 512 x 512)."""

    def __enter__(self):
        self.threads = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc):
        torch.set_num_threads(self.threads)


def svd_limit(factors, v, rank: int) -> torch.Tensor:
    """``A_r V`` with ``A_r`` the best rank-``rank`` approximation of each head's ``A`` (``factors``:
    its SVD)."""
    u, s, vh = factors
    a_r = (u[..., :rank] * s[..., None, :rank]) @ vh[..., :rank, :]
    return a_r @ v.double()


def block_local(logits, v, block: int) -> torch.Tensor:
    """Exact attention over the keys of the query's own contiguous block of ``block`` positions."""
    n, m = logits.shape[-2:]
    same = (torch.arange(n)[:, None] // block) == (torch.arange(m)[None, :] // block)
    return torch.softmax(logits.masked_fill(~same, float("-inf")), dim=-1) @ v.double()


def method_rows(budget: int, layer: int):
    """(label, callable(q, k, v)) for subquad's methods at ``budget``."""
    rows = [
        ("nystrom (num_landmarks = B)",
         lambda q, k, v: subquad.attention(q, k, v, method="nystrom", num_landmarks=budget)),
        ("lara (num_landmarks = B)",
         lambda q, k, v: subquad.attention(q, k, v, method="lara", num_landmarks=budget)),
        ("performer (num_features = B, generator seeded per layer)",
         lambda q, k, v: subquad.attention(q, k, v, method="performer", num_features=budget,
                                           generator=torch.Generator().manual_seed(SEED + layer))),
        ("sinkhorn (block_size = B)",
         lambda q, k, v: subquad.attention(q, k, v, method="sinkhorn", block_size=budget)),
    ]
    for label, blocks, options in HYBRID_VARIANTS:
        o = {**hybrid_options(budget, blocks), **options}
        rows.append((label, lambda q, k, v, o=o: subquad.attention(q, k, v, method="hybrid", **o)))
    return rows


def measure(cap: dict, layers: int, budgets: tuple[int, ...]) -> dict[str, dict[str, list[float]]]:
    """``{row: {budget: [error per layer]}}``."""
    errors: dict[str, dict[str, list[float]]] = {}

    def add(label, budget, value):
        errors.setdefault(label, {}).setdefault(str(budget), []).append(value)

    for i in range(layers):
        q, k, v = cap["q"][i], cap["k"][i], cap["v"][i]
        exact = exact_reference(q, k, v)
        logits, weights = _weights(q, k)
        with OneThread():
            factors = torch.linalg.svd(weights)
        for budget in budgets:
            start = time.perf_counter()
            add(SVD_ROW, budget, relative_error(svd_limit(factors, v, budget), exact))
            add("block-local (exact inside blocks of b = B keys)", budget,
                relative_error(block_local(logits, v, budget), exact))
            with torch.no_grad():
                for label, fn in method_rows(budget, i):
                    add(label, budget, relative_error(fn(q, k, v), exact))
            print(f"layer {i + 1}/{layers}, budget {budget}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return errors


def findings(means: dict[str, dict[str, float]], budgets) -> list[str]:
    """Sentences read off the numbers."""
    hyb, svd = means[HYBRID_ROW], means[SVD_ROW]
    out = []
    bars = [(b, limit) for b, limit in ((64, 0.20), (128, 0.10)) if str(b) in hyb]
    if bars:
        out.append("Hybrid with its defaults is at " + " and ".join(
            f"{hyb[str(b)]:.3f} at B = {b} ({'within' if hyb[str(b)] <= lim else 'above'} {lim:.2f})"
            for b, lim in bars) + ".")
    below = [b for b in budgets if hyb[str(b)] < svd[str(b)]]
    where = "every budget" if len(below) == len(budgets) else f"B in {below}" if below else "no budget"
    pairs = ", ".join(f"{hyb[str(b)]:.3f} vs {svd[str(b)]:.3f}" for b in budgets)
    out.append(f"It is below the rank-r SVD limit at {where} ({pairs}), the floor of any method whose "
               "attention matrix has rank at most B, such as nystrom (B landmarks) or performer (B features).")
    variants = {name: m for name, m in means.items() if name.startswith("hybrid") and name != HYBRID_ROW}
    beaten = [b for b in budgets if min(m[str(b)] for m in variants.values()) < hyb[str(b)]]
    runner = min(variants, key=lambda name: variants[name][str(budgets[-1])])
    worst = max(variants, key=lambda name: variants[name][str(budgets[-1])])
    out.append(("The defaults are the best hybrid row at every budget" if not beaten else
                f"A variant beats the defaults at B in {beaten}") +
               f"; at B = {budgets[-1]} the next best is {runner} ({variants[runner][str(budgets[-1])]:.3f}) "
               f"and the worst {worst} ({variants[worst][str(budgets[-1])]:.3f}).")
    others = ["nystrom (num_landmarks = B)", "lara (num_landmarks = B)",
              "performer (num_features = B, generator seeded per layer)", "sinkhorn (block_size = B)"]
    b = str(budgets[-1])
    best_seed = min((means[o][b], o.split(" ")[0]) for o in others)
    out.append(f"Of the other methods, {best_seed[1]} comes closest at B = {b} ({best_seed[0]:.3f}).")
    return out


def markdown(report: dict) -> str:
    cfg, cap = report["config"], report["capture"]
    budgets = cfg["budgets"]
    headers = ["method"] + [f"B = {b}" for b in budgets]
    body = [[name] + [f"{m[str(b)]:.3f}" for b in budgets] for name, m in report["means"].items()]
    lines = [
        "# Fidelity on real attention: all-MiniLM-L6-v2 Q, K, V",
        "",
        f"Model {cap['model']}; text: Python {cfg['python']} standard-library docstring paragraphs "
        f"(`subquad.hf.texts.stdlib_paragraphs()`, the first {cap['paragraphs']} in order, joined by blank lines "
        f"until the tokenizer gives more than {MAX_TOKENS} tokens: {cap['tokens_before_truncation']}), cut by "
        f"`capture_qkv` to N = {cap['tokens']} tokens. {cap['layers']} layers x {cap['heads']} heads, head dim "
        f"{cap['head_dim']}; exact attention on the capture reproduces the model's attention output to "
        f"{cap['check']:.1e}. Methods run in float32 on the float32 capture; the error is "
        "`|out - exact|_F / |exact|_F` against exact attention in float64, per layer over all heads, "
        f"then the mean over the {cap['layers']} layers (as `subquad compare --source minilm`). "
        f"subquad at {cfg['source']}; torch {cfg['torch']}, {cfg['cpu']}, {cfg['threads']} threads, "
        f"{cfg['date']}, {cfg['seconds']:.0f} s. "
        f"Command: `{cfg['command']}`",
        "",
        "B is the budget: r of the SVD limit, the block of the block-local baseline, landmarks (nystrom, lara), "
        "random features (performer), block size (sinkhorn), and the keys each query attends exactly in hybrid "
        "(blocks of B/8 or B/16 keys; queries in blocks of the same size).",
        "",
        md_table(headers, body),
        "",
        *findings(report["means"], budgets),
        "",
        "Per-layer errors are in the JSON next to this file.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_LAYERS} layers, budgets {QUICK_BUDGETS}")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    source = source_state(Path(__file__).parent)
    tokenizer, model = load_minilm()
    text, paragraphs = stdlib_text(tokenizer)
    cap = capture_qkv(text, tokenizer, model)
    layers = QUICK_LAYERS if args.quick else len(cap["q"])
    budgets = QUICK_BUDGETS if args.quick else BUDGETS
    errors = measure(cap, layers, budgets)
    _, heads, n, dim = cap["q"][0].shape
    info = machine_info(torch.device("cpu"))
    report = {
        "config": {"budgets": list(budgets), "seed": SEED, "torch": info["torch"], "python": info["python"],
                   "cpu": info["cpu"], "threads": info["threads"], "source": source,
                   "date": datetime.date.today().isoformat(),
                   "command": "python " + " ".join(["benchmarks/real_fidelity.py", *(argv or sys.argv[1:])]),
                   "seconds": time.perf_counter() - start},
        "capture": {"model": MODEL_NAME, "text": "stdlib_paragraphs() in order", "paragraphs": paragraphs,
                    "tokens": n, "tokens_before_truncation": cap["token_count_before_truncation"],
                    "truncated": cap["truncated"], "layers": layers, "heads": heads, "head_dim": dim,
                    "check": cap["check"]},
        "means": {name: {b: sum(x) / len(x) for b, x in per.items()} for name, per in errors.items()},
        "per_layer": errors,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "real_fidelity.json").write_text(json.dumps(report, indent=2) + "\n")
    text_md = markdown(report)
    (args.out / "real_fidelity.md").write_text(text_md)
    print(text_md)
    return report


if __name__ == "__main__":
    main()
