"""Cost of the segmenter's global-context block: Hamburger against attention cores, on feature
maps of growing size (where Geng et al. 2021, arXiv 2109.04553, place their cost claim: HamNet's
block on a 1/8-resolution map).

    python benchmarks/context_block_cost.py --out benchmarks/results          # C = 512, maps 32..96

The block is :class:`subquad.models.segmenter.ContextBlock` around
:func:`~subquad.models.segmenter.context_mixer`, as the digit_scenes model builds it: the breads
(1x1 convolutions) and BatchNorm are the same for every core; the core is Hamburger's NMF ham
(rank 64 at C = 512, 6 local steps in training, one-step gradient), exact softmax attention
(``heads`` heads on the breads' output, SDPA: on the CPU a flash kernel that never forms the
N x N map), ``softmax-map`` (the same under SDPA's math kernel, which forms the map and keeps it
for the backward, as the non-local block, Wang et al. 2018, arXiv 1711.07971, and the attention
modules the paper compares with do) or a linear-cost attention method. Input
``(1, C, S, S)``, float32, training mode, ``--threads`` threads. Time: median of
``torch.utils.benchmark`` ``blocked_autorange`` per block in interleaved rounds, forward under
``no_grad`` and forward + backward (``sum().backward()`` into the block's parameters and the
input). Peak memory: the rise of the process's resident high-water mark over the call, each point
in a fresh process (:mod:`subquad.compare.memory`'s method: mmap threshold 64 KiB, so freed
tensors go back to the system).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import contextlib

import torch
import torch.utils.benchmark as benchmark
from torch.nn.attention import SDPBackend, sdpa_kernel

from subquad.compare.common import machine_info, md_table, source_state
from subquad.models.segmenter import ContextBlock, context_mixer


#: the softmax core under SDPA's math kernel, which forms the attention map
FORMS_MAP = "softmax-map"


def block(method: str, channels: int, heads: int) -> ContextBlock:
    torch.manual_seed(0)
    mixer_heads = 1 if method == "hamburger" else heads  # the ham's rank follows C / heads: 64 at C = 512
    model = ContextBlock(context_mixer("softmax" if method == FORMS_MAP else method, channels, mixer_heads), channels)
    model.forms_map = method == FORMS_MAP
    return model.train()


def _call(model, x, backward: bool):
    with sdpa_kernel([SDPBackend.MATH]) if model.forms_map else contextlib.nullcontext():
        if not backward:
            with torch.no_grad():
                return model(x)
        x = x.detach().requires_grad_()
        model(x).sum().backward()
        return x.grad


def peak(spec: dict) -> int:
    """Peak bytes of one call, in this process (run by :func:`peak_in_subprocess`)."""
    from subquad.compare.memory import peak_bytes

    torch.set_num_threads(spec["threads"])
    model = block(spec["method"], spec["channels"], spec["heads"])
    _call(model, torch.randn(1, spec["channels"], 8, 8), spec["backward"])  # warm-up: pools, kernels
    x = torch.randn(1, spec["channels"], spec["size"], spec["size"])
    return peak_bytes(lambda: _call(model, x, spec["backward"]))


def peak_in_subprocess(spec: dict) -> int:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run([sys.executable, __file__, "--peak", json.dumps(spec)], capture_output=True, text=True,
                         env=env, check=True)
    return int(out.stdout.strip().splitlines()[-1])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--methods", nargs="+", default=["hamburger", "softmax", FORMS_MAP, "efficient", "linear"])
    p.add_argument("--sizes", type=int, nargs="+", default=[32, 64, 96], help="S: maps of S x S positions")
    p.add_argument("--channels", type=int, default=512)
    p.add_argument("--heads", type=int, default=8, help="heads of the attention cores")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--min-run-time", type=float, default=1.0)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--peak", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.peak:
        print(peak(json.loads(args.peak)))
        return None
    torch.set_num_threads(args.threads)
    start = datetime.datetime.now()
    rows = []
    for size in args.sizes:
        x = torch.randn(1, args.channels, size, size)
        models = {m: block(m, args.channels, args.heads) for m in args.methods}
        for backward in (False, True):
            times = {m: [] for m in args.methods}
            for m in args.methods:
                _call(models[m], x, backward)
            for _ in range(args.rounds):
                for m in args.methods:
                    t = benchmark.Timer("f(model, x, backward)", num_threads=args.threads,
                                        globals={"f": _call, "model": models[m], "x": x, "backward": backward})
                    times[m].append(t.blocked_autorange(min_run_time=args.min_run_time).median)
            for m in args.methods:
                spec = {"method": m, "channels": args.channels, "heads": args.heads, "size": size,
                        "backward": backward, "threads": args.threads}
                rows.append({"size": size, "n": size * size, "method": m, "backward": backward,
                             "seconds": statistics.median(times[m]), "rounds": times[m],
                             "peak_bytes": peak_in_subprocess(spec)})
                print(json.dumps(rows[-1]), flush=True)
    report = {"config": {**vars(args), "out": str(args.out), **machine_info(torch.device("cpu")),
                         "source": source_state(Path(__file__).parent), "date": start.date().isoformat(),
                         "command": "python benchmarks/context_block_cost.py " + " ".join(sys.argv[1:])},
              "rows": rows}
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "context_block_cost.json").write_text(json.dumps(report, indent=1) + "\n")
        (args.out / "context_block_cost.md").write_text(markdown(report))
    print(markdown(report))
    return report


def markdown(report: dict) -> str:
    c = report["config"]
    rows = report["rows"]
    lines = ["# Cost of the segmenter's context block: Hamburger against attention cores", "",
             __doc__.split("\n\n", 2)[2].strip().replace("\n", " "), "",
             f"C = {c['channels']}, {c['heads']} attention heads; {c['cpu']}, torch {c['torch']}, "
             f"{c['threads']} threads, {c['date']}, {c['source']}. Command: `{c['command']}`", ""]
    body = []
    for r in rows:
        ham = next(h for h in rows if h["method"] == "hamburger" and h["size"] == r["size"]
                   and h["backward"] == r["backward"]) if any(h["method"] == "hamburger" for h in rows) else r
        body.append([f"{r['size']} x {r['size']} ({r['n']})", "fwd+bwd" if r["backward"] else "forward", r["method"],
                     f"{1e3 * r['seconds']:.1f}", f"{r['seconds'] / ham['seconds']:.2f}",
                     f"{r['peak_bytes'] / 2**20:.0f}", f"{r['peak_bytes'] / max(1, ham['peak_bytes']):.2f}"])
    lines += [md_table(["map (positions)", "pass", "core", "ms", "time / Hamburger's", "peak MiB",
                        "peak / Hamburger's"], body), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
