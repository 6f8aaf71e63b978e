#!/usr/bin/env bash
# On the device machine (one GPU, the first visible): the opt-in prefill kernels compiled and
# checked, then timed in the model. Outputs go to $OUT.
#   1. pytest -m gpu: the Pallas chunked GDN kernel and the grouped-GEMM MoE kernel against
#      their references on the GPU.
#   2. decode_probe.py --prefill 2500 --gdn_op 2500: the chunked op alone (reference,
#      products, Pallas at chunk 32 and 64) and bench-a3b prefill with each form.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/gguf-*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 200 python3 -m pytest -m gpu tests/test_gdn_chunked_kernel.py \
  tests/test_moe_grouped_kernel.py -p no:cacheprovider -W ignore -q 2>&1 \
  | tee "$OUT/kernel_tests.log" | tail -15
# WAIT_FOR=FILE: start the timed part once FILE exists (another job's timed run has ended).
for _ in $(seq 240); do [ -s "${WAIT_FOR:-/}" ] || [ -z "${WAIT_FOR:-}" ] && break; sleep 1; done
timeout "${PROBE_CAP:-330}" python3 experiments/bench/decode_probe.py --prefill 2500 --gdn_op 2500 --reps 5 \
  --variants "${PREFILL_VARIANTS:-base,fastgdn,gdnkernel,gdnkernel64,moekernel,gdnkernel+moekernel}" \
  --out "$OUT/probe_prefill.json" 2>&1 | grep -v "^\s*$" | tail -12
