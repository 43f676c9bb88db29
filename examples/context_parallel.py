"""Context-parallel attention on two processes: each holds half of a 16k-token sequence, and the
sharded output and gradients match the single-process op on the whole sequence.

    torchrun --nproc_per_node=2 examples/context_parallel.py

(gloo on the CPU; with CUDA, init with "nccl" and move the tensors to the rank's GPU.)
"""

import torch
import torch.distributed as dist

import subquad
import subquad.distributed as sqd

dist.init_process_group("gloo")
rank = dist.get_rank()
g = torch.Generator().manual_seed(0)  # every rank draws the same whole sequence, to check against
q, k, v = (torch.randn(1, 4, 16384, 64, generator=g) for _ in range(3))

for method in sqd.supported_methods():
    if method in ("efficient", "softmax"):  # efficient is not causal; exact attention is slow to check here
        continue
    # performer draws its projection: the same seed for both runs (the sharded run uses rank 0's draw)
    options = (lambda: {"generator": torch.Generator().manual_seed(1)}) if method == "performer" else dict
    mine = [sqd.shard(t, dim=2).requires_grad_() for t in (q, k, v)]  # this rank's tokens
    out = sqd.attention(*mine, method=method, causal=True, **options())  # this rank's rows of the output
    out.square().sum().backward()
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = subquad.attention(*whole, method=method, causal=True, **options())
    ref.square().sum().backward()
    pairs = [(out, ref), *((m.grad, w.grad) for m, w in zip(mine, whole))]  # output, dq, dk, dv
    error = max(((a - sqd.shard(b, dim=2)).abs().max() / b.abs().max()).item() for a, b in pairs)
    if rank == 0:
        print(f"{method:10s} rank 0 holds {out.shape[2]} of {q.shape[2]} tokens; largest difference to one "
              f"process (output, dq, dk, dv), relative to the largest value: {error:.1e}")
    assert error < 1e-4, (method, error)

dist.destroy_process_group()
