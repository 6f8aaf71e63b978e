#!/usr/bin/env bash
# On the device machine (one H200): the new GDN kernels (issue 17 item 5) compiled and checked,
# then timed against fla's. Outputs go to $OUT. Needs the fla-core, flash-linear-attention and
# einops wheels in .whl/ (experiments/bench/README.md).
#   1. pytest -m gpu: the chunk-parallel chunked kernels and the fused decode kernel against
#      their references on the GPU (~2-4 min; log: $OUT/gdn_kernel_tests_gpu.log).
#   2. gdn_probe.py --profile: ours (old and new forms) against fla's chunk_gated_delta_rule
#      (T = 2,500) and fused_recurrent_gated_delta_rule (batch 1/8/32), under 3 minutes
#      ($OUT/gdn_probe.json + .png, log $OUT/gdn_probe.log).
# SKIP_TESTS=1 runs the probe alone.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || echo "gdn_checks: wheel install failed" >&2
export PYTHONPATH=/tmp/site:$PWD JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout "${TEST_CAP:-300}" python3 -m pytest -m gpu tests/test_gdn_parallel_kernel.py \
    tests/test_gdn_decode_fused_kernel.py -p no:cacheprovider -W ignore -q 2>&1 \
    | tee "$OUT/gdn_kernel_tests_gpu.log" | tail -15
fi
timeout "${PROBE_CAP:-240}" python3 experiments/bench/gdn_probe.py --profile \
  --out "$OUT/gdn_probe.json" 2>&1 | tee "$OUT/gdn_probe.log" | grep -v "^\s*$" | tail -60
