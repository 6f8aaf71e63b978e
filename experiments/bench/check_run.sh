#!/usr/bin/env bash
# On the device, one call (~9 min): the compiled cases of the kernels changed since the last
# full GPU test run (quant k_split and its defaults, the experts, the LoRA adapter table in
# fp32), the 80B-A3B layer shapes at 8 layers (decode_probe, batch 1, profile; the switch and
# the predicated quant groups), then
# bench_engine (every batch, one timed run each). Results and logs in $OUT.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
export STRATA_TEST_FAILURE_LOG=$OUT/check_failures.txt JAX_PLATFORMS=cuda   # else the tests skip the GPU
t0=$(date +%s)
timeout 140 python3 -m pytest -p no:cacheprovider -W ignore -q -rfs -n 8 -m gpu \
  tests/test_quant_kernel.py "tests/test_lora_kernel.py::test_gpu_rank_scale_table" \
  2>&1 | tee $OUT/check_gpu_tests.log | tail -6
echo "tests done $(( $(date +%s) - t0 )) s"
python3 experiments/bench/make_gguf.py --geometry qwen3next-80b-a3b --layers 8 --out /tmp/a8.gguf --no-progress
timeout 150 python3 experiments/bench/decode_probe.py --gguf /tmp/a8.gguf --variants base,qpred \
  --batches 1 --n_steps 8 --reps 3 --profile base --out $OUT/decode_probe_a80b_l8_split.json \
  2>&1 | grep '"variant"'
echo "probe done $(( $(date +%s) - t0 )) s"
timeout $(( ${CAP:-530} - ($(date +%s) - t0) )) python3 experiments/bench/bench_engine.py --reps 1 \
  --out $OUT/bench_engine_run4.json 2>&1 | grep -e "^decode" -e "^ttft" -e "^server" -e Error | cut -c1-600
echo "all done $(( $(date +%s) - t0 )) s"
