#!/usr/bin/env bash
# On the device, one call (~5 min): why Forms.dense_weights="kernel" sped up the device program
# at batch 1 (decode_probe_dgemv_run1.json, K/V capacity 512) yet slowed the Engine's batch-1
# decode (K/V capacity 2,560: 146.9 tok/s in bench_engine_run11.json against 160.5 in _run10).
#  1. decode_probe at batch 1, adapter on, scan against kernel, at capacity 2,560 (512: run1).
#  2. bench_engine.py at batch 1 under the defaults at HEAD (scan), merged into summary.json.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
t0=$(date +%s)
for cap in 2560; do
  timeout 80 python3 experiments/bench/decode_probe.py --variants base@on,dgemv@on --batches 1 \
    --n_steps 16 --reps 3 --max_seq $cap --out $OUT/decode_probe_dgemv_cap$cap.json 2>&1 \
    | grep '"variant"' | cut -c1-110
done
echo "probe done $(( $(date +%s) - t0 )) s"
timeout $(( ${CAP:-330} - ($(date +%s) - t0) )) python3 experiments/bench/bench_engine.py --reps 3 \
  --batches 1 --merge-summary --out $OUT/bench_engine.json 2>&1 \
  | grep -e "^decode" -e "^ttft" -e "^server" -e Error | cut -c1-400
cp experiments/results/summary.json $OUT/summary_after.json
echo "all done $(( $(date +%s) - t0 )) s"
