#!/usr/bin/env bash
# On the device, one call (~9 min): what the session of 2026-12-03 measures.
#  1. the GPU model test set (off bit-identity, parity, forms), after Forms' "auto" LoRA at
#     one row went back to the ops after the GEMV (run 17: the epilogue 4.59 µs a layer, the
#     ops after it 3.22); run 18 stopped it at 200 s (32 passed, none failed), TEST_CAP=;
#  2. SECTIONS=model: bench_model.py's decode section on the Engine's forms (batch 1 / 8 / 32,
#     adapter none / off / on): the LoRA cost with the new default (run 18);
#  3. SECTIONS=spec: bench_spec.py (issue 18) on today's decode (run 18);
#  4. SECTIONS=engine: bench_engine.py at batch 1 on the default forms (run 19).
# Results in $OUT (copy them to experiments/results/device/).
set -uo pipefail
t0=$(date +%s)
source "$(dirname "$0")/device_env.sh"
export STRATA_BENCH_RESULTS=$OUT
GPU_SET=model CAP=${TEST_CAP:-200} bash "$(dirname "$0")/gpu_tests.sh" 2>&1 | tail -3
echo "tests done $(( $(date +%s) - t0 )) s"
left() { echo $(( ${CAP:-570} - ($(date +%s) - t0) )); }
want() { [[ ",${SECTIONS:-model,spec}," == *",$1,"* ]]; }
if want model; then
  timeout ${MODEL_CAP:-210} python3 experiments/bench/bench_model.py --sections decode \
    --alt_batches "" --dump_hlo "" --kernels_json experiments/results/bench_kernels.json \
    --out $OUT/bench_model_decode.json 2>&1 | grep -i -e "^decode" -e error | cut -c1-200
  echo "bench_model done $(( $(date +%s) - t0 )) s"
fi
want spec && timeout $(left) python3 experiments/bench/bench_spec.py --out $OUT/bench_spec.json \
  --nosummary 2>&1 | grep -i -e ratio -e speedup -e error | cut -c1-200
want engine && timeout $(left) python3 experiments/bench/bench_engine.py --reps 3 --batches 1 \
  --out $OUT/bench_engine_b1.json 2>&1 | grep -e "^decode" -e Error | cut -c1-300
rm -rf $OUT/tmp
echo "all done $(( $(date +%s) - t0 )) s"
