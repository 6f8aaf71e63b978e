#!/usr/bin/env bash
# On the device, one call (~8 min): what 2026-12-02's session left unmeasured. Results in $OUT.
#  1. The compiled tests of the quant kernels and the dense GEMV (test_gpu_dense_gemv; the
#     "blocks" form passed on the H200 already: gpu_tests_quant_blocks_run2.log).
#  2. Forms.dense_weights="kernel" (the blocks GEMV reading each layer's dense matrix in place)
#     against the default on bench-a3b bf16 at batch 1 and 4, adapter off and on
#     (decode_probe.py --variants base,dgemv,base@on,dgemv@on): whether it removes the ~600 us
#     of per-step qkv slice copies (issue 17) and whether it should become the GPU default.
#  3. bench_engine.py --reps 3 at batch 32, 8 and 1 (issue 16) as far as the cap allows.
# Still owed after it: the 80B-A3B with its mixed-type stacks in one launch
# (`VARIANTS=qpred,qfused bash a80b_run.sh`: the predicated form runs an inactive launch per
# other type, ~4 a layer), the 80B on 2 x H200 (`a80b_split_fits`, nvidia-h200-x2), a profile
# of the 80B decode with the blocks form (decode_probe.py --gguf ... --profile qpred), and
# "blocks" above 4 rows (ROWS_MAX; gemv_sweep.py --set blocks --rows 8 over every shape).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
t0=$(date +%s)
JAX_PLATFORMS=cuda timeout 120 python3 -m pytest -p no:cacheprovider -W ignore -q -rf -n 8 -m gpu \
  tests/test_quant_kernel.py 2>&1 | tee $OUT/gpu_tests_quant.log | tail -3
echo "tests done $(( $(date +%s) - t0 )) s"
timeout 200 python3 experiments/bench/decode_probe.py --variants base,dgemv,base@on,dgemv@on \
  --batches 1,4 --n_steps 16 --reps 3 --out $OUT/decode_probe_dgemv.json 2>&1 \
  | grep '"variant"' | cut -c1-200
echo "probe done $(( $(date +%s) - t0 )) s"
timeout $(( ${CAP:-560} - ($(date +%s) - t0) )) python3 experiments/bench/bench_engine.py --reps 3 \
  --batches 32,8,1 --merge-summary --out $OUT/bench_engine.json 2>&1 \
  | grep -e "^decode" -e "^ttft" -e "^server" -e Error | cut -c1-600
cp experiments/results/summary.json $OUT/summary_after.json
echo "all done $(( $(date +%s) - t0 )) s"
