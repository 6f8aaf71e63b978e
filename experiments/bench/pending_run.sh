#!/usr/bin/env bash
# On the device, one call (~9 min): the H200 figures still owed after 2026-12-01's session,
# each under its own time limit so one overrun leaves the others their time. Results in $OUT.
#  1. bench_spec.py (issue 18): the verification now runs its GDN steps in one launch
#     (gdn_decode_fused_steps) under the default fused form; verify_n4_cost_ratio;
#  2. multi_adapter_bench.py (issue 19): the program ratio and, new, the Engine's
#     (multi_adapter_b32_engine_cost_ratio);
#  3. bench_engine.py --reps 3 --profile at batch 1 and 32 (issue 16: the ratios, TTFT after the
#     one-read K/V snapshots, the server after the first-token streaming fix).
# The GPU test set's kernels half needs a call of its own (gpu_tests.sh, GPU_SET=kernels,
# CAP=580).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
t0=$(date +%s)
timeout 150 python3 experiments/bench/bench_spec.py --out $OUT/bench_spec.json 2>&1 \
  | grep -e ratio -e speedup -e switch -e Error | cut -c1-300
echo "spec done $(( $(date +%s) - t0 )) s"
timeout 170 python3 experiments/bench/multi_adapter_bench.py --out $OUT/multi_adapter.json \
  2>&1 | tail -2 | cut -c1-400
echo "multi-adapter done $(( $(date +%s) - t0 )) s"
timeout $(( ${CAP:-560} - ($(date +%s) - t0) )) python3 experiments/bench/bench_engine.py \
  --reps 3 --profile --batches 32,1 --out $OUT/bench_engine.json 2>&1 \
  | grep -e "^decode" -e "^ttft" -e "^server" -e Error | cut -c1-600
cp experiments/results/summary.json $OUT/summary_after.json
echo "all done $(( $(date +%s) - t0 )) s"
