#!/usr/bin/env bash
# On the device, one call (~7 min): the H200 figures owed after 2026-12-01's second session.
# Results in $OUT.
#  bench_engine.py --reps 3 --profile at batch 32, 8 and 1 (issue 16): what four changes
#     made since run 6 do to the engine/program ratios: prefix-cache snapshots copied into
#     pinned host memory (run 6: a ~45 ms GPU gap at each decode-chunk boundary at batch 32),
#     top-p by threshold bisection instead of a [B, V] sort (run 6: +2.6 ms a step sampled at
#     batch 32), a round's prefills queued back to back (first tokens read once computed),
#     and the server's arrival grace (its runs now record the worker's admission rounds).
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
