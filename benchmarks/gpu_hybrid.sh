#!/usr/bin/env bash
# On a CUDA machine whose python3 has torch, numpy, numpy and pytest-xdist:
# the CUDA tests, then hybrid (FlexAttention, Triton) against SDPA in bf16 at 16k and 64k
# tokens, forward and forward + backward. Results in $OUT (default out/gpu); the table of record in
# benchmarks/results/hybrid_speed_cuda.md.
#   bash benchmarks/gpu_hybrid.sh
set -u
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 SUBQUAD_TEST_THREADS=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/tmp/install.log 2>&1 || export PYTHONPATH=$PWD/src
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__)"
timeout "${TEST_SECONDS:-200}" python3 -m pytest -q -n 4 -p no:cacheprovider -rfE tests/test_cuda.py >"$OUT/cuda_tests.log" 2>&1
echo "cuda tests rc=$? at ${SECONDS}s"; grep -E "FAILED|ERROR|passed|failed" "$OUT/cuda_tests.log" | tail -n 30
timeout "${BENCH_SECONDS:-240}" python3 benchmarks/hybrid_speed.py --device cuda --dtype bfloat16 --n 16384 65536 \
  --rounds 5 --min-time 0.2 --out "$OUT" --name hybrid_speed_cuda
echo "bench rc=$? at ${SECONDS}s"
