"""hybrid forward and forward+backward against the dense kernels. Usage:

    python benchmarks/hybrid_fwd_bwd.py 4096 16384

Forward and forward+backward at N, B=1 H=8 D=64 fp32 2 threads: hybrid, SDPA, a blocked plain
softmax(q k^T) v; medians of interleaved rounds in one run."""
import torch, time, sys, statistics
import torch.nn.functional as F
from subquad.ops.hybrid import hybrid_attention
torch.set_num_threads(2)
def blocked(q, k, v, bs=1024):
    s = q.shape[-1] ** -0.5
    return torch.cat([torch.softmax(q[:, :, i:i + bs] @ k.mT * s, -1) @ v for i in range(0, q.shape[2], bs)], 2)
for N in [int(x) for x in sys.argv[1:]]:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, N, 64, generator=g) for _ in range(3))
    fns = {"hybrid": lambda a, b, c: hybrid_attention(a, b, c), "sdpa": F.scaled_dot_product_attention, "blocked": blocked}
    t = {}
    for r in range(3):
        for name, f in fns.items():
            with torch.no_grad():
                t0 = time.perf_counter(); f(q, k, v); t.setdefault((name, "fwd"), []).append(time.perf_counter() - t0)
            a, b, c = (x.clone().requires_grad_() for x in (q, k, v))
            t0 = time.perf_counter(); f(a, b, c).sum().backward(); t.setdefault((name, "fwd+bwd"), []).append(time.perf_counter() - t0)
    for kind in ("fwd", "fwd+bwd"):
        m = {n: statistics.median(t[(n, kind)]) for n in fns}
        best = min(m["sdpa"], m["blocked"])
        print(f"N={N} {kind}: hybrid {m['hybrid']:.3f} s, sdpa {m['sdpa']:.3f} s, blocked {m['blocked']:.3f} s; best dense / hybrid {best / m['hybrid']:.2f}x", flush=True)
