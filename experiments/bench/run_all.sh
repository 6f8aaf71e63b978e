#!/bin/bash
# Issue #7's benchmarks, one command, on one H200 in under 8 minutes (each step has a time cap
# and writes its JSON as it goes, so a step cut short still leaves what it measured):
#   1. peer_fla_gdn.py      fla's Triton GDN kernels (chunked T=2500, decode batch 1/8/32)
#   2. bench_kernels.py     copy bandwidth + bf16 matmul rate (the rooflines), our GDN ops,
#                           and our chunked output on fla's inputs
#   3. bench_model.py       bench-a3b decode (batch 1/8/32) and prefill (2,500 tokens), adapter
#                           none / off / on, LoRA cost per layer at 1, 8 and 300 tokens
#   4. peer_transformers.py the same model in transformers (bf16, with fla when importable)
#   5. report.py            summary.json + decode/prefill/lora/gdn PNGs
# Results: experiments/results/*.json, *.png (intermediates in experiments/results/tmp/;
# STRATA_BENCH_RESULTS=DIR writes elsewhere; --tiny defaults to experiments/results/tmp/tiny).
#
#   bash experiments/bench/run_all.sh           # on the GPU machine, from anywhere
#   bash experiments/bench/run_all.sh --tiny    # CPU smoke test of every step (toy sizes)
#
# Packages missing on the machine (fla-core, gguf) are installed from .whl/*.whl when that
# folder exists (python3 -m pip download --no-deps ... -d .whl fla-core==0.6.0 gguf==0.19.0).
set -u
cd "$(dirname "$0")/../.." || exit 1
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
TINY=""
CAP=1
if [ "${1:-}" = "--tiny" ]; then
  TINY="--tiny"
  CAP=0  # no time caps on the (slow) CPU smoke test
  export JAX_PLATFORMS=cpu
  # never overwrite the committed results with toy numbers
  export STRATA_BENCH_RESULTS=${STRATA_BENCH_RESULTS:-experiments/results/tmp/tiny}
fi
R=${STRATA_BENCH_RESULTS:-experiments/results}
export STRATA_BENCH_RESULTS=$R
mkdir -p "$R/tmp"
SITE=${STRATA_BENCH_SITE:-/tmp/strata-bench-site}
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" .whl/*.whl || echo "run_all: wheel install failed" >&2
fi
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
rm -f "$R"/bench_kernels.json "$R"/bench_model.json "$R"/peer_fla_gdn.json \
  "$R"/peer_transformers.json "$R"/summary.json

step() {  # step SECONDS NAME COMMAND...
  local cap=$1 name=$2
  shift 2
  [ "$CAP" = 0 ] && cap=0
  local t0=$SECONDS
  echo "=== $name (cap ${cap}s)"
  timeout --kill-after=5 "$cap" "$@"
  local rc=$?
  echo "=== $name: rc=$rc, $((SECONDS - t0)) s"
}

START=$SECONDS
step 130 peer_fla_gdn $PY experiments/bench/peer_fla_gdn.py $TINY
step 40 bench_kernels $PY experiments/bench/bench_kernels.py $TINY
step 210 bench_model $PY experiments/bench/bench_model.py $TINY
step 80 peer_transformers $PY experiments/bench/peer_transformers.py $TINY
step 20 report $PY experiments/bench/report.py
echo "=== run_all: $((SECONDS - START)) s"
