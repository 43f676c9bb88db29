#!/usr/bin/env bash
# On a CUDA machine whose python3 already has torch, numpy, tqdm, matplotlib and pytest-xdist:
#  1. the CUDA tests (tests/test_cuda.py);
#  2. hybrid (FlexAttention, Triton) against SDPA in bf16 at 16k and 64k tokens, causal and not,
#     forward and forward + backward (`subquad compare --methods hybrid`);
#  3. every method against SDPA in bf16 at 4k-64k tokens (`subquad compare`; exact attention is SDPA's
#     default dispatch, timed here against its flash kernel alone too);
#  4. the CPU suite in whatever time is left of a 570 s run.
# Logs and the compare runs go to $OUT (default out/gpu); tables of record in
# benchmarks/results/cuda.md and hybrid_speed_cuda.md. STEPS=1,2 runs only those steps.
#   bash benchmarks/gpu_check.sh
set -u
OUT=${OUT:-out/gpu}
STEPS=${STEPS:-1,2,3,4}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 SUBQUAD_TEST_THREADS=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/tmp/install.log 2>&1 || export PYTHONPATH=$PWD/src
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__)"
step() { [[ ",$STEPS," == *",$1,"* ]]; }
GPU_RUN=(--device cuda --dtype bfloat16 --error-inputs iid --min-run-time 0.2 --quiet)

if step 1; then  # the CUDA tests (4 workers share the GPU; -rfE and --durations keep failures and slow tests)
  timeout "${TEST_SECONDS:-170}" python3 -m pytest -v -n 4 -p no:cacheprovider -rfE --durations=8 tests/test_cuda.py \
    >"$OUT/cuda_tests.log" 2>&1
  echo "cuda tests rc=$? at ${SECONDS}s"; grep -E "FAILED|ERROR|passed|failed|s call" "$OUT/cuda_tests.log" | tail -n 30
  sleep 5
fi

if step 2; then  # hybrid against SDPA with the same mask
  for mask in causal full; do
    flag=(); [ "$mask" = causal ] && flag=(--causal)
    timeout 150 python3 -m subquad compare "${GPU_RUN[@]}" "${flag[@]}" --methods hybrid --n 16384 65536 \
      --max-call-seconds 10 --out "$OUT/hybrid_$mask" >"$OUT/hybrid_$mask.log" 2>&1
    echo "hybrid $mask rc=$? at ${SECONDS}s"; sed -n '/^N = /,/^$/p' "$OUT/hybrid_$mask.log"
  done
fi

if step 3; then
  python3 - <<'PY'
# which SDPA kernel exact attention gets: the default dispatch against the flash kernel alone
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
import torch.nn.functional as F
q, k, v = (torch.randn(1, 8, 16384, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
def t(fn, n=20):
    fn(); torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record(); [fn() for _ in range(n)]; e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / n
base = t(lambda: F.scaled_dot_product_attention(q, k, v))
with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
    flash = t(lambda: F.scaled_dot_product_attention(q, k, v))
print(f"SDPA at N=16384 bf16: default {base:.3f} ms, flash only {flash:.3f} ms")
PY
  timeout 200 python3 -m subquad compare "${GPU_RUN[@]}" --n 4096 16384 65536 --max-call-seconds 5 \
    --out "$OUT/compare" >"$OUT/compare.log" 2>&1
  echo "compare rc=$? at ${SECONDS}s"; tail -n 40 "$OUT/compare.log"
fi

if step 4; then  # the CPU suite (correctness under this machine's torch) in the time left
  left=$((570 - SECONDS))
  if [ "$left" -gt 60 ]; then
    timeout "$left" python3 -m pytest -q -n 15 -m "not slow" -p no:cacheprovider -rfE >"$OUT/suite.log" 2>&1
    echo "suite rc=$? at ${SECONDS}s"; grep -E "FAILED|ERROR|passed|failed" "$OUT/suite.log" | tail -n 25
  fi
fi
