#!/usr/bin/env bash
# On the device, one call (~9 min): what the session of 2026-12-03 (second) measures, after
# Forms' "auto" took the chunk-parallel GDN prefill kernel (C = 64) and the router top-k kernel
# on the GPU.
#  1. SECTIONS=tests: the GPU model test set (off bit-identity, parity against transformers,
#     the forms) on the new defaults, with the chunk-parallel kernel's compiled tests beside it
#     (two pytest processes at once; TEST_CAP=);
#  2. SECTIONS=gdn: gdn_probe.py's chunked op alone against fla's (T = 2,500, bf16 q/k/v);
#  3. SECTIONS=probe: decode_probe.py on bench-a3b: the prefill of 2,500 tokens with the new
#     default against the serial kernel ("gdnkernel"), and decode at batch 1 with the top-k
#     kernel against lax.top_k ("xlatopk");
#  4. SECTIONS=prefill: bench_model.py's prefill section (prefill_roofline_fraction,
#     prefill_vs_transformers) on the new default;
#  older sections: model (bench_model decode), spec (bench_spec), engine (bench_engine, batch 1).
# Results in $OUT (copy them to experiments/results/device/).
set -uo pipefail
t0=$(date +%s)
source "$(dirname "$0")/device_env.sh"
export STRATA_BENCH_RESULTS=$OUT
left() { echo $(( ${CAP:-570} - ($(date +%s) - t0) )); }
want() { [[ ",${SECTIONS:-tests,gdn,probe,prefill}," == *",$1,"* ]]; }
if want tests; then
  (GPU_TESTS=tests/test_gdn_parallel_kernel.py GPU_SET=kernels WORKERS=3 CAP=${TEST_CAP:-260} \
    bash "$(dirname "$0")/gpu_tests.sh" 2>&1 | tail -2 | sed 's/^/parallel kernel: /') &
  sleep 20  # the other set installs the wheels into /tmp/site first
  GPU_SET=model WORKERS=8 CAP=${TEST_CAP:-260} bash "$(dirname "$0")/gpu_tests.sh" 2>&1 | tail -2
  wait
  echo "tests done $(( $(date +%s) - t0 )) s"
fi
if want gdn; then
  # fla's wheels too (gpu_tests.sh leaves them out: the parity tests want transformers' torch path)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site-fla .whl/fla*.whl .whl/flash_linear*.whl .whl/einops*.whl >/dev/null 2>&1
  PYTHONPATH=/tmp/site-fla:$PYTHONPATH timeout 150 python3 experiments/bench/gdn_probe.py \
    --skip decode,floor,layers,sweep --budget_s 120 --out $OUT/gdn_probe.json 2>&1 \
    | grep -e "^chunked" -e "'chunk'" -e rror | cut -c1-260
  echo "gdn probe done $(( $(date +%s) - t0 )) s"
fi
if want probe; then
  timeout 120 python3 experiments/bench/decode_probe.py --prefill 2500 --variants base,gdnkernel \
    --reps 5 --out $OUT/decode_probe_prefill.json 2>&1 | grep '"variant"' | cut -c1-200
  timeout 120 python3 experiments/bench/decode_probe.py --variants base,xlatopk --batches 1 \
    --n_steps 16 --reps 5 --out $OUT/decode_probe_topk.json 2>&1 | grep '"variant"' | cut -c1-200
  echo "probes done $(( $(date +%s) - t0 )) s"
fi
if want prefill; then
  timeout $(left) python3 experiments/bench/bench_model.py --sections prefill --dump_hlo "" \
    --kernels_json experiments/results/bench_kernels.json \
    --out $OUT/bench_model_prefill.json 2>&1 | grep -i -e "^prefill" -e error | cut -c1-200
  echo "bench_model done $(( $(date +%s) - t0 )) s"
fi
if want model; then
  timeout ${MODEL_CAP:-210} python3 experiments/bench/bench_model.py --sections decode \
    --alt_batches "" --dump_hlo "" --kernels_json experiments/results/bench_kernels.json \
    --out $OUT/bench_model_decode.json 2>&1 | grep -i -e "^decode" -e error | cut -c1-200
  echo "bench_model done $(( $(date +%s) - t0 )) s"
fi
want spec && timeout $(left) python3 experiments/bench/bench_spec.py --out $OUT/bench_spec.json \
  --nosummary 2>&1 | grep -i -e ratio -e speedup -e error | cut -c1-200
want engine && timeout $(left) python3 experiments/bench/bench_engine.py --reps 3 --batches 1 \
  --out $OUT/bench_engine_b1.json 2>&1 | grep -e "^decode" -e Error | cut -c1-300
rm -rf $OUT/tmp
echo "all done $(( $(date +%s) - t0 )) s"
