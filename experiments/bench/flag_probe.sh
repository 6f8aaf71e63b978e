#!/usr/bin/env bash
# On the device machine (one GPU): does an XLA flag speed up batch-1 decode? FLAG (default:
# dynamic-slice fusion, cuBLAS reading a layer's weights in place inside the layer scan
# instead of a copy per layer). Times decode_probe.py's base / off / on with and without the
# flag (PLAIN=0 skips the run without it), with a kernel profile of the flagged base run; then
# (RUN_ALL=1, the default) runs run_all.sh with XLA_FLAGS set to the faster choice.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/gguf-*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD JAX_PLATFORMS=cuda PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
FLAG=${FLAG:---xla_gpu_enable_dynamic_slice_fusion=true}
P="python3 experiments/bench/decode_probe.py --batches 1 --variants base,base@off,base@on"
[ "${PLAIN:-1}" = 1 ] && timeout 100 $P --tag plain --out "$OUT/probe_plain.json" > /dev/null 2>&1
XLA_FLAGS=$FLAG timeout 120 $P --tag flag --profile base --out "$OUT/probe_flag.json" \
  > /dev/null 2>&1
CHOICE=$(python3 - "$OUT/probe_plain.json" "$OUT/probe_flag.json" "$FLAG" <<'PY'
import json, sys
ms = lambda p: {r["variant"]: r.get("ms_per_step") for r in json.load(open(p))["results"]}
try:
  a, b = ms(sys.argv[1]), ms(sys.argv[2])
  print(a, b, file=sys.stderr)
  print(sys.argv[3] if b["base"] and b["base"] < 0.98 * a["base"] else "")
except Exception as e:
  print(f"no choice: {e!r}", file=sys.stderr)
PY
)
echo "XLA_FLAGS for run_all: '$CHOICE'"
if [ "${RUN_ALL:-1}" = 1 ]; then XLA_FLAGS=$CHOICE bash experiments/bench/run_all.sh; fi
