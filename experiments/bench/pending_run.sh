#!/usr/bin/env bash
# On the device, one call (~9 min): the H200 figures still owed by issues 17-19, each under
# its own time limit so one overrun leaves the others their time. Results in $OUT.
#  1. bench-a3b decode at batch 1 / 8 / 32, the default GDN decode against the fused kernel
#     (issue 17 item 4: the Pallas kernels now update the carried state stack in place);
#  2. bench_spec.py (issue 18: verify / draft cost, projected speed-up);
#  3. multi_adapter_bench.py (issue 19: multi_adapter_b32_cost_ratio).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
t0=$(date +%s)
timeout 200 python3 experiments/bench/decode_probe.py --variants base,gdnfused --batches 1,8,32 \
  --n_steps 8 --reps 3 --out $OUT/decode_probe_state_in_place.json 2>&1 | grep '"variant"' | cut -c1-200
echo "probe done $(( $(date +%s) - t0 )) s"
timeout 180 python3 experiments/bench/bench_spec.py --out $OUT/bench_spec.json 2>&1 | tail -4 | cut -c1-400
echo "spec done $(( $(date +%s) - t0 )) s"
timeout $(( ${CAP:-560} - ($(date +%s) - t0) )) python3 experiments/bench/multi_adapter_bench.py \
  --out $OUT/multi_adapter.json 2>&1 | tail -4 | cut -c1-400
echo "all done $(( $(date +%s) - t0 )) s"
