#!/usr/bin/env bash
# On the device machine (2 GPUs): the CPU test checks compiled on GPU, the layer split on two
# real devices, and bench-a3b decode split 24/24 against one GPU. Outputs go to $OUT.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/gguf-*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi -L | tee "$OUT/gpus.txt"
STRATA_SPLIT_REAL=1 python3 tests/split_check.py 2 > "$OUT/split_check.json" 2> "$OUT/split_check.err"
tail -c 1500 "$OUT/split_check.json"
python3 experiments/bench/split_bench.py --steps 64 2> "$OUT/split_bench.err" | tee "$OUT/split_bench.json"
tail -5 "$OUT/split_bench.err"
JAX_DEFAULT_MATMUL_PRECISION=highest python3 -m pytest tests/test_model_parity.py \
  tests/test_lora_switch.py tests/test_delta_rule.py -p no:cacheprovider -s -W ignore 2>&1 \
  | grep -vE "^\s*$" | tee "$OUT/gpu_tests.log" | tail -25
# The layer split across two processes (jax.distributed, one GPU each, NCCL + JAX's cross-host
# device transfer over loopback): same checks as split_check.py, from process 0 and 1.
PORT=$((20000 + RANDOM % 20000))
for i in 0 1; do
  CUDA_VISIBLE_DEVICES=$i STRATA_SPLIT_REAL=1 python3 tests/split_check.py mp $i $PORT \
    > "$OUT/split_mp$i.json" 2> "$OUT/split_mp$i.err" &
done
wait
tail -c 800 "$OUT/split_mp0.json"; tail -3 "$OUT/split_mp0.err"
