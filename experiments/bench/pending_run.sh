#!/usr/bin/env bash
# On the device, one call (~9 min): the decode loops with the LoRA pass chosen once per dispatch
# (steps._by_lora_branch; before, a conditional inside the step loop had the GPU copy its index
# to the host and drain the stream at every step).
#  1. bench_engine at batch 32 / 8 / 1 (issue 16's ratios; run 14 had greedy 0.94 / 0.92 /
#     0.97), merged into a copy of summary.json in $OUT.
#  2. The GPU model set (parity, the switch's off bit-identity, forms, the decode loops).
# Still owed after it: run_all.sh (issue 17's decode fractions and the LoRA cost, whose "on"
# and "off" programs carried that per-step conditional and "none" did not), the 80B on
# 2 x H200 (kind nvidia-h200-x2), a profile of the 80B decode.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
t0=$(date +%s)
cp experiments/results/summary.json $OUT/summary.json
timeout 330 python3 experiments/bench/bench_engine.py --reps 3 --batches 32,8,1 \
  --merge-summary $OUT/summary.json --out $OUT/bench_engine_run15.json 2>&1 \
  | grep -e "^decode" -e "^ttft" -e "^server" -e "^compiled" -e Error | cut -c1-300
echo "bench done $(( $(date +%s) - t0 )) s"
CAP=$(( ${CAP:-570} - ($(date +%s) - t0) )) GPU_SET=model bash experiments/bench/gpu_tests.sh \
  > /dev/null 2>&1
tail -3 $OUT/gpu_tests*.log
echo "all done $(( $(date +%s) - t0 )) s"
