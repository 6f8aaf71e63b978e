#!/usr/bin/env bash
# On the device: where decode time goes. The 80B-A3B layer shapes at 8 layers (Q4_K_M, decode_probe
# --profile) and the engine against its device program (bench_engine --profile). Results in $OUT.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
t0=$(date +%s)
python3 experiments/bench/make_gguf.py --geometry qwen3next-80b-a3b --layers 8 --out /tmp/a8.gguf --no-progress
timeout 170 python3 experiments/bench/decode_probe.py --gguf /tmp/a8.gguf --variants base --batches 1,8 --n_steps 8 --reps 3 --profile base --out $OUT/decode_probe_a80b_l8.json 2>&1 | grep -v Warning | tail -5
echo "probe done at $(( $(date +%s) - t0 )) s"
timeout $(( 560 - ($(date +%s) - t0) )) python3 experiments/bench/bench_engine.py --reps 1 --profile --out $OUT/bench_engine_run2.json 2>&1 | grep -v -e Warning -e "^ *\"" | tail -30
echo "all done at $(( $(date +%s) - t0 )) s"
