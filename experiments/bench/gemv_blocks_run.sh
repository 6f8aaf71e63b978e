#!/usr/bin/env bash
# On the device, one call (~7 min): the quant kernels' compiled tests (the "blocks" form among
# them), then the "blocks" form's tilings against the "rows" form and XLA on the 80B-A3B
# Q4_K_M decode shapes at batch 1, and a few shapes at 4 and 8 rows. Results in $OUT.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
export JAX_PLATFORMS=cuda
t0=$(date +%s)
timeout 150 python3 -m pytest -p no:cacheprovider -W ignore -q -rf -n 8 -m gpu \
  tests/test_quant_kernel.py 2>&1 | tee $OUT/gpu_tests_quant.log | tail -4
echo "tests done $(( $(date +%s) - t0 )) s"
timeout 300 python3 experiments/bench/gemv_sweep.py --set blocks --budget-s 270 --iters 16 --reps 5 \
  --shapes experts_gate_up,experts_down,lm_head,ssm_out,gdn_qkv,shared_gate_up,attn_q,gdn_z,experts_down_q6 \
  --out $OUT/gemv_blocks_b1.json 2>&1 | grep -e "^best" -e Error | cut -c1-200
echo "b1 sweep done $(( $(date +%s) - t0 )) s"
for m in 4 8; do
  timeout 60 python3 experiments/bench/gemv_sweep.py --set blocks --budget-s 45 --rows $m --reps 3 \
    --shapes ssm_out,gdn_qkv --out $OUT/gemv_blocks_m$m.json 2>&1 | grep "^best" | cut -c1-200
done
echo "all done $(( $(date +%s) - t0 )) s"
