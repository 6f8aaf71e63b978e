#!/usr/bin/env bash
# On the device, one call (~8 min): what the session of 2026-12-02 (second) left open.
#  1. The engine's batch-1 gap (issue 16: 147.1 tok/s against its own decode_sample program's
#     165.2 in bench_engine_run12.json; 160.5 in run 10): bench_engine at batch 1 with the
#     profiler, the host phases and the GPU's idle gaps per dispatch.
#  2. Forms.dense_weights="kernel" through the Engine, same process family: bench_engine at
#     batch 1 with --forms dense_weights=kernel (the probe has the kernel 12 % faster at batch 1,
#     decode_probe_dgemv_cap2560_run2.json; run 11, with it the default, had the reference
#     program at 151.4 against 165.2 on another machine).
# Results in $OUT. Still owed after it: the 80B on 2 x H200 (a80b_split_fits, kind
# nvidia-h200-x2), a profile of the 80B decode under the fused groups (decode_probe.py --gguf
# ... --profile base), and "blocks" above 4 rows (gemv_sweep.py --set blocks --rows 8).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
t0=$(date +%s)
timeout 260 python3 experiments/bench/bench_engine.py --reps 3 --batches 1 --profile \
  --out $OUT/bench_engine_b1_profile.json 2>&1 | grep -e "^decode" -e "^ttft" -e Error | cut -c1-300
echo "profile done $(( $(date +%s) - t0 )) s"
timeout $(( ${CAP:-560} - ($(date +%s) - t0) )) python3 experiments/bench/bench_engine.py --reps 3 \
  --batches 1 --forms dense_weights=kernel --out $OUT/bench_engine_b1_dgemv.json 2>&1 \
  | grep -e "^decode" -e "^ttft" -e Error | cut -c1-300
echo "all done $(( $(date +%s) - t0 )) s"
