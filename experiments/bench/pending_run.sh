#!/usr/bin/env bash
# On the device, one call (~9 min): what the fourth session of 2026-12-02 left unmeasured.
#  1. run_all.sh, bench_model.py now on the Engine's forms (Forms.resolve: the in-place dense
#     GEMV and, at batch 1, its LoRA epilogue, dense_matmul_lora) with the LoRA ops after the
#     GEMV as the alternate (on@xla): issue 17's decode fractions and issue 15's LoRA cost (the
#     last run, on the scanned form: on 7.37 / 8.33 µs a layer at 1 / 8 tokens, off 0.18 %).
#  2. bench_engine at batch 1, the default then --forms lora_impl=xla (run 16, before the
#     epilogue: 150.8 tok/s against decode_greedy's 152.1).
# Results in $OUT (copy them to experiments/results/ and results/device/). Still owed after
# it: bench_spec.py (its decode baseline is now decode_greedy, the Engine's loop), the 80B on
# 2 x H200 (kind nvidia-h200-x2), a profile of the 80B decode, and the GPU kernels set
# (GPU_SET=kernels CAP=580 bash experiments/bench/gpu_tests.sh).
set -uo pipefail
t0=$(date +%s)
export STRATA_BENCH_RESULTS=$OUT STRATA_JAX_CACHE=/tmp/xla
bash "$(dirname "$0")/run_all.sh" 2>&1 | grep -e "^===" -e ERROR | cut -c1-200
rm -rf $OUT/tmp   # too many files to come back; summary.json is rebuilt here by report.py
source "$(dirname "$0")/device_env.sh"
for forms in "" "lora_impl=xla"; do
  left=$(( ${CAP:-570} - ($(date +%s) - t0) ))
  [ $left -lt 60 ] && { echo "no time left for bench_engine ${forms:-default}"; break; }
  timeout $left python3 experiments/bench/bench_engine.py --reps 3 --batches 1 \
    ${forms:+--forms $forms} --out $OUT/bench_engine_b1_${forms:-default}.json 2>&1 \
    | grep -e "^decode" -e Error | cut -c1-300
done
echo "all done $(( $(date +%s) - t0 )) s"
