"""Peak memory of one method's forward (no grad) and forward+backward, beyond its inputs.

On CPU every point runs in a fresh Python process, so allocations of earlier points (and
allocator caches) cannot hide or inflate it::

    python -m subquad.compare.memory '{"method": "nystrom", "n": 4096, "batch": 1, "heads": 8, "dim": 64}'

prints one JSON line with ``forward_bytes`` and ``forward_backward_bytes``: the rise of the
resident set's high-water mark over the resident set just before the call, with the inputs
(and, for the backward, the output gradient) already allocated.

How, on Linux: the high-water mark is reset before each phase (``/proc/self/clear_refs``) and
read from ``VmHWM`` in ``/proc/self/status``. ``resource.getrusage``'s ``ru_maxrss`` is the
fallback elsewhere; on Linux it cannot be used here, because it keeps the resident set of the
parent that forked the process (often larger than the point measured) and ignores the reset.
:func:`measure_in_subprocess` starts the process with glibc's mmap threshold fixed at 64 KiB,
so every tensor gets its own mapping and is returned to the system when freed (by default,
memory freed earlier is reused silently and a peak can hide in it). A warm-up at a tiny length
first initialises thread pools and kernels. On CUDA the same phases run in-process and read
``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import subprocess
import sys
from typing import Any

import torch

__all__ = ["measure", "measure_in_subprocess", "peak_bytes", "main"]

_WARMUP_N = 64


def _current_rss() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None


def _high_water_mark() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def _reset_high_water_mark() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_cpu(fn) -> int:
    gc.collect()
    reset = _reset_high_water_mark()
    current = _current_rss()
    # without a reset the old high-water mark is the only safe baseline (an underestimate
    # when the call stays below it)
    base = current if (reset and current is not None) else _high_water_mark()
    result = fn()
    peak = _high_water_mark()
    del result
    return max(0, peak - base)


def _peak_cuda(fn, device) -> int:
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    result = fn()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del result
    return max(0, peak - base)


def peak_bytes(fn, device: torch.device | str = "cpu") -> int:
    """The peak memory ``fn()`` takes beyond what was allocated before it: on CPU the rise of the
    resident high-water mark (meaningful in a fresh process started as
    :func:`measure_in_subprocess` starts one), on CUDA ``torch.cuda.max_memory_allocated``."""
    device = torch.device(device)
    return _peak_cuda(fn, device) if device.type == "cuda" else _peak_cpu(fn)


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one point in this process. ``spec``: method, options (dict), batch, heads, n, dim,
    dtype (name), device, seed, backward (bool), threads, causal and compiled (optional, bool: the
    calls of :func:`~subquad.compare.workload.forward_call`).

    Returns ``{"forward_bytes", "forward_backward_bytes", "forward_error", "backward_error"}``;
    a phase that raised has its bytes None and its error message set."""
    import subquad

    from .workload import DTYPES, forward_backward_call, forward_call, make_qkv, mixer_module

    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    info = subquad.get_method(spec["method"])
    options = spec.get("options") or {}
    dtype = DTYPES[spec.get("dtype", "float32")]
    device = torch.device(spec.get("device", "cpu"))
    seed = int(spec.get("seed", 0))
    shape = (int(spec["batch"]), int(spec["heads"]), int(spec["n"]), int(spec["dim"]))
    peak = (lambda fn: _peak_cuda(fn, device)) if device.type == "cuda" else _peak_cpu
    backward = bool(spec.get("backward", True))

    def calls(n):
        q, k, v = make_qkv(shape[0], shape[1], n, shape[3], dtype=dtype, device=device, seed=seed)
        module = None
        if info.kind == "mixer":
            module = mixer_module(info, shape[1], shape[3], options, dtype=dtype, device=device)
        call = {"seed": seed, "module": module, "causal": bool(spec.get("causal")),
                "compiled": bool(spec.get("compiled"))}
        fwd = forward_call(info, q, k, v, options, **call)
        bwd = forward_backward_call(info, q, k, v, options, **call) if backward else None
        return fwd, bwd

    out: dict[str, Any] = {"forward_bytes": None, "forward_backward_bytes": None,
                           "forward_error": None, "backward_error": None}
    try:
        fwd, bwd = calls(min(shape[2], _WARMUP_N))
        with torch.no_grad():
            fwd()
        if bwd is not None:
            bwd()
        del fwd, bwd
        fwd, bwd = calls(shape[2])
    except Exception as e:  # noqa: BLE001 (reported, not raised: one failing method must not stop a run)
        out["forward_error"] = f"{type(e).__name__}: {e}"
        return out
    try:
        with torch.no_grad():
            out["forward_bytes"] = peak(fwd)
    except Exception as e:  # noqa: BLE001
        out["forward_error"] = f"{type(e).__name__}: {e}"
    if bwd is not None:
        try:
            out["forward_backward_bytes"] = peak(bwd)
        except Exception as e:  # noqa: BLE001
            out["backward_error"] = f"{type(e).__name__}: {e}"
    return out


def measure_in_subprocess(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    """:func:`measure` in a fresh ``python -m subquad.compare.memory`` process (CPU)."""
    cmd = [sys.executable, "-m", "subquad.compare.memory", json.dumps(spec)]
    failed = {"forward_bytes": None, "forward_backward_bytes": None, "backward_error": None}
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {**failed, "forward_error": f"memory subprocess exceeded {timeout:.0f} s"}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {**failed, "forward_error": f"memory subprocess failed (exit {proc.returncode}): {tail}"}
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    print(json.dumps(measure(json.loads(argv[0]))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
