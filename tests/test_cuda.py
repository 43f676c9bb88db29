"""Every registered method on a CUDA device: the same numbers as on the CPU, gradients, bf16,
the module, a training run. Skipped where torch sees no CUDA device (CI has none); run on a GPU
machine with ``pytest tests/test_cuda.py``.

Inputs are drawn on the CPU and moved, and stochastic methods get CPU generators (subquad draws
on the generator's device and moves the draw), so a CUDA output must equal the CPU output up to
float32 rounding: any larger difference is a device bug, not randomness.
"""

from __future__ import annotations

import copy

import pytest
import torch

import subquad
from conftest import ATTENTION_METHODS, generic_options, method_options, qkv

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = torch.device("cuda")
MIXERS = [m.name for m in subquad.list_methods() if m.kind == "mixer"]
VARIANTS = ["plain", "causal", "masked", "causal_masked", "cross"]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _case(method: str, variant: str, dtype=torch.float32, requires_grad=False):
    """(q, k, v, kwargs) on the CPU for ``variant``; skips what the method does not support."""
    info = subquad.get_method(method)
    causal = variant.startswith("causal")
    if causal and not info.causal:
        pytest.skip(f"{method} is not causal")
    if "masked" in variant and not info.key_padding:
        pytest.skip(f"{method} takes no key padding mask")
    if variant == "cross" and not info.cross_attention:
        pytest.skip(f"{method} is self-attention only")
    m = 29 if variant == "cross" else 37
    q, k, v = qkv(3, 2, 37, 16, m=m, dtype=dtype, requires_grad=requires_grad)
    kwargs: dict = {"causal": causal}
    if "masked" in variant:
        mask = torch.zeros(3, 37, dtype=torch.bool)
        mask[1, 30:] = True  # padding at the end
        mask[2, 4:11] = True  # padding in the middle
        kwargs["key_padding_mask"] = mask
    return q, k, v, kwargs


def _call(method, q, k, v, kwargs, device):
    """The op on copies of q, k, v and the mask on ``device`` (with method_options, CPU generator)."""
    moved = {key: (t.to(device) if isinstance(t, torch.Tensor) else t) for key, t in kwargs.items()}
    opts = method_options(method, q.shape[-1], q.dtype)
    return subquad.attention(q.to(device), k.to(device), v.to(device), method=method, **opts, **moved)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("method", ATTENTION_METHODS)
def test_forward_equals_cpu(method, variant):
    q, k, v, kwargs = _case(method, variant)
    want = _call(method, q, k, v, kwargs, "cpu")
    got = _call(method, q, k, v, kwargs, CUDA)
    assert got.device.type == "cuda" and got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("variant", ["plain", "causal_masked"])
@pytest.mark.parametrize("method", ATTENTION_METHODS)
def test_gradients_equal_cpu(method, variant):
    q, k, v, kwargs = _case(method, variant)
    cot = torch.randn(*q.shape[:3], v.shape[-1], generator=torch.Generator().manual_seed(5))
    grads = []
    for device in ("cpu", CUDA):
        leaves = [t.detach().to(device).requires_grad_(True) for t in (q, k, v)]
        out = _call(method, *leaves, kwargs, device)
        grads.append(torch.autograd.grad(out, leaves, cot.to(device), allow_unused=True))
    for name, want, got in zip("qkv", *grads):
        assert (want is None) == (got is None), name
        if want is not None:
            assert got.device.type == "cuda", name
            torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-5, msg=f"d{name}")


@pytest.mark.parametrize("variant", ["plain", "causal_masked"])
@pytest.mark.parametrize("method", ATTENTION_METHODS)
def test_bf16_inputs_and_autocast(method, variant):
    """bf16 inputs give a bf16 output within 3e-2 of the float32 CPU output on the same (rounded)
    inputs, and float32 inputs under CUDA bf16 autocast a float32 or bf16 one within 3e-2 of the
    float32 CPU output; both finite."""
    q, k, v, kwargs = _case(method, variant)
    want = _call(method, q, k, v, kwargs, "cpu")
    low = _call(method, q.bfloat16(), k.bfloat16(), v.bfloat16(), kwargs, CUDA)
    assert low.dtype == torch.bfloat16 and torch.isfinite(low).all()
    # against the same bf16-rounded inputs: a method that selects keys may choose otherwise on them
    rounded = _call(method, q.bfloat16().float(), k.bfloat16().float(), v.bfloat16().float(), kwargs, "cpu")
    assert _rel(low, rounded) < 3e-2
    with torch.autocast("cuda", dtype=torch.bfloat16):
        auto = _call(method, q, k, v, kwargs, CUDA)
    assert auto.dtype in (torch.float32, torch.bfloat16) and torch.isfinite(auto).all()
    assert _rel(auto, want) < 3e-2


@pytest.mark.parametrize("method", ATTENTION_METHODS + MIXERS)
def test_module_on_cuda(method):
    """``MultiheadAttention`` (or the mixer's module) moved to CUDA: in eval mode the output equals
    the CPU module's with the same weights (mixers: finite); a training-mode backward gives every
    parameter a finite gradient on the device."""
    info = subquad.get_method(method)
    x = torch.randn(2, 37, 32, generator=torch.Generator().manual_seed(0))
    pad = torch.zeros(2, 37, dtype=torch.bool)
    pad[1, 30:] = True
    torch.manual_seed(0)
    if info.kind == "mixer":
        cpu = info.module(32, 4).eval()
        call = lambda mod, t, p: mod(t)  # noqa: E731
    else:
        cpu = subquad.MultiheadAttention(32, 4, method=method, batch_first=True, **generic_options(method)).eval()
        call = lambda mod, t, p: mod(t, t, t, key_padding_mask=p if info.key_padding else None,  # noqa: E731
                                     need_weights=False)[0]
    gpu = copy.deepcopy(cpu).to(CUDA)
    with torch.no_grad():
        got = call(gpu, x.to(CUDA), pad.to(CUDA))
        assert got.device.type == "cuda" and torch.isfinite(got).all()
        if info.kind != "mixer" and not info.stochastic:
            torch.testing.assert_close(got.cpu(), call(cpu, x, pad), rtol=1e-4, atol=1e-5)
    gpu.train()
    call(gpu, x.to(CUDA).requires_grad_(True), pad.to(CUDA)).square().mean().backward()
    for name, p in gpu.named_parameters():
        if p.requires_grad and p.grad is not None:
            assert p.grad.device.type == "cuda" and torch.isfinite(p.grad).all(), name


def _peak_bytes(method: str, n: int, causal: bool) -> int:
    """Peak CUDA memory of one bf16 forward+backward at length ``n`` (B=1, H=8, D=64) over the
    inputs, after checking that the output and gradients are finite."""
    info = subquad.get_method(method)
    q, k, v = (t.to(CUDA, torch.bfloat16).requires_grad_(True) for t in qkv(1, 8, n, 64, dtype=torch.float32))
    opts = {"generator": torch.Generator().manual_seed(0)} if info.stochastic else {}
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = subquad.attention(q, k, v, method=method, causal=causal, **opts)
    grads = torch.autograd.grad(out.float().square().mean(), (q, k, v), allow_unused=True)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    assert all(g is None or torch.isfinite(g).all() for g in grads)
    return torch.cuda.max_memory_allocated() - base


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("method", [m for m in ATTENTION_METHODS if subquad.get_method(m).complexity == "linear"])
def test_long_bf16_memory_grows_linearly(method, causal):
    """Linear-cost methods in bf16 on the GPU, forward+backward at N = 16384 and 65536: finite,
    and the peak memory grows at most 5x for 4x the tokens (one N x N score matrix would grow
    16x; at 65536 it alone would take 64 GiB for 8 heads). A fixed cap would not do: a
    sparse method's selected keys grow linearly with N, so its peak does too."""
    if causal and not subquad.get_method(method).causal:
        pytest.skip(f"{method} is not causal")
    short, long = (_peak_bytes(method, n, causal) for n in (16384, 65536))
    assert long < 5 * short, f"{method}: {short / 2**20:.0f} MiB at 16384, {long / 2**20:.0f} MiB at 65536"


@pytest.mark.parametrize("method", ["softmax", "performer", "hybrid"])
def test_training_run_on_cuda(method, data_dir, tmp_path):
    """A few ListOps steps with ``device="cuda"`` and bf16 autocast: the model file is written
    and the losses are finite."""
    from subquad.train import TrainConfig, train

    opts = {"performer": {"num_features": 16}}.get(method, {})
    cfg = TrainConfig(method=method, method_options=opts, data_dir=str(data_dir), out_dir=str(tmp_path / method),
                      steps=4, layers=2, dim=16, heads=2, ffn_dim=32, head_hidden=16, batch_size=8, lr=1e-3,
                      warmup_steps=2, pad_to=64, eval_every=2, checkpoint_every=2, log_every=1, progress=False,
                      tensorboard=False, device="cuda", amp="bf16")
    results = train(cfg)
    assert results["steps"] == 4
    assert torch.isfinite(torch.tensor(results["test_loss"]))
    assert (tmp_path / method / "model.pt").exists()


@pytest.mark.parametrize("score", ["mean", "mean_query", "sampled"])
def test_hybrid_decode_state_on_cuda(score):
    """hybrid's decoding state on CUDA gives the CPU's outputs over a prefill and single steps,
    with the selection active (default blocks, 3000 keys: 24 key blocks, 14 attended), each score."""
    from subquad.ops.hybrid import HybridDecodeState, HybridOptions

    q, k, v = qkv(1, 2, 3004, 16, dtype=torch.float32)
    outs = []
    for device in ("cpu", CUDA):
        state = HybridDecodeState(HybridOptions(score=score))
        qd, kd, vd = (t.to(device) for t in (q, k, v))
        steps = [state.attend(qd[:, :, :3000], kd[:, :, :3000], vd[:, :, :3000])[:, :, -1:]]
        steps += [state.attend(qd[:, :, j: j + 1], kd[:, :, j: j + 1], vd[:, :, j: j + 1]) for j in range(3000, 3004)]
        outs.append(torch.cat(steps, 2).cpu())
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hybrid_flex_equals_gathered_on_cuda(causal, dtype):
    """hybrid's FlexAttention form (Triton, tiles of 128 over 64-key blocks) computes what its
    gathered form computes, forward and gradients, with key padding and a length off the bucket."""
    n = 2500
    q, k, v = (t.to(CUDA, dtype).requires_grad_() for t in qkv(2, 2, n, 64, dtype=torch.float32))
    mask = torch.zeros(2, n, dtype=torch.bool, device=CUDA)
    mask[1, -300:] = True
    mask[1, 100:140] = True
    w = torch.randn(2, 2, n, 64, device=CUDA, dtype=dtype)
    outs, grads = [], []
    for backend in ("flex", "gather"):
        out = subquad.attention(q, k, v, method="hybrid", causal=causal, key_padding_mask=mask, backend=backend,
                                key_block=64)
        (out * w).sum().backward()
        outs.append(out.detach())
        grads.append([t.grad.clone() for t in (q, k, v)])
        for t in (q, k, v):
            t.grad = None
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert _rel(outs[0], outs[1]) < tol
    for a, b in zip(*grads):
        assert _rel(a, b) < tol * 5
