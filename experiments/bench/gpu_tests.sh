#!/usr/bin/env bash
# On the device machine: the CPU suite's model, switch and kernel checks compiled for the GPU
# (fp32 matmuls at HIGHEST). Log to $OUT/gpu_tests.log.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/gguf-*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
JAX_DEFAULT_MATMUL_PRECISION=highest timeout "${CAP:-300}" python3 -m pytest -p no:cacheprovider \
  -W ignore -q -rf tests/test_lora_switch.py tests/test_decode_greedy.py tests/test_model_parity.py \
  tests/test_engine.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
