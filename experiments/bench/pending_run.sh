#!/usr/bin/env bash
# On the device, one call (~7 min): bench_engine at batch 32, 8 and 1 with its engines compiled
# one after another (--warm-threads 1, now the default). Run 13 compiled three engines at once
# and its batch-1 decode_greedy reference ran 152 tok/s where a one-engine process ran the same
# program at 193 (bench_engine_b1_dgemv.json).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
t0=$(date +%s)
timeout ${CAP:-560} python3 experiments/bench/bench_engine.py --reps 3 --batches 32,8,1 \
  --merge-summary $OUT/summary.json --out $OUT/bench_engine.json 2>&1 \
  | grep -e "^decode" -e "^ttft" -e "^server" -e "^compiled" -e Error | cut -c1-300
echo "bench done $(( $(date +%s) - t0 )) s"
