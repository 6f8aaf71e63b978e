#!/usr/bin/env bash
# On the device, one call (~8 min): what the fourth session of 2026-12-02 left unmeasured.
#  1. run_all.sh with bench_model.py on the Engine's forms (Forms.resolve: the in-place dense
#     GEMV and, at batch 1, its LoRA epilogue dense_matmul_lora): issue 17's decode fractions
#     and issue 15's LoRA cost (the last run, on the scanned form: on 7.37 / 8.33 µs a layer
#     at 1 / 8 tokens, off 0.18 %). Results in $OUT (copy them to experiments/results/).
# Still owed after it: bench_engine at batch 1 with the epilogue (run 16 had 150.8 tok/s before
# it), the 80B on 2 x H200 (kind nvidia-h200-x2), a profile of the 80B decode, and the GPU
# kernels set (GPU_SET=kernels CAP=580 bash experiments/bench/gpu_tests.sh).
set -uo pipefail
export STRATA_BENCH_RESULTS=$OUT STRATA_JAX_CACHE=/tmp/xla
bash "$(dirname "$0")/run_all.sh" 2>&1 | grep -e "^===" -e ERROR | cut -c1-200
rm -rf $OUT/tmp   # too many files to come back; summary.json is rebuilt here by report.py
