#!/usr/bin/env bash
# On the device, one call (~9 min): what the session of 2026-12-03 (third) measures, after the
# LoRA rows joined the few-row GEMVs' launches (`Forms.gemv_lora="rows"`; "auto" is still
# "apart" on the GPU until this call times it).
#  1. SECTIONS=tests: the new kernels compiled (the LoRA rows' `gpu` cases in
#     test_quant_kernel.py) and the forms, switch and greedy-decode tests compiled for the GPU
#     (off bit-identity through the rows form, its numbers against "apart"; TEST_CAP=);
#  2. SECTIONS=model: bench_model.py's decode at batch 1 and 8 (default: "apart"), with
#     `gemv_lora=rows` timed beside it at batch 1: the LoRA cost per layer, on and off;
#  3. SECTIONS=probe: decode_probe.py at batch 1, adapter on, "apart" against "rows", with the
#     rows program's kernel profile;
#  4. SECTIONS=engine: bench_engine.py at batch 1 with --forms gemv_lora=rows (the Engine and
#     its decode_greedy reference in one process).
# Results in $OUT (copy them to experiments/results/device/).
set -uo pipefail
t0=$(date +%s)
source "$(dirname "$0")/device_env.sh"
export STRATA_BENCH_RESULTS=$OUT
left() { echo $(( ${CAP:-570} - ($(date +%s) - t0) )); }
want() { [[ ",${SECTIONS:-tests,model,probe,engine}," == *",$1,"* ]]; }
if want tests; then
  JAX_PLATFORMS=cuda STRATA_TEST_PROGRESS_LOG=$OUT/gpu_test_progress_lora.tsv \
    timeout ${TEST_CAP:-200} python3 -m pytest -p no:cacheprovider -W ignore -q -rfs -n 8 \
    tests/test_forms.py tests/test_lora_switch.py tests/test_decode_greedy.py \
    "tests/test_quant_kernel.py::test_gpu_dense_gemv_lora_rows" \
    "tests/test_quant_kernel.py::test_gpu_dense_gemv" \
    "tests/test_quant_kernel.py::test_gpu_qmatmul_lora_rows" 2>&1 \
    | tee $OUT/gpu_tests_lora.log | tail -4
  echo "tests done $(( $(date +%s) - t0 )) s"
fi
if want model; then
  timeout ${MODEL_CAP:-200} python3 experiments/bench/bench_model.py --sections decode \
    --batches 1,8 --alt_batches 1 --lora_alt_impl gemv_lora=rows --dump_hlo "" \
    --kernels_json experiments/results/bench_kernels.json \
    --out $OUT/bench_model_decode.json 2>&1 | grep -i -e "^decode" -e error | cut -c1-200
  echo "bench_model done $(( $(date +%s) - t0 )) s"
fi
if want probe; then
  timeout ${PROBE_CAP:-120} python3 experiments/bench/decode_probe.py \
    --variants loraapart@on,lorarows@on --batches 1 --n_steps 32 --reps 7 \
    --profile lorarows@on --out $OUT/decode_probe_lorarows.json 2>&1 | grep '"variant"' | cut -c1-200
  echo "probe done $(( $(date +%s) - t0 )) s"
fi
want engine && timeout $(left) python3 experiments/bench/bench_engine.py --reps 3 --batches 1 \
  --forms gemv_lora=rows --out $OUT/bench_engine_b1_lorarows.json 2>&1 | grep -e "^decode" -e Error | cut -c1-300
rm -rf $OUT/tmp
echo "all done $(( $(date +%s) - t0 )) s"
