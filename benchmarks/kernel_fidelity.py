"""hybrid's compiled CPU kernel against its torch path on real attention: the same errors.

    python benchmarks/kernel_fidelity.py --out benchmarks/results

Inputs: all-MiniLM-L6-v2's Q, K, V at N = 512 (the capture of ``real_fidelity.py``: 6 layers x 12
heads, non-causal) and SmolLM2-135M-Instruct's causal Q, K, V at N = 2048 and 8192, layers 0, 3,
..., 27 (the captures of ``long_fidelity.py``, from ``smollm.cached_capture``). hybrid at its
defaults in float32, once through the kernel (what a CPU call without autograd runs) and once
through the torch path (what runs with gradients and on other devices); error
``|out - exact|_F / |exact|_F`` per layer against float64 exact attention. The table gives the mean
error of each path and the largest difference between the two over the layers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch

import subquad.ops.hybrid as hybrid
from subquad.compare import smollm
from subquad.compare.fidelity import exact_reference


CACHE_DIR = smollm.CACHE_DIR


def _output(q, k, v, causal: bool, scale: float, torch_path: bool) -> torch.Tensor:
    with torch.no_grad(), (hybrid.torch_path() if torch_path else contextlib.nullcontext()):
        return hybrid.hybrid_attention(q, k, v, causal=causal, scale=scale).double()


def _rows(name: str, layers: list[tuple]) -> dict:
    per: dict[str, list[float]] = {"kernel": [], "torch": []}
    for layer in layers:
        exact = exact_reference(*layer[:3], scale=layer[4], causal=layer[3])
        for path in per:
            out = _output(*layer, torch_path=path == "torch")
            per[path].append(float((out - exact).norm() / exact.norm()))
    diff = max(abs(a - b) for a, b in zip(per["kernel"], per["torch"]))
    row = {"workload": name, "layers": len(layers), **{f"{p}_mean": sum(x) / len(x) for p, x in per.items()},
           "max_layer_difference": diff, "per_layer": per}
    print(f"{name}: kernel {row['kernel_mean']:.6f}, torch {row['torch_mean']:.6f}, largest difference {diff:.2e}",
          flush=True)
    return row


def minilm_layers() -> list[tuple]:
    sys.path.insert(0, str(Path(__file__).parent))
    from real_fidelity import stdlib_text
    from subquad.compare.minilm import capture_qkv
    from subquad.pretrained import load_minilm

    tokenizer, model = load_minilm()
    cap = capture_qkv(stdlib_text(tokenizer)[0], tokenizer, model)
    return [(q.float(), k.float(), v.float(), False, q.shape[-1] ** -0.5) for q, k, v in zip(cap["q"], cap["k"],
                                                                                              cap["v"])]


def smollm_layers(n: int) -> list[tuple]:
    cap = smollm.cached_capture(n, smollm.default_layers(), cache_dir=CACHE_DIR)
    return [(q, k, v, True, cap["scale"]) for q, k, v in zip(cap["q"], cap["k"], cap["v"])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    start = time.time()
    rows = [_rows("MiniLM, N = 512", minilm_layers())]
    rows += [_rows(f"SmolLM2, N = {n}", smollm_layers(n)) for n in args.n]
    lines = ["# hybrid's kernel and torch path on real attention", "",
             f"hybrid defaults, float32; error against float64 exact attention, mean over layers. Command: "
             f"`python benchmarks/kernel_fidelity.py {' '.join(sys.argv[1:])}`, {time.strftime('%Y-%m-%d')}, "
             f"{time.time() - start:.0f} s.", "",
             "| workload | layers | kernel | torch path | largest difference in one layer's error |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['workload']} | {r['layers']} | {r['kernel_mean']:.6f} | {r['torch_mean']:.6f} | "
              f"{r['max_layer_difference']:.1e} |" for r in rows]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kernel_fidelity.json").write_text(json.dumps(rows, indent=1))
    (args.out / "kernel_fidelity.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
