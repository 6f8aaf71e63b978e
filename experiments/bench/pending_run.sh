#!/usr/bin/env bash
# On the device, one call (~6 min): what 2026-12-01's fourth session owes the H200. Results in $OUT.
#  1. decode_probe.py (issue 17): bench-a3b decode with the projection matrices scanned (base)
#     or kept whole and taken at each layer's index (inplace, Forms.dense_weights), adapter
#     off / on, batch 1, 8, 32; then batch 1 again with XLA's dynamic-slice fusion, and the
#     in-place program's optimised HLO (run 8's dump showed the scanned qkv slices copied).
#  2. The GPU model test set (gpu_tests.sh GPU_SET=model): parity with transformers, the switch
#     and forms checks (the new in-place form among them) after this session's changes.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
t0=$(date +%s)
V=base,inplace,base@on,inplace@on
timeout ${PROBE_CAP:-150} python3 experiments/bench/decode_probe.py --variants $V --batches 1,8,32 \
  --dump-hlo $OUT/hlo --out $OUT/decode_probe_inplace.json 2>&1 | grep -e '^{' -e Error | cut -c1-260
XLA_FLAGS=--xla_gpu_enable_dynamic_slice_fusion=true timeout ${PROBE_CAP:-150} python3 \
  experiments/bench/decode_probe.py --variants base,inplace --batches 1 --tag dsf \
  --out $OUT/decode_probe_inplace_dsf.json 2>&1 | grep -e '^{' -e Error | cut -c1-260
echo "probes done $(( $(date +%s) - t0 )) s"
CAP=${TEST_CAP:-240} WORKERS=12 GPU_SET=model OUT=$OUT bash experiments/bench/gpu_tests.sh 2>&1 | tail -4
echo "all done $(( $(date +%s) - t0 )) s"
