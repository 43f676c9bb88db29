"""How many keys MagicPIG attends per query on SmolLM2-135M-Instruct's real causal attention: its
static keys plus the expected number it samples, ``sum over the other visible keys of u`` (``u``
the probability that a key is sampled, from the angle between query and key: a key is kept with
probability u, so this is the mean of the sample size over hash draws). The budget to read its
error in benchmarks/results/sparse_peers/ against the sparse methods' equal-budget rows.

    python benchmarks/magicpig_budget.py --n 4096 --rows "" num_bits=10,num_tables=150 \\
        --out benchmarks/results/sparse_peers/magicpig_n4096/budget.md

Same capture and layers as long_fidelity.py (layers 0, 3, ..., 27; q and k after the rotary embedding).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from subquad import get_method
from subquad.cli_base import parse_value
from subquad.data import smollm
from subquad.ops.magicpig import collision_log_probability, static_keys


def expected_keys(q: torch.Tensor, k: torch.Tensor, o) -> torch.Tensor:
    """``(H, N)``: static keys plus the expected sample of each causal query, q ``(H, N, D)``, k ``(H, N, D)``."""
    H, N, _ = q.shape
    visible = torch.ones(N, N, dtype=torch.bool).tril()
    static = static_keys(None, 0, N, N, True, o.sinks, o.local, q.device)[0, 0]  # (N, N)
    out = torch.empty(H, N)
    for h in range(H):
        cos = torch.nn.functional.normalize(q[h], dim=-1) @ torch.nn.functional.normalize(k[h], dim=-1).T
        u = collision_log_probability(cos.double(), o.num_bits, o.num_tables, o.min_matches).exp()
        out[h] = (static & visible).sum(-1) + (u * (visible & ~static)).sum(-1).float()
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--layers", type=int, nargs="+", default=list(range(0, 30, 3)))
    p.add_argument("--rows", nargs="+", default=[""], metavar="NAME=VALUE,...", help='options per row ("": defaults)')
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    cap = smollm.cached_capture(args.n, args.layers, log=lambda s: print(s, file=sys.stderr))
    lines = [f"# MagicPIG's keys per query on SmolLM2-135M-Instruct, N = {args.n}", "",
             "Static keys plus the expected sample (sum of u over the other visible keys), mean over the "
             f"9 heads and the queries, at layers {args.layers}; last quarter: the queries at positions 3N/4 on. "
             f"Command: `python benchmarks/magicpig_budget.py {' '.join(argv if argv is not None else sys.argv[1:])}`",
             "", "| options | keys per query (mean over layers) | last quarter | per layer |", "|---|---|---|---|"]
    for row in args.rows:
        options = {key: parse_value(v) for key, _, v in (pair.partition("=") for pair in row.split(",") if pair)}
        o = get_method("magicpig").make_options(**options)
        per_layer, late = [], []
        for i, layer in enumerate(cap["layers"]):
            q, k = cap["q"][i][0], cap["k"][i][0]  # (H, N, D), k repeated over its query heads
            keys = expected_keys(q, k, o)
            per_layer.append(keys.mean().item())
            late.append(keys[:, 3 * args.n // 4:].mean().item())
            print(f"{row or 'defaults'} layer {layer}: {per_layer[-1]:.0f} keys", file=sys.stderr, flush=True)
        cells = ", ".join(f"{x:.0f}" for x in per_layer)
        lines.append(f"| {row or 'defaults'} | {sum(per_layer) / len(per_layer):.0f} | {sum(late) / len(late):.0f} "
                     f"| {cells} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
