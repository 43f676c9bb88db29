"""subquad's NMF Hamburger against exact self-attention and the pip package hamburger-pytorch 0.0.3.

    pip install --no-deps hamburger-pytorch==0.0.3 einops   # the peer, dev-time only (optional)
    python benchmarks/hamburger.py --out benchmarks/results

One feature map ``(1, C, H, W)`` (default 512 x 128 x 128, N = 16384 positions), float32
forward under ``no_grad``, medians of ``torch.utils.benchmark`` ``blocked_autorange`` in one run:

- blocks: ``subquad.layers.Hamburger`` (V1: lower bread + ReLU, NMF ham with R = 64 and K = 6
  local steps, upper bread, BatchNorm, residual) vs ``subquad.MultiheadAttention`` with 8 heads
  (exact softmax attention with its q/k/v/out projections) on the N tokens of the same map, vs
  the peer's ``Hamburger(dim=C, n=N, ratio=C/R, K=6)`` (its breads, no norm, no residual);
- cores: the NMF op (``subquad.ops.nmf``) vs ``scaled_dot_product_attention`` with 8 heads vs
  the peer's ``NMF`` module, on the same non-negative ``(1, C, N)`` input.

Then the relative reconstruction error ``|X - X_hat| / |X|`` after each NMF step on
``X = relu(N(0, 1))`` of the same size, for both implementations. Ours: the output after k
local steps and the final coefficient step. The peer: its output with K = k (its parameters
D, C are its random init; it updates both factors from the old pair, all but the last step
without gradient).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import subquad
from subquad.compare.fidelity import relative_error
from subquad.compare.timing import median_time
from subquad.layers import Hamburger
from subquad.ops import decomposition as dec


def median(values):
    return float(torch.tensor(values, dtype=torch.float64).median())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--channels", type=int, default=512)
    p.add_argument("--size", type=int, default=128, help="H = W of the feature map")
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--error-steps", type=int, default=8, help="report the error after 1..this many steps")
    p.add_argument("--rounds", type=int, default=3, help="rounds over all timings (interleaved, see below)")
    p.add_argument("--min-run-time", type=float, default=3.0, help="seconds per measurement (fast methods)")
    p.add_argument("--min-run-time-attention", type=float, default=1.0, help="seconds per exact-attention timing")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    try:
        import hamburger_pytorch
    except ImportError:
        hamburger_pytorch = None
        print("hamburger-pytorch is not installed (pip install --no-deps hamburger-pytorch==0.0.3 einops): "
              "the peer columns are skipped")

    C, side, R, K, heads = args.channels, args.size, args.rank, args.steps, args.heads
    N = side * side
    torch.manual_seed(0)
    z = torch.randn(1, C, side, side)
    tokens = z.flatten(2).transpose(1, 2).contiguous()  # (1, N, C)
    ours = Hamburger(C, rank=R, train_steps=K, eval_steps=K).eval()
    attention = subquad.MultiheadAttention(C, heads, batch_first=True).eval()
    peer = peer_nmf = None
    if hamburger_pytorch is not None:
        peer = hamburger_pytorch.Hamburger(dim=C, n=N, ratio=C // R, K=K).eval()
        peer_nmf = peer.ham
    with torch.no_grad():
        x_ham = F.relu(ours.lower_bread(z)).flatten(2)  # (1, C, N), non-negative
        q = torch.randn(1, heads, N, C // heads)
        k, v = torch.randn_like(q), torch.randn_like(q)
    qkv = (q, k, v)

    blocks = {
        "subquad Hamburger (NMF, V1)": (lambda t: ours(t), z, args.min_run_time),
        f"exact self-attention, {heads} heads (subquad.MultiheadAttention)":
            (lambda t: attention(t, t, t)[0], tokens, args.min_run_time_attention),
    }
    cores = {
        "subquad NMF op": (lambda t: dec.nmf(t, R, steps=K), x_ham, args.min_run_time),
        f"exact attention core, {heads} heads (SDPA)":
            (lambda t: F.scaled_dot_product_attention(*t), qkv, args.min_run_time_attention),
    }
    if peer is not None:
        blocks["hamburger-pytorch 0.0.3 Hamburger"] = (lambda t: peer(t), z, args.min_run_time)
        cores["hamburger-pytorch 0.0.3 NMF"] = (lambda t: peer_nmf(t), x_ham, args.min_run_time)

    # Interleaved rounds: every round times every entry once, so the two sides of a ratio are
    # measured minutes apart at most; a speed-up is the median of its per-round ratios.
    entries = [("blocks", name, spec) for name, spec in blocks.items()]
    entries += [("cores", name, spec) for name, spec in cores.items()]
    rounds = {group: {name: [] for name in names} for group, names in (("blocks", blocks), ("cores", cores))}
    with torch.no_grad():
        for r in range(args.rounds):
            for group, name, (fn, arg, min_time) in entries:
                timing = median_time(lambda: fn(arg), min_time)  # noqa: B023 (called at once)
                seconds, runs, load = timing.seconds, len(timing.times), os.getloadavg()[0]
                rounds[group][name].append({"median_s": seconds, "runs": runs, "load_after": load})
                print(f"round {r}: {group}: {name}: {seconds:.3f} s ({runs} runs, load {load:.1f})", flush=True)
        # reconstruction error after each step on relu(N(0, 1))
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(1, C, N, generator=gen).relu_()
        bases0 = dec.random_bases(1, C, R, distribution="uniform", generator=gen)
        steps = list(range(1, args.error_steps + 1))
        errors = {"steps": steps, "subquad": [relative_error(dec.nmf(x, bases=bases0, steps=s), x) for s in steps]}
        print("subquad errors", errors["subquad"], flush=True)
        if hamburger_pytorch is not None:
            state = peer_nmf.state_dict()
            peer_errors = []
            for s in steps:
                stepped = hamburger_pytorch.hamburger_pytorch.NMF(C, N, ratio=C // R, K=s)
                stepped.load_state_dict(state)
                peer_errors.append(relative_error(stepped(x), x))
            errors["hamburger-pytorch"] = peer_errors
            print("peer errors", peer_errors, flush=True)

    def ratio(group, slow, fast):
        pairs = zip(rounds[group][slow], rounds[group][fast])
        return median([a["median_s"] / b["median_s"] for a, b in pairs])

    timings = {group: {name: {"median_s": median([m["median_s"] for m in ms]),
                              "per_round_s": [m["median_s"] for m in ms],
                              "runs": sum(m["runs"] for m in ms)}
                       for name, ms in rounds[group].items()}
               for group in rounds}

    names_b, names_c = list(blocks), list(cores)
    speedups = {
        "block: exact attention / subquad Hamburger": ratio("blocks", names_b[1], names_b[0]),
        "core: exact attention / subquad NMF": ratio("cores", names_c[1], names_c[0]),
    }
    if peer is not None:
        speedups["block: hamburger-pytorch / subquad Hamburger"] = ratio("blocks", names_b[2], names_b[0])
        speedups["core: hamburger-pytorch NMF / subquad NMF"] = ratio("cores", names_c[2], names_c[0])

    loads = [m["load_after"] for g in rounds.values() for ms in g.values() for m in ms]
    cmd = "python benchmarks/hamburger.py " + " ".join(argv if argv is not None else sys.argv[1:])
    md = [
        "# Hamburger (NMF) vs exact self-attention and hamburger-pytorch 0.0.3",
        "",
        (f"Feature map 1 x {C} x {side} x {side} (N = {N}), R = {R}, K = {K} local steps, float32 forward under "
        f"no_grad, {torch.get_num_threads()} threads, torch {torch.__version__}, {platform.processor() or 'cpu'}. "
        f"Command: `{cmd.strip()}`. One run of the script: {args.rounds} interleaved rounds, each timing every "
        "row once with `torch.utils.benchmark` `blocked_autorange`; a time is the median of the round medians, "
        "a speed-up the median of the per-round ratios."),
        "",
        (f"The machine is shared: the 1-minute load average during the timings ranged from {min(loads):.1f} "
        f"to {max(loads):.1f} on {os.cpu_count()} cores, so absolute times are disturbed; compare ratios."),
        "",
        "| forward | median | per round | timed runs |",
        "|---|---|---|---|",
    ]
    for group in ("blocks", "cores"):
        for name, t in timings[group].items():
            per_round = ", ".join(f"{s * 1e3:.0f}" for s in t["per_round_s"])
            md.append(f"| {group[:-1]}: {name} | {t['median_s'] * 1e3:.0f} ms | {per_round} ms | {t['runs']} |")
    md += ["", "| speed-up | x |", "|---|---|"]
    md += [f"| {k} | {v:.1f} |" for k, v in speedups.items()]
    md += [
        "",
        ("Blocks: subquad's V1 block (lower bread + ReLU, ham, upper bread + BatchNorm, ReLU residual; the "
        "upper bread is applied to the factors) vs `subquad.MultiheadAttention` (q/k/v/out projections + "
        "exact attention) on the map's tokens vs the peer's block (two bias-free 1x1 convs around its NMF, "
        "no norm, no residual). Cores: the NMF alone vs exact attention alone on the same N."),
        "",
        "## Reconstruction error after each NMF step, X = relu(N(0, 1))",
        "",
        "| steps | " + " | ".join(str(s) for s in errors["steps"]) + " |",
        "|---|" + "---|" * len(errors["steps"]),
        "| subquad | " + " | ".join(f"{e:.4f}" for e in errors["subquad"]) + " |",
    ]
    if "hamburger-pytorch" in errors:
        md.append("| hamburger-pytorch 0.0.3 | " + " | ".join(f"{e:.4f}" for e in errors["hamburger-pytorch"]) + " |")
    md += [
        "",
        ("`|X - X_hat|_F / |X|_F`. subquad: k multiplicative-update steps (coefficients, then bases with the "
        "new coefficients) from unit-norm U(0, 1) bases, then the gradient-carrying coefficient step; "
        "the error never increases. hamburger-pytorch: its module run with K = k from its own initial "
        "factors; it updates both factors from the old pair at once."),
    ]
    if hamburger_pytorch is None:
        md += ["", "hamburger-pytorch was not installed: its rows are missing."]
    text = "\n".join(md) + "\n"
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "hamburger.md").write_text(text)
        (args.out / "hamburger.json").write_text(json.dumps(
            {"channels": C, "size": side, "n": N, "rank": R, "steps": K, "heads": heads,
             "threads": torch.get_num_threads(), "torch": torch.__version__, "command": cmd.strip(),
             "rounds": rounds, "timings": timings, "speedups": speedups, "errors": errors}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
