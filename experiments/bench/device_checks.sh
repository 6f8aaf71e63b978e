#!/usr/bin/env bash
# On the device machine (2 GPUs): issue #6's checks on real devices. Outputs go to $OUT.
#   1. split_bench.py: bench-a3b decode split 24/24 over two GPUs against one (alone: timed).
#   2. tests/split_check.py on both GPUs (tiny fp32 model, HIGHEST matmuls): same tokens,
#      logits within 1e-6, switch off bit-identical to no adapter, programs stable; run with
#      8 and 16 layers, with the shared autotune cache (the default) and, for comparison,
#      XLA's autotuning off; and across two processes (jax.distributed, one GPU each).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/gguf-*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false
export PYTHONUNBUFFERED=1 STRATA_SPLIT_REAL=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi -L | tee "$OUT/gpus.txt"
timeout 170 python3 experiments/bench/split_bench.py --steps 64 2> "$OUT/split_bench.err" \
  | tee "$OUT/split_bench.json"
touch "$OUT/split_bench.done"; tail -3 "$OUT/split_bench.err"
check() {  # check NAME [ENV=VALUE...]: one split_check.py run on both GPUs
  local name=$1; shift
  env "$@" timeout 240 python3 tests/split_check.py 2 > "$OUT/split_$name.json" \
    2> "$OUT/split_$name.err"
}
check p2 &
check p4 STRATA_SPLIT_PERIODS=4 &
check p2_noautotune STRATA_SPLIT_SHARED_AUTOTUNE=0 XLA_FLAGS=--xla_gpu_autotune_level=0 &
PORT=$((20000 + RANDOM % 20000))
for i in 0 1; do
  CUDA_VISIBLE_DEVICES=$i STRATA_SPLIT_PERIODS=4 STRATA_SPLIT_JAX_CACHE=/tmp/split-mp-cache \
    timeout 240 python3 tests/split_check.py mp $i $PORT > "$OUT/split_mp$i.json" \
    2> "$OUT/split_mp$i.err" &
done
wait
for f in "$OUT"/split_p*.json "$OUT"/split_mp*.json; do
  echo "== $f"; head -c 700 "$f"; echo; tail -2 "${f%.json}.err"
done
