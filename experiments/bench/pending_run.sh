#!/usr/bin/env bash
# On the device, one call (~9 min): what the session of 2026-12-03 measures first.
#  1. the GPU model test set (off bit-identity, parity, forms), after Forms' "auto" LoRA at
#     one row went back to the ops after the GEMV (run 17: the epilogue 4.59 µs a layer, the
#     ops after it 3.22);
#  2. bench_model.py's decode section on the Engine's forms (batch 1 / 8 / 32, adapter none /
#     off / on): the LoRA cost with the new default;
#  3. bench_spec.py (issue 18) on today's decode (run 2 was at 6.12 ms a step).
# Results in $OUT (copy them to experiments/results/device/).
set -uo pipefail
t0=$(date +%s)
source "$(dirname "$0")/device_env.sh"
export STRATA_BENCH_RESULTS=$OUT
GPU_SET=model CAP=${TEST_CAP:-200} bash "$(dirname "$0")/gpu_tests.sh" 2>&1 | tail -3
echo "tests done $(( $(date +%s) - t0 )) s"
timeout ${MODEL_CAP:-210} python3 experiments/bench/bench_model.py --sections decode \
  --alt_batches "" --dump_hlo "" --kernels_json experiments/results/bench_kernels.json \
  --out $OUT/bench_model_decode.json 2>&1 | grep -i -e "^decode" -e lora -e error | cut -c1-200
echo "bench_model done $(( $(date +%s) - t0 )) s"
left=$(( ${CAP:-570} - ($(date +%s) - t0) ))
timeout $left python3 experiments/bench/bench_spec.py --out $OUT/bench_spec.json \
  --nosummary 2>&1 | grep -i -e ratio -e speedup -e error | cut -c1-200
rm -rf $OUT/tmp
echo "all done $(( $(date +%s) - t0 )) s"
