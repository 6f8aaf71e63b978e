#!/usr/bin/env bash
# On the device, one call (~6 min): why the engine's own decode program (steps.decode_sample,
# greedy plan) runs 5-7 % behind steps.decode_greedy at batch 8 and 32 (issue 16's missed
# greedy ratios, 0.92 / 0.94 in bench_engine_run14.json, where the engine ran at 0.98 / 0.99 of
# decode_sample): bench_engine at batch 8 and 32 with the profiler (the program's profile now
# kept to its decode stretch) and both programs' optimised HLO ($OUT/hlo), to compare them
# fusion by fusion.
# Still owed after it: the 80B on 2 x H200 (a80b_split_fits, kind nvidia-h200-x2), a profile
# of the 80B decode (make_gguf.py, then decode_probe.py --gguf ... --profile base), and the
# GPU kernels set with the GDN reference's one-matrix solve (GPU_SET=kernels gpu_tests.sh).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
t0=$(date +%s)
timeout ${CAP:-560} python3 experiments/bench/bench_engine.py --reps 2 --batches 32,8 --profile \
  --dump-hlo $OUT/hlo --out $OUT/bench_engine_b32_b8_profile.json 2>&1 \
  | grep -e "^decode" -e "^compiled" -e Error | cut -c1-300
echo "bench done $(( $(date +%s) - t0 )) s"
