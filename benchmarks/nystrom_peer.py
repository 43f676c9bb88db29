"""subquad's Nyström attention against the pip package nystrom-attention 0.0.14.

    pip install nystrom-attention==0.0.14 einops      # the `peers` extra; dev-time only
    python benchmarks/nystrom_peer.py --out benchmarks/results

Equal settings: 64 landmarks, 6 pseudo-inverse iterations, no conv skip, the same q, k, v.
The peer's module is run with its projections replaced by the identity on a prepared
``(B, N, 3 H D)`` tensor, so both sides time the attention core from the same q/k/v views to
the merged ``(B, N, H D)`` output. Errors are relative Frobenius errors to exact attention
computed in float64; timings are medians of torch.utils.benchmark in one run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn as nn

import subquad
from subquad.compare.fidelity import exact_reference, relative_error
from subquad.compare.timing import median_time


class _Fixed(nn.Module):
    """Stands in for the peer's qkv projection: returns a prepared tensor."""

    def __init__(self, qkv):
        super().__init__()
        self.qkv = qkv

    def forward(self, x):
        return self.qkv


def inputs(kind: str, n: int, heads: int, dim: int, gen: torch.Generator) -> torch.Tensor:
    """``(1, n, 3 * heads * dim)``: ``iid`` N(0, 1) entries, or ``smooth`` (a random walk along the
    sequence, normalised per token, so neighbouring tokens are similar, as in real text)."""
    if kind == "iid":
        return torch.randn(1, n, 3 * heads * dim, generator=gen)
    walk = torch.randn(1, n, 3 * heads * dim, generator=gen).cumsum(1) / n**0.5
    walk = walk.unflatten(-1, (3 * heads, dim))
    walk = (walk - walk.mean(-1, keepdim=True)) / walk.std(-1, keepdim=True)
    return walk.flatten(-2)


def split(qkv, heads, dim):
    q, k, v = qkv.chunk(3, dim=-1)
    return [t.unflatten(-1, (heads, dim)).transpose(1, 2) for t in (q, k, v)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=16384)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--landmarks", type=int, default=64)
    p.add_argument("--min-run-time", type=float, default=2.0)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    try:
        from nystrom_attention import NystromAttention
    except ImportError:
        print("nystrom-attention is not installed: pip install nystrom-attention==0.0.14 einops")
        return 2
    H, D, n, m = args.heads, args.dim, args.n, args.landmarks
    gen = torch.Generator().manual_seed(0)
    peer = NystromAttention(dim=H * D, dim_head=D, heads=H, num_landmarks=m, pinv_iterations=6, residual=False)
    peer.to_out = nn.Identity()
    peer.eval()

    def ours(qkv, init="per_matrix"):
        q, k, v = split(qkv, H, D)
        out = subquad.attention(q, k, v, method="nystrom", num_landmarks=m, pinv_iterations=6, pinv_init=init)
        return out.transpose(1, 2).flatten(2)

    def theirs(qkv):
        peer.to_qkv = _Fixed(qkv)
        return peer(qkv[..., : H * D])

    rows = []
    with torch.no_grad():
        for kind in ("iid", "smooth"):
            qkv = inputs(kind, n, H, D, gen)
            ref = exact_reference(*split(qkv, H, D)).transpose(1, 2).flatten(2)
            row = {"inputs": kind,
                   "err_ours": relative_error(ours(qkv), ref),
                   "err_ours_global_init": relative_error(ours(qkv, "global"), ref),
                   "err_peer": relative_error(theirs(qkv), ref)}
            rows.append(row)
            print(row)
        qkv = inputs("iid", n, H, D, gen)
        t = {}
        for name, fn in (("ours", ours), ("peer", theirs)):
            t[name] = median_time(lambda: fn(qkv), args.min_run_time).seconds  # noqa: B023 (called at once)
            print(name, t[name])
    speedup = t["peer"] / t["ours"]
    cmd = "python benchmarks/nystrom_peer.py " + " ".join(argv if argv is not None else sys.argv[1:])
    md = [
        "# Nyström: subquad vs nystrom-attention 0.0.14",
        "",
        f"N={n}, B=1, H={H}, D={D}, {m} landmarks, 6 pinv iterations, no conv skip, float32 forward, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}. Command: `{cmd.strip()}`",
        "",
        "| inputs | subquad (per-matrix init, default) | subquad (global init) | nystrom-attention |",
        "|---|---|---|---|",
        *[f"| {r['inputs']} | {r['err_ours']:.4f} | {r['err_ours_global_init']:.4f} | {r['err_peer']:.4f} |"
          for r in rows],
        "",
        "Relative Frobenius error to exact attention (float64 reference).",
        "",
        "| core time (median) | subquad | nystrom-attention | speed-up |",
        "|---|---|---|---|",
        f"| ms | {t['ours'] * 1e3:.1f} | {t['peer'] * 1e3:.1f} | {speedup:.2f}x |",
        "",
    ]
    text = "\n".join(md)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "nystrom_peer.md").write_text(text)
        (args.out / "nystrom_peer.json").write_text(json.dumps(
            {"n": n, "heads": H, "dim": D, "landmarks": m, "errors": rows, "seconds": t, "speedup": speedup}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
