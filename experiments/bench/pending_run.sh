#!/usr/bin/env bash
# On the device, one call (~6 min): the dense GEMV's LoRA epilogue (dense_matmul_lora).
#  1. Compiled: the kernel's GPU test, and the switch's off bit-identity and forms tests, whose
#     batch-1 decode now takes the fused epilogue.
#  2. bench_model decode at batch 1 and 8 (adapter none / off / on): the LoRA cost per layer
#     (run_all of this session: 7.37 / 8.33 µs at 1 / 8 tokens, on 6.27 %).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
t0=$(date +%s)
export JAX_PLATFORMS=cuda
false && timeout 240 python3 -m pytest -p no:cacheprovider -W ignore -q -rfs -n 6 \
  "tests/test_quant_kernel.py::test_gpu_dense_gemv_lora_epilogue" \
  "tests/test_quant_kernel.py::test_gpu_dense_gemv" tests/test_lora_switch.py tests/test_forms.py \
  2>&1 | tee $OUT/gpu_tests_dense_lora.log | tail -4
echo "tests done $(( $(date +%s) - t0 )) s"
timeout $(( ${CAP:-540} - ($(date +%s) - t0) )) python3 experiments/bench/bench_model.py \
  --sections decode --batches 1,8 --lora_alt_impl= --dump_hlo= --out $OUT/bench_model_dense_lora.json \
  2>&1 | grep -e ERROR | head -5
python3 - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/bench_model_dense_lora.json"))
for b, v in d.get("decode", {}).items():
  print(b, {k: (round(x["tokens_per_s"], 1), round(x.get("delta_paired_s", 0) * 1e6 / 32 / 48, 2))
            for k, x in v["variants"].items()})
PY
echo "all done $(( $(date +%s) - t0 )) s"
