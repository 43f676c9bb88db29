"""hybrid forward and forward+backward against the dense kernels.

    python benchmarks/hybrid_fwd_bwd.py 4096 16384

B=1, H=8, D=64, float32, i.i.d. inputs, default options, 2 threads: hybrid, SDPA and a plain
``softmax(q k^T) v`` in query blocks of 1024; medians of 3 interleaved rounds in one run. Prints
one line per N and pass; ``benchmarks/results/hybrid_fwd_bwd.md`` holds a run's output.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.nn.functional as F

from subquad.ops.hybrid import hybrid_attention


def blocked(q, k, v, block: int = 1024):
    """Exact attention, ``block`` queries at a time (plain matmuls and softmax)."""
    s = q.shape[-1] ** -0.5
    return torch.cat([torch.softmax(q[:, :, i:i + block] @ k.mT * s, -1) @ v for i in range(0, q.shape[2], block)], 2)


KERNELS = {"hybrid": hybrid_attention, "sdpa": F.scaled_dot_product_attention, "blocked": blocked}


def seconds(fn, q, k, v, backward: bool) -> float:
    if not backward:
        with torch.no_grad():
            start = time.perf_counter()
            fn(q, k, v)
            return time.perf_counter() - start
    a, b, c = (x.clone().requires_grad_() for x in (q, k, v))
    start = time.perf_counter()
    fn(a, b, c).sum().backward()
    return time.perf_counter() - start


def main(lengths: list[int]) -> None:
    torch.set_num_threads(2)
    for n in lengths:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 8, n, 64, generator=g) for _ in range(3))
        times: dict[tuple[str, bool], list[float]] = {}
        for _ in range(3):
            for name, fn in KERNELS.items():
                for backward in (False, True):
                    times.setdefault((name, backward), []).append(seconds(fn, q, k, v, backward))
        for backward in (False, True):
            m = {name: statistics.median(times[name, backward]) for name in KERNELS}
            best = min(m["sdpa"], m["blocked"])
            print(f"N={n} {'fwd+bwd' if backward else 'fwd'}: hybrid {m['hybrid']:.3f} s, sdpa {m['sdpa']:.3f} s, "
                  f"blocked {m['blocked']:.3f} s; best dense / hybrid {best / m['hybrid']:.2f}x", flush=True)


if __name__ == "__main__":
    main([int(x) for x in sys.argv[1:]] or [4096, 16384])
