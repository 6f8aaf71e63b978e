#!/usr/bin/env bash
# On the device, one call (~6 min): what 2026-12-01's fourth session left unmeasured. Results in $OUT.
#  bench_engine.py --reps 3 --profile at batch 32, 8 and 1 (issue 16), run 10. Still owed:
#     a bench_engine flag that builds its engines with Engine(merge_tail=True) (a prompt's
#     sub-block tail joined to the chunk before it, steps.prefill_cut: 2,048 + 452 instead of
#     2,048 + 448 + 4; run 8 had TTFT 1.28 x the prefill call, run 9 1.26, target 1.2), and
#     the cause of the CPU test hang that keeps it opt-in. details.ttft.chunks lists
#     (bucket, cut) per chunk.
# The GPU test set runs as two calls of its own (gpu_tests.sh, GPU_SET=kernels CAP=560, then
# GPU_SET=model).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
t0=$(date +%s)
timeout ${CAP:-560} python3 experiments/bench/bench_engine.py --reps 3 --profile \
  --batches 32,8,1 --merge-summary --out $OUT/bench_engine.json 2>&1 \
  | grep -e "^decode" -e "^ttft" -e "^server" -e Error | cut -c1-600
cp experiments/results/summary.json $OUT/summary_after.json
echo "all done $(( $(date +%s) - t0 )) s"
