#!/bin/bash
# MQAR training steps at long N: one process x 2 threads against 2 context-parallel processes x 1 thread
cd "$(dirname "$0")/../../.."
for n in 65536 131072 262144; do
  A="train mqar --method linear -t seq_len=$n -t num_pairs=64 -t train_size=8 -t eval_size=2 --eval-samples 2 --pad-to $n --batch-size 2 --steps 3 --eval-every 3 --no-progress --no-tensorboard"
  rm -rf /tmp/cpt1_$n /tmp/cpt2_$n
  echo "== N=$n, 1 process x 2 threads"
  echo "\$ subquad $A --threads 2"
  /usr/bin/time -f "peak resident set of the largest process: %M KB" env OMP_NUM_THREADS=2 .venv/bin/python -m subquad.train.cli $A --threads 2 --out /tmp/cpt1_$n 2>&1 | grep -E "steps in|peak"
  echo "== N=$n, 2 processes x 1 thread, --context-parallel 2"
  echo "\$ torchrun --standalone --nproc_per_node=2 -m subquad.train.cli $A --threads 1 --context-parallel 2"
  /usr/bin/time -f "peak resident set of the largest process: %M KB" env OMP_NUM_THREADS=1 .venv/bin/python -m torch.distributed.run --standalone --nproc_per_node=2 -m subquad.train.cli $A --threads 1 --context-parallel 2 --out /tmp/cpt2_$n 2>&1 | grep -E "steps in|peak"
done
