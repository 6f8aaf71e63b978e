#!/usr/bin/env bash
# On the device, one call (~8 min): what the session of 2026-12-03 (fourth) measures first.
#  1. SECTIONS=tests: the GPU model set (forms, switch, greedy decode, transformers parity) on
#     the defaults of this commit, `gemv_lora` "auto" = "rows_dense" on the GPU (never run
#     compiled with that default before);
#  2. SECTIONS=probe: decode_probe.py at batch 1 and 8: no adapter, the adapter on with the
#     default forms, and "apart"; kernel profiles of the first two at each batch, so the
#     adapter's kernels show as the difference;
#  3. SECTIONS=gdn: gdn_probe.py's decode (batch 1/8/32) and launch floor with --profile: the
#     GPU time of our fused decode kernel beside its chained wall time and fla's CUDA-graph
#     time (fla from its own path, this probe only).
# Results in $OUT (copy them to experiments/results/device/).
set -uo pipefail
t0=$(date +%s)
source "$(dirname "$0")/device_env.sh"
export STRATA_BENCH_RESULTS=$OUT
left() { echo $(( ${CAP:-570} - ($(date +%s) - t0) )); }
want() { [[ ",${SECTIONS:-tests,probe,gdn}," == *",$1,"* ]]; }
# The prefill attention kernel's compiled tests within CAP seconds, logged as
# $OUT/gpu_tests_attn_prefill.log.
prefill_kernel_tests() {
  GPU_SET=kernels GPU_TESTS="tests/test_attention_prefill_kernel.py" CAP=$1 WORKERS=2 \
    bash experiments/bench/gpu_tests.sh | tail -2
  mv $OUT/gpu_tests_kernels.log $OUT/gpu_tests_attn_prefill.log 2>/dev/null
}
# The transformers peer (HF eager `generate`, fla's kernels bound) within $1 s, to $OUT/$2.
peer() {
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fla \
    .whl/fla_core-*.whl .whl/flash_linear_attention-*.whl >/dev/null 2>&1
  PYTHONPATH=/tmp/fla:$PYTHONPATH timeout $1 python3 experiments/bench/peer_transformers.py \
    --out $OUT/$2 2>&1 | grep -i -e prefill -e decode -e error | cut -c1-300
}
# On an H200 only (the card of summary.json's prefill figures): the 2,500-token prefill
# program and the transformers peer, to $OUT/decode_probe_prefill_$1.json and
# peer_transformers_$1.json.
h200_prefill_and_peer() {
  nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 || return 0
  timeout 60 python3 experiments/bench/decode_probe.py --prefill 2500 --reps 5 \
    --variants base --out $OUT/decode_probe_prefill_$1.json 2>&1 \
    | grep -e '"variant"' -e Error | cut -c1-330
  peer 150 peer_transformers_$1.json
}
# The Engine at batch 1, two reps, in what is left of CAP (if 100 s are), to $OUT/$1; $2: forms.
engine_b1() {
  [ $(left) -gt 100 ] || return 0
  timeout $(( $(left) - 5 )) python3 experiments/bench/bench_engine.py --reps 2 --batches 1 \
    ${2:+--forms $2} --out $OUT/$1 2>&1 | grep -e "^decode" -e "^ttft" -e "^compiled" -e Error \
    | cut -c1-300
}
# decode_probe.py at batch 1 from 128-token prompts at the Engine's 2,560-key capacity (the
# Engine's program: run 81), 16 steps a call: $1 timeout s, $2 output file in $OUT, $3 variants,
# $4 variants profiled (may be empty), $5 reps (default 5).
probe_b1() {
  timeout $1 python3 experiments/bench/decode_probe.py --batches 1 --n_steps 16 --reps ${5:-5} \
    --max_seq 2560 --prompt 128 --variants $3 ${4:+--profile $4} --out $OUT/$2 2>&1 \
    | grep -e '"variant"' -e Error | cut -c1-200
}
# Session of 2026-12-03 (fifth), after the MoE decode kernels changed (moe_down one program
# per (row, expert, D block); grouped row tiles from the pairs):
#  call A, SECTIONS=s5tests,s5model: the GPU model set (transformers parity, greedy decode,
#    forms, switch), the compiled moe kernel tests, bench_model's decode at batch 1 / 8 / 32;
#  call B, SECTIONS=owed,s5probe: what stop 37 owed (the Engine on dense_dot, the
#    fp32-yardstick LoRA test, GDN at batch 32), then decode_probe's kernel profiles at
#    batch 1 / 8.
if want s5tests; then
  GPU_SET=model CAP=${TEST_CAP:-210} WORKERS=8 bash experiments/bench/gpu_tests.sh | tail -3
  GPU_SET=kernels GPU_TESTS="tests/test_moe_kernel.py tests/test_moe_grouped_kernel.py" \
    CAP=${KTEST_CAP:-90} WORKERS=4 bash experiments/bench/gpu_tests.sh | tail -3
  echo "s5tests done $(( $(date +%s) - t0 )) s"
fi
if want s5model; then
  timeout $(left) python3 experiments/bench/bench_model.py --sections decode \
    --batches 1,8,32 --alt_batches "" --dump_hlo "" --kernels_json experiments/results/bench_kernels.json \
    --out $OUT/bench_model_decode.json 2>&1 | grep -i -e "^decode" -e error | cut -c1-200
  echo "s5model done $(( $(date +%s) - t0 )) s"
fi
if want s5probe; then
  timeout ${PROBE_CAP:-150} python3 experiments/bench/decode_probe.py --variants base \
    --batches ${PROBE_BATCHES:-1,8} --n_steps 16 --reps 5 --profile base \
    --out $OUT/decode_probe_moe.json 2>&1 | grep '"variant"' | cut -c1-220
  echo "s5probe done $(( $(date +%s) - t0 )) s"
fi
#  call C, SECTIONS=s5attn: the decode attention kernel (pallas_kernels/attention,
#    Forms.attn_decode "auto" = "pallas" on the GPU): its compiled tests first (nothing else
#    runs if they fail), then the GPU model set, bench_model's decode, and the Engine at
#    batch 1 (a 2,560-key capacity, where the XLA form scored every key).
if want s5attn; then
  JAX_PLATFORMS=cuda timeout 90 python3 -m pytest -p no:cacheprovider -W ignore -q -rfs \
    tests/test_attention_decode_kernel.py 2>&1 | tee $OUT/gpu_tests_attn_decode.log | tail -4
  if grep -q failed $OUT/gpu_tests_attn_decode.log || ! grep -q passed $OUT/gpu_tests_attn_decode.log; then
    echo "attention kernel tests failed: stopping"; exit 1
  fi
  GPU_SET=model CAP=${TEST_CAP:-200} WORKERS=8 bash experiments/bench/gpu_tests.sh | tail -3
  timeout ${MODEL_CAP:-100} python3 experiments/bench/bench_model.py --sections decode \
    --batches 1,8,32 --alt_batches "" --dump_hlo "" --kernels_json experiments/results/bench_kernels.json \
    --out $OUT/bench_model_decode.json 2>&1 | grep -i -e "^decode" -e error | cut -c1-200
  echo "s5attn model done $(( $(date +%s) - t0 )) s"
  timeout $(left) python3 experiments/bench/bench_engine.py --reps 3 --batches 1 \
    --out $OUT/bench_engine_b1.json 2>&1 | grep -e "^decode" -e Error | cut -c1-300
fi
# Session of 2026-12-03 (sixth): a layer's projections of one input in one launch
# (pallas_kernels/quant/multi.py, Forms.dense_launch "auto" = "fused").
#  call A, SECTIONS=s6a: the compiled multi-launch tests (nothing else runs if they fail), the
#    GPU model set on this commit, decode_probe's fused / apart A/B at batch 1 / 32 with
#    kernel profiles and the HLO of the fused program, and the Engine at batch 1 / 32 with
#    its profile (the batch-1 gap between the Engine's program and bench_model's).
if want s6a; then
  JAX_PLATFORMS=cuda timeout 90 python3 -m pytest -p no:cacheprovider -W ignore -q -rfs \
    tests/test_multi_launch_kernel.py tests/test_moe_topk_kernel.py 2>&1 | tee $OUT/gpu_tests_multi.log | tail -4
  if grep -q failed $OUT/gpu_tests_multi.log || ! grep -q passed $OUT/gpu_tests_multi.log; then
    echo "multi-launch kernel tests failed: stopping"; exit 1
  fi
  GPU_SET=model CAP=${TEST_CAP:-170} WORKERS=8 bash experiments/bench/gpu_tests.sh | tail -3
  echo "s6a tests done $(( $(date +%s) - t0 )) s"
  timeout ${PROBE_CAP:-150} python3 experiments/bench/decode_probe.py --variants fused,apart \
    --batches 1,32 --n_steps 16 --reps 5 --profile fused,apart --dump-hlo $OUT/hlo \
    --out $OUT/decode_probe_multi.json 2>&1 | grep '"variant"' | cut -c1-220
  echo "s6a probe done $(( $(date +%s) - t0 )) s"
  timeout $(left) python3 experiments/bench/bench_engine.py --reps 3 --batches 1,32 --profile \
    --out $OUT/bench_engine.json 2>&1 | grep -e "^decode" -e "^serve" -e Error | cut -c1-300
fi
#  call B, SECTIONS=s6b: the dense GEMV's narrower steps for small matrices against the wide
#    ones (decode_probe, batch 1), the Engine at batch 1 / 8 / 32 with the forms load_model resolves
#    (bench_engine.py ran unresolved forms before: the scanned weights), then bench_model's
#    decode at batch 1 / 8 / 32 (the roofline fractions and the adapter's cost on this commit).
if want s6b; then
  timeout ${PROBE_CAP:-90} python3 experiments/bench/decode_probe.py --variants base,widesteps \
    --batches 1 --n_steps 16 --reps 5 --out $OUT/decode_probe_steps.json 2>&1 | grep '"variant"' | cut -c1-200
  timeout ${ENGINE_CAP:-300} python3 experiments/bench/bench_engine.py --reps 3 --batches 1,8,32 \
    --out $OUT/bench_engine.json 2>&1 | grep -e "^decode" -e Error | cut -c1-300
  echo "s6b engine done $(( $(date +%s) - t0 )) s"
  timeout $(left) python3 experiments/bench/bench_model.py --sections decode \
    --batches 1,8,32 --alt_batches "" --dump_hlo "" --kernels_json experiments/results/bench_kernels.json \
    --out $OUT/bench_model_decode.json 2>&1 | grep -i -e "^decode" -e error | cut -c1-200
fi
# Session of 2026-12-03 (seventh): the routing kernel adds the router GEMV's split partials and
# stores [N, k] itself (two launches a layer fewer).
#  call A, SECTIONS=s7a: the compiled routing / multi-launch tests (nothing else runs if they
#    fail), the few-token MoE kernels' tilings (moe_sweep.py, batch 1 and 8), and
#    decode_probe's A/B of the routing: base, XLA adding the partials ("routesum"), one warp
#    ("route1w"), at batch 1 and 32, with the base's kernel profile.
if want s7a; then
  JAX_PLATFORMS=cuda timeout ${TEST_CAP:-150} python3 -m pytest -p no:cacheprovider -W ignore -q -rfs \
    -n 4 tests/test_moe_topk_kernel.py tests/test_multi_launch_kernel.py 2>&1 | tee $OUT/gpu_tests_route.log | tail -4
  if grep -q failed $OUT/gpu_tests_route.log || ! grep -q passed $OUT/gpu_tests_route.log; then
    echo "routing kernel tests failed: stopping"; exit 1
  fi
  timeout ${SWEEP_CAP:-170} python3 experiments/bench/moe_sweep.py --rows 1,8 --budget-s 150 \
    --out $OUT/moe_sweep.json 2>&1 | grep -e best -e Error | cut -c1-400
  echo "s7a sweep done $(( $(date +%s) - t0 )) s"
  timeout $(left) python3 experiments/bench/decode_probe.py --variants base,routesum,route1w \
    --batches 1,32 --n_steps 16 --reps 5 --profile base \
    --out $OUT/decode_probe_route.json 2>&1 | grep '"variant"' | cut -c1-200
fi
#  call B, SECTIONS=s7b: the GPU model set on this commit (the model's routing now hands the
#    router GEMV's partials to the kernel), bench_model's decode at batch 1 / 8 / 32 (roofline
#    fractions, the adapter's cost), then the MoE tiling sweep in what time is left.
if want s7b; then
  GPU_SET=model CAP=${TEST_CAP:-220} WORKERS=8 bash experiments/bench/gpu_tests.sh | tail -3
  echo "s7b tests done $(( $(date +%s) - t0 )) s"
  timeout ${MODEL_CAP:-170} python3 experiments/bench/bench_model.py --sections decode \
    --batches 1,8,32 --alt_batches "" --dump_hlo "" --kernels_json experiments/results/bench_kernels.json \
    --out $OUT/bench_model_decode.json 2>&1 | grep -i -e "^decode" -e error | cut -c1-200
  echo "s7b model done $(( $(date +%s) - t0 )) s"
  timeout $(left) python3 experiments/bench/moe_sweep.py --rows 1,8 --budget-s $(( $(left) - 40 )) \
    --out $OUT/moe_sweep.json 2>&1 | grep -e best -e Error -e ready | cut -c1-400
fi
#  call C, SECTIONS=s7c: the Engine at batch 1 / 8 / 32 on this commit with the server leg at
#    batch 32 (fastapi and its dependencies now carried), then bench_spec.
if want s7c; then
  timeout ${ENGINE_CAP:-330} python3 experiments/bench/bench_engine.py --reps 3 --batches 8,1 \
    --out $OUT/bench_engine.json 2>&1 | grep -e "^decode" -e "^serve" -e Error | cut -c1-300
  echo "s7c engine done $(( $(date +%s) - t0 )) s"
  timeout ${SPEC_CAP:-150} python3 experiments/bench/bench_spec.py --ns 2,3,4 \
    --out $OUT/bench_spec.json 2>&1 | tail -4 | cut -c1-300
  # One adapted row through dense_dot (gemv_lora "dot"): 5.54 against the GEMV rows form's
  # 3.20 us a layer in run 27, with 64-row tiles; the 128-row tiles halved batch 8's cost.
  timeout $(left) python3 experiments/bench/decode_probe.py \
    --variants base,base@on,loradot@on,base@on,loradot@on --batches 1 --n_steps 16 --reps 7 \
    --out $OUT/decode_probe_owed13_loradot.json 2>&1 | grep '"variant"' | cut -c1-120
fi
# Owed to the next session (SECTIONS=owed9a, then SECTIONS=owed9b; ~8 min each):
#  owed9a: why the attention prologue costs the Engine's sampling program 4.6 % at batch 1 where
#    the plain decode program gains (runs 43, 45, 46): both programs' optimised HLO under each
#    form (bench_engine --dump-hlo; count the copies of the K/V stacks), then the Engine at
#    batch 32 / 8 with the server leg (not measured since run 34 / 16);
#  owed9b: the MoE tiling sweep (never produced a row on the device), the GDN layer kernel at
#    batch 32 with Dv tiles of 64 and 128, bench_spec (not re-measured since run 5).
if want owed9a; then
  for f in pallas pallas_prologue; do
    timeout ${HLO_CAP:-150} python3 experiments/bench/bench_engine.py --reps 1 --batches 1 \
      --forms attn_decode=$f --dump-hlo $OUT/hlo_attn_$f \
      --out $OUT/bench_engine_b1_$f.json 2>&1 | grep -e "^decode" -e Error | cut -c1-200
    for h in $OUT/hlo_attn_$f/*; do echo "$h $(zgrep -c " copy(" $h) copies"; done
  done
  timeout $(left) python3 experiments/bench/bench_engine.py --reps 3 --batches 32,8 \
    --out $OUT/bench_engine_b32.json 2>&1 | grep -e "^decode" -e "^serve" -e Error | cut -c1-300
fi
if want owed9b; then
  timeout ${SWEEP_CAP:-200} python3 experiments/bench/moe_sweep.py --rows 1,8 --budget-s 170 \
    --out $OUT/moe_sweep.json 2>&1 | grep -e best -e Error -e ready | cut -c1-400
  timeout ${PROBE_CAP:-120} python3 experiments/bench/decode_probe.py \
    --variants base,gdnlayer,gdnlayer+lbv128+lw8 --batches 32 --n_steps 16 --reps 5 \
    --out $OUT/decode_probe_layer_b32.json 2>&1 | grep '"variant"' | cut -c1-160
  timeout ${SPEC_CAP:-150} python3 experiments/bench/bench_spec.py --ns 2,3,4 \
    --out $OUT/bench_spec.json 2>&1 | tail -4 | cut -c1-300
  # One adapted row through dense_dot (gemv_lora "dot"): 5.54 against the GEMV rows form's
  # 3.20 us a layer in run 27, with 64-row tiles; the 128-row tiles halved batch 8's cost.
  timeout $(left) python3 experiments/bench/decode_probe.py \
    --variants base,base@on,loradot@on,base@on,loradot@on --batches 1 --n_steps 16 --reps 7 \
    --out $OUT/decode_probe_owed13_loradot.json 2>&1 | grep '"variant"' | cut -c1-120
fi
# Session of 2026-12-04 (eighth), after attn_decode "auto" became "pallas_prologue" (run 43):
#  call B, SECTIONS=s8model,s8engine1: the GPU model set on the new default, the Engine at batch 1;
#  call C, SECTIONS=s8engine,s8probe: the Engine at batch 32 / 8 with the server leg, the GDN layer
#    kernel at wider Dv tiles (decode_probe), bench_spec with what time is left.
if want s8model; then
  GPU_SET=model CAP=${TEST_CAP:-230} WORKERS=8 bash experiments/bench/gpu_tests.sh | tail -3
  echo "s8model done $(( $(date +%s) - t0 )) s"
fi
if want s8engine1; then
  timeout $(left) python3 experiments/bench/bench_engine.py --reps 3 --batches 1 \
    --out $OUT/bench_engine_b1.json 2>&1 | grep -e "^decode" -e "^serve" -e "^ttft" -e Error | cut -c1-300
fi
if want s8engine; then
  timeout ${ENGINE_CAP:-280} python3 experiments/bench/bench_engine.py --reps 3 --batches 32,8 \
    --out $OUT/bench_engine_b32.json 2>&1 | grep -e "^decode" -e "^serve" -e Error | cut -c1-300
  echo "s8engine done $(( $(date +%s) - t0 )) s"
fi
if want s8probe; then
  timeout ${PROBE_CAP:-200} python3 experiments/bench/decode_probe.py \
    --variants base,attnkernel,gdnlayer+lbv64,gdnlayer+lbv128+lw8,gdnlayer+lbv128+lw16 \
    --batches 1,32 --n_steps 16 --reps 5 --out $OUT/decode_probe_layer_tiles.json 2>&1 \
    | grep '"variant"' | cut -c1-160
  echo "s8probe done $(( $(date +%s) - t0 )) s"
  timeout ${SPEC_CAP:-150} python3 experiments/bench/bench_spec.py --ns 2,3,4 \
    --out $OUT/bench_spec.json 2>&1 | tail -4 | cut -c1-300
  # One adapted row through dense_dot (gemv_lora "dot"): 5.54 against the GEMV rows form's
  # 3.20 us a layer in run 27, with 64-row tiles; the 128-row tiles halved batch 8's cost.
  timeout $(left) python3 experiments/bench/decode_probe.py \
    --variants base,base@on,loradot@on,base@on,loradot@on --batches 1 --n_steps 16 --reps 7 \
    --out $OUT/decode_probe_owed13_loradot.json 2>&1 | grep '"variant"' | cut -c1-120
fi
# Owed to the next session (SECTIONS=owed8, ~9 min; carry .whl with opentelemetry-api: fastapi
# 0.165 imports it, run 40): the GDN layer kernel and the attention prologue kernel compiled
# (their tests first: nothing else runs if they fail), then decode_probe's A/B at batch 1 and
# 32 of the fused step (base), the layer kernel (Forms.gdn_decode="pallas_layer", "gdnlayer";
# at 8 warps, Dv tiles of 32), the prologue (attn_decode="pallas_prologue", "attnpro"), both,
# and four routing warps everywhere ("route4w"); the Engine at batch 32 / 8 on this commit with the server leg at 32; the MoE
# tiling sweep (its stacks now arguments); bench_spec.
# Split over two calls in the session of 2026-12-04: owed8a (the tests and the A/B), owed8b (the
# Engine, the sweep, bench_spec); owed8 runs both.
if want owed8 || want owed8a; then
  JAX_PLATFORMS=cuda timeout ${TEST_CAP:-100} python3 -m pytest -p no:cacheprovider -W ignore -q -rfs \
    -n 4 tests/test_gdn_decode_layer_kernel.py tests/test_attention_prologue_kernel.py 2>&1 \
    | tee $OUT/gpu_tests_layer_kernels.log | tail -4
  # the compiled kernels gate the measurement (the interpreted cases' failures are reported)
  if grep -q "FAILED.*test_gpu_" $OUT/gpu_tests_layer_kernels.log || ! grep -q passed $OUT/gpu_tests_layer_kernels.log; then
    echo "compiled layer kernel tests failed: stopping"; exit 1
  fi
  timeout ${PROBE_CAP:-190} python3 experiments/bench/decode_probe.py \
    --variants base,gdnlayer,gdnlayer+lw8,gdnlayer+lbv32,attnpro,gdnlayer+attnpro,route4w \
    --batches 1,32 --n_steps 16 --reps 5 --profile gdnlayer+attnpro --out $OUT/decode_probe_layer_kernels.json 2>&1 \
    | grep '"variant"' | cut -c1-200
  echo "owed8a done $(( $(date +%s) - t0 )) s"
fi
if want owed8 || want owed8b; then
  timeout ${ENGINE_CAP:-260} python3 experiments/bench/bench_engine.py --reps 3 --batches 32,8 \
    --out $OUT/bench_engine_b32.json 2>&1 | grep -e "^decode" -e "^serve" -e Error | cut -c1-300
  echo "owed8 engine done $(( $(date +%s) - t0 )) s"
  timeout ${SWEEP_CAP:-120} python3 experiments/bench/moe_sweep.py --rows 1,8 --budget-s 100 \
    --out $OUT/moe_sweep.json 2>&1 | grep -e best -e Error -e ready | cut -c1-400
  timeout ${SPEC_CAP:-150} python3 experiments/bench/bench_spec.py --ns 2,3,4 \
    --out $OUT/bench_spec.json 2>&1 | tail -4 | cut -c1-300
  # One adapted row through dense_dot (gemv_lora "dot"): 5.54 against the GEMV rows form's
  # 3.20 us a layer in run 27, with 64-row tiles; the 128-row tiles halved batch 8's cost.
  timeout $(left) python3 experiments/bench/decode_probe.py \
    --variants base,base@on,loradot@on,base@on,loradot@on --batches 1 --n_steps 16 --reps 7 \
    --out $OUT/decode_probe_owed13_loradot.json 2>&1 | grep '"variant"' | cut -c1-120
fi
# Owed to the next session (SECTIONS=owed7, ~9 min; carry uvicorn, h11, click and fastapi,
# starlette (+ what `pip download fastapi` brings) in .whl for the server leg): the GPU model set
# whole (run 33's stopped at its 170 s cap with none failed), the Engine at batch 32 on the
# resolved forms with the server leg (run 34's batch-32 leg hit its cap), and bench_spec (owed
# since the MoE changes).
if want owed7; then
  GPU_SET=model CAP=${TEST_CAP:-240} WORKERS=8 bash experiments/bench/gpu_tests.sh | tail -3
  # the routing kernel at one warp against four (topk.ROUTE_WARPS), batch 1 and 32
  timeout ${PROBE_CAP:-100} python3 experiments/bench/decode_probe.py --variants base,route1w \
    --batches 1,32 --n_steps 16 --reps 5 --out $OUT/decode_probe_route.json 2>&1 \
    | grep '"variant"' | cut -c1-200
  timeout ${ENGINE_CAP:-200} python3 experiments/bench/bench_engine.py --reps 3 --batches 32 \
    --out $OUT/bench_engine_b32.json 2>&1 | grep -e "^decode" -e "^serve" -e Error | cut -c1-300
  timeout ${SPEC_CAP:-150} python3 experiments/bench/bench_spec.py --ns 2,3,4 \
    --out $OUT/bench_spec.json 2>&1 | tail -4 | cut -c1-300
  # One adapted row through dense_dot (gemv_lora "dot"): 5.54 against the GEMV rows form's
  # 3.20 us a layer in run 27, with 64-row tiles; the 128-row tiles halved batch 8's cost.
  timeout $(left) python3 experiments/bench/decode_probe.py \
    --variants base,base@on,loradot@on,base@on,loradot@on --batches 1 --n_steps 16 --reps 7 \
    --out $OUT/decode_probe_owed13_loradot.json 2>&1 | grep '"variant"' | cut -c1-120
fi
# Owed to the next session (SECTIONS=owed6, ~9 min; carry uvicorn, h11 and click in .whl for
# the server leg): the GPU model set on this commit (run 31 did not reach test_mixed_batch_rows
# and test_greedy_32_tokens, and the fp32 precision test's new reading has not run), the
# attention kernel compiled in an fp32 model (test_forms.py's attn_decode[pallas] case, in the
# model set), bench_spec (verify and drafts
# after the MoE changes), and the Engine at batch 1 with a kernel profile (its program runs
# 190.5 tok/s where bench_model's runs 225.5).
if want owed6; then
  GPU_SET=model CAP=${TEST_CAP:-220} WORKERS=8 bash experiments/bench/gpu_tests.sh | tail -3
  JAX_PLATFORMS=cuda timeout 60 python3 -m pytest -p no:cacheprovider -W ignore -q \
    tests/test_model_parity.py -k "greedy" 2>&1 | tail -2
  timeout ${SPEC_CAP:-150} python3 experiments/bench/bench_spec.py --ns 2,3,4 \
    --out $OUT/bench_spec.json 2>&1 | tail -4 | cut -c1-300
  timeout $(left) python3 experiments/bench/bench_engine.py --reps 3 --batches 1,32 ${ENGINE_PROFILE:-} \
    --out $OUT/bench_engine.json 2>&1 | grep -e "^decode" -e "^serve" -e Error | cut -c1-300
fi
# Second call: SECTIONS=ddtests,sweep,ddprobe (the tensor-core few-row kernel, dense_dot.py).
# Owed to the next session (SECTIONS=owed, ~9 min): the bf16 dense_dot LoRA model test in its
# fp32-yardstick form compiled, the Engine at batch 8 / 32 / 1 on dense_dot (greedy, sampled,
# against its decode_greedy), and the GDN decode's GPU time at batch 32 beside fla's.
if want owed; then
  JAX_PLATFORMS=cuda timeout ${TEST_CAP:-100} python3 -m pytest -p no:cacheprovider -W ignore \
    -q -rfs -n 4 tests/test_forms.py -k "dense_dot_lora" 2>&1 \
    | tee $OUT/gpu_tests_dense_dot_lora_fp32_yardstick.log | tail -3
  timeout ${ENGINE_CAP:-330} python3 experiments/bench/bench_engine.py --reps 3 --batches 8,32,1 \
    --out $OUT/bench_engine_densedot.json 2>&1 | grep -e "^decode" -e Error | cut -c1-300
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fla \
    .whl/fla_core-*.whl .whl/flash_linear_attention-*.whl >/dev/null 2>&1
  PYTHONPATH=/tmp/fla:$PYTHONPATH timeout $(left) python3 experiments/bench/gdn_probe.py \
    --batches 32 --profile --profile_batches 32 --skip chunked,layers,sweep,ffi,floor \
    --out $OUT/gdn_probe_decode_b32.json 2>&1 | grep -e "^decode" -e "done" | cut -c1-300
fi
# Fourth call: SECTIONS=lotests,lomodel,spec (the adapter inside dense_dot's launch at 2 to 64
# rows, and at one row under gemv_lora=dot).
if want lotests; then
  JAX_PLATFORMS=cuda timeout ${TEST_CAP:-120} python3 -m pytest -p no:cacheprovider -W ignore \
    -q -rfs -n 8 tests/test_dense_dot_kernel.py tests/test_forms.py \
    tests/test_lora_switch.py -k "dense_dot or gemv_lora_rows or mixed_batch or off_is_bit" \
    2>&1 | tee $OUT/gpu_tests_dense_dot_lora.log | tail -3
  echo "lotests done $(( $(date +%s) - t0 )) s"
fi
if want lomodel; then
  timeout ${MODEL_CAP:-150} python3 experiments/bench/bench_model.py --sections decode \
    --batches 1,8,32 --alt_batches 1 --lora_alt_impl gemv_lora=dot --dump_hlo "" \
    --kernels_json experiments/results/bench_kernels.json \
    --out $OUT/bench_model_decode.json 2>&1 | grep -i -e "^decode" -e error | cut -c1-200
  echo "bench_model done $(( $(date +%s) - t0 )) s"
fi
# Third call: SECTIONS=tests,model,spec (the GPU model set, bench_model's decode at batch
# 1/8/32, bench_spec: with dense_dot the default at 2 to 64 rows).
if want model; then
  timeout ${MODEL_CAP:-200} python3 experiments/bench/bench_model.py --sections decode \
    --batches 1,8,32 --alt_batches "" --dump_hlo "" --kernels_json experiments/results/bench_kernels.json \
    --out $OUT/bench_model_decode.json 2>&1 | grep -i -e "^decode" -e error | cut -c1-200
  echo "bench_model done $(( $(date +%s) - t0 )) s"
fi
if want spec; then
  timeout $(left) python3 experiments/bench/bench_spec.py --ns 2,3,4 --out $OUT/bench_spec.json 2>&1 \
    | tail -4 | cut -c1-300
  echo "spec done $(( $(date +%s) - t0 )) s"
fi
if want ddtests; then
  JAX_PLATFORMS=cuda timeout ${TEST_CAP:-120} python3 -m pytest -p no:cacheprovider -W ignore \
    -q -rfs -n 4 tests/test_dense_dot_kernel.py 2>&1 | tee $OUT/gpu_tests_dense_dot.log | tail -3
  echo "ddtests done $(( $(date +%s) - t0 )) s"
fi
if want sweep; then
  timeout ${SWEEP_CAP:-200} python3 experiments/bench/dense_dot_sweep.py --budget-s 150 \
    --out $OUT/dense_dot_sweep.json 2>&1 | grep -e "^best" -e rror | cut -c1-200
  echo "sweep done $(( $(date +%s) - t0 )) s"
fi
if want ddprobe; then
  timeout ${PROBE_CAP:-200} python3 experiments/bench/decode_probe.py \
    --variants base,fewxla --batches ${DD_BATCHES:-8,32} --n_steps 16 --reps 5 \
    --profile base --out $OUT/decode_probe_dense_dot.json 2>&1 | grep '"variant"' | cut -c1-220
  echo "ddprobe done $(( $(date +%s) - t0 )) s"
fi
if want tests; then
  GPU_SET=model CAP=${TEST_CAP:-200} WORKERS=8 bash experiments/bench/gpu_tests.sh | tail -3
  echo "tests done $(( $(date +%s) - t0 )) s"
fi
if want probe; then
  timeout ${PROBE_CAP:-200} python3 experiments/bench/decode_probe.py \
    --variants base,base@on,loraapart@on --batches 1,8 --n_steps 32 --reps 7 \
    --profile base,base@on --out $OUT/decode_probe_lora_profile.json 2>&1 \
    | grep '"variant"' | cut -c1-200
  echo "probe done $(( $(date +%s) - t0 )) s"
fi
if want gdn; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fla \
    .whl/fla_core-*.whl .whl/flash_linear_attention-*.whl >/dev/null 2>&1
  PYTHONPATH=/tmp/fla:$PYTHONPATH timeout $(left) python3 experiments/bench/gdn_probe.py \
    --profile --profile_batches 1,8,32 --skip chunked,layers,sweep,ffi --budget_s 120 \
    --out $OUT/gdn_probe_decode_profile.json 2>&1 | grep -e "^decode" -e "done" | cut -c1-300
fi
# Owed to the next session (SECTIONS=owed10; ~7 min): the canonical benches on the defaults of
# stop 42, which runs 47-50 measured only in parts: bench_model's decode at batch 1 / 8 / 32
# (the roofline and LoRA entries of summary.json, last run 39; run 50's decode_probe put the
# adapter's cost 1 point away from them), then the Engine at batch 1 with three reps (run 47's
# batch-1 legs were one rep each, taken for the HLO).
if want owed10; then
  timeout ${MODEL_CAP:-200} python3 experiments/bench/bench_model.py --sections decode \
    --batches 1,8,32 --alt_batches "" --dump_hlo "" --kernels_json experiments/results/bench_kernels.json \
    --out $OUT/bench_model_decode.json 2>&1 | grep -i -e "^decode" -e error | cut -c1-200
  timeout $(left) python3 experiments/bench/bench_engine.py --reps 3 --batches 1 \
    --out $OUT/bench_engine_b1.json 2>&1 | grep -e "^decode" -e "^ttft" -e Error | cut -c1-300
fi
# Session of 2026-12-04 (tenth), SECTIONS=pfin (~6 min): `proj_finish="kernel"` (one kernel
# after each mixer's output projection: split sums, B h, residual, next norm) against the
# default: its compiled kernel tests and the forms test, then decode_probe with no adapter,
# on and off in both forms at batch 1 / 8 / 32, and kernel profiles at batch 1.
if want pfin; then
  JAX_PLATFORMS=cuda timeout ${TEST_CAP:-150} python3 -m pytest -p no:cacheprovider -W ignore \
    -q -rfs -n 4 tests/test_finish_kernel.py tests/test_forms.py -k "finish or split" 2>&1 \
    | tee $OUT/gpu_tests_finish.log | tail -3
  for b in ${PFIN_BATCHES:-1 8 32}; do
    prof=""; [ "$b" = 1 ] && prof="--profile pfin,pfin@on"
    timeout ${PROBE_CAP:-150} python3 experiments/bench/decode_probe.py \
      --variants base,base@on,base@off,pfin,pfin@on,pfin@off --batches $b --n_steps 16 \
      --reps 5 $prof --out $OUT/decode_probe_pfin_b$b.json 2>&1 | grep '"variant"' | cut -c1-160
  done
  echo "pfin done $(( $(date +%s) - t0 )) s"
fi
# Then SECTIONS=pfin2 (~7 min): B h in the projection's launch and the kernel per column tile,
# "auto" = "gemv" (the kernel at one row): its compiled kernel and forms tests, the GPU model
# set on the new default, then decode_probe at batch 1 against "xla" (no adapter, on, off),
# kernel profiles of the default.
if want pfin2; then
  JAX_PLATFORMS=cuda timeout ${TEST_CAP:-120} python3 -m pytest -p no:cacheprovider -W ignore \
    -q -rfs -n 4 tests/test_finish_kernel.py tests/test_forms.py -k "finish or split" 2>&1 \
    | tee $OUT/gpu_tests_finish.log | tail -3
  GPU_SET=model CAP=${MODEL_TEST_CAP:-220} WORKERS=8 bash experiments/bench/gpu_tests.sh | tail -3
  timeout ${PROBE_CAP:-150} python3 experiments/bench/decode_probe.py \
    --variants base,base@on,base@off,xfin,xfin@on,xfin@off --batches 1 --n_steps 16 \
    --reps 5 --profile base,base@on --out $OUT/decode_probe_pfin2_b1.json 2>&1 \
    | grep '"variant"' | cut -c1-160
  echo "pfin2 done $(( $(date +%s) - t0 )) s"
fi
# Owed to the next session (SECTIONS=owed11; ~9 min): the GPU model set on `proj_finish`
# "auto" = "gemv" (made the default on run 53's device programs, with only its kernel and
# forms tests compiled), then bench_model's decode (the roofline and LoRA entries) and the
# Engine at batch 1 on it.
if want owed11; then
  GPU_SET=model CAP=${TEST_CAP:-230} WORKERS=8 bash experiments/bench/gpu_tests.sh | tail -3
  timeout ${MODEL_CAP:-150} python3 experiments/bench/bench_model.py --sections decode \
    --batches 1,8,32 --alt_batches "" --dump_hlo "" --kernels_json experiments/results/bench_kernels.json \
    --out $OUT/bench_model_decode.json 2>&1 | grep -i -e "^decode" -e error | cut -c1-200
  timeout $(left) python3 experiments/bench/bench_engine.py --reps 3 --batches 1 \
    --out $OUT/bench_engine_b1.json 2>&1 | grep -e "^decode" -e "^ttft" -e Error | cut -c1-300
fi
# Session of 2026-12-04 (eleventh), SECTIONS=s11 (~8 min): the adapter in the layout an Engine
# places (rank 50 padded to 64, a per-row scale table; bench_model and decode_probe until run
# 55 loaded it bare, rank 50 and no table, which no user path runs). decode_probe at batch 1
# and 8: no adapter, on / off in that layout, on bare, and proj_finish's kernel at 64 / 32
# columns a program; profiles of base and base@on. Then bench_model's decode (roofline and
# the LoRA entries) in that layout.
# First, why run 55's GPU model set had three off-bits failures (off_bits_probe.py, plain and
# with XLA's autotuning off, beside the Engine test of a rank-128 stack with autotuning off).
if want s11; then
  mkdir -p $OUT/s11
  (STRATA_JAX_CACHE= timeout 150 python3 experiments/bench/off_bits_probe.py \
     --out $OUT/s11/off_bits_default.json > $OUT/s11/off_bits_default.log 2>&1) &
  (STRATA_JAX_CACHE= XLA_FLAGS=--xla_gpu_autotune_level=0 timeout 150 python3 \
     experiments/bench/off_bits_probe.py --out $OUT/s11/off_bits_noautotune.json \
     > $OUT/s11/off_bits_noautotune.log 2>&1) &
  (STRATA_JAX_CACHE= XLA_FLAGS=--xla_gpu_autotune_level=0 JAX_PLATFORMS=cuda timeout 170 \
     python3 -m pytest -p no:cacheprovider -W ignore -q -rfs \
     "tests/test_lora_switch.py::test_adapter_stack_beyond_the_rank_bucket_off_is_bit_identical" \
     "tests/test_forms.py::test_gemv_lora_rows_off_is_the_bare_model_and_on_is_the_apart_forms_numbers" \
     > $OUT/s11/tests_noautotune.log 2>&1) &
  wait
  grep -h -e "^gemv\|^kernel\|^xla" $OUT/s11/off_bits_*.log | cut -c1-200
  tail -2 $OUT/s11/tests_noautotune.log
  echo "s11 bits done $(( $(date +%s) - t0 )) s"
  timeout ${PROBE_CAP:-170} python3 experiments/bench/decode_probe.py \
    --variants base,base@on,base@off,base@rawon,fin64@on --batches 1 --n_steps 16 \
    --reps 5 --profile base,base@on --out $OUT/decode_probe_s11_b1.json 2>&1 \
    | grep '"variant"' | cut -c1-160
  timeout ${PROBE8_CAP:-100} python3 experiments/bench/decode_probe.py \
    --variants base,base@on --batches 8 --n_steps 16 \
    --reps 5 --out $OUT/decode_probe_s11_b8.json 2>&1 | grep '"variant"' | cut -c1-160
  echo "s11 probe done $(( $(date +%s) - t0 )) s"
  timeout $(left) python3 experiments/bench/bench_model.py --sections decode \
    --batches 1,8,32 --alt_batches "" --dump_hlo "" --kernels_json experiments/results/bench_kernels.json \
    --out $OUT/bench_model_decode.json 2>&1 | grep -i -e "^decode" -e error | cut -c1-200
fi
# Then SECTIONS=s11b (~7 min): proj_finish's kernel with no reduction (x' only; the norm in
# XLA): off_bits_probe.py, the finishing kernel's compiled cases, the GPU model set (run 55's
# three failures), decode_probe at batch 1 (no adapter, on, off, and "xla" beside them) with
# profiles of base and base@on.
if want s11b; then
  mkdir -p $OUT/s11b
  STRATA_JAX_CACHE= timeout 120 python3 experiments/bench/off_bits_probe.py \
    --out $OUT/s11b/off_bits_default.json > $OUT/s11b/off_bits_default.log 2>&1
  grep -h -e "^gemv\|^kernel\|^xla" $OUT/s11b/off_bits_default.log | cut -c1-120
  GPU_SET=kernels GPU_TESTS="tests/test_finish_kernel.py" CAP=90 WORKERS=4 \
    bash experiments/bench/gpu_tests.sh | tail -1
  mv $OUT/gpu_tests_kernels.log $OUT/s11b/ 2>/dev/null
  GPU_SET=model CAP=${TEST_CAP:-230} WORKERS=8 bash experiments/bench/gpu_tests.sh | tail -3
  echo "s11b tests done $(( $(date +%s) - t0 )) s"
  timeout $(left) python3 experiments/bench/decode_probe.py \
    --variants base,base@on,base@off,xfin,xfin@on --batches 1 --n_steps 16 \
    --reps 5 --profile base,base@on --out $OUT/decode_probe_s11b_b1.json 2>&1 \
    | grep '"variant"' | cut -c1-160
fi
# Then SECTIONS=s11c (~5 min): why the Engine's own program (`decode_sample`, greedy plan) runs
# ~5 % behind `decode_greedy` at batch 1 in most runs (236.3 against 249.3 tok/s in run 55) and
# level in others (run 46): both programs at batch 1, adapter on, with kernel profiles, once
# plainly and once with XLA's autotuning off (does the head's GEMM config move?).
if want s11c; then
  timeout 200 python3 experiments/bench/decode_probe.py --variants base@on,sample@on,base@on \
    --batches 1 --n_steps 16 --reps 7 --profile base@on,sample@on \
    --out $OUT/decode_probe_s11c_sample_b1.json 2>&1 | grep '"variant"' | cut -c1-120
  XLA_FLAGS=--xla_gpu_autotune_level=0 timeout $(left) python3 experiments/bench/decode_probe.py \
    --variants base@on,sample@on --batches 1 --n_steps 16 --reps 7 --profile base@on,sample@on \
    --tag noautotune --out $OUT/decode_probe_s11c_sample_b1_noautotune.json 2>&1 \
    | grep '"variant"' | cut -c1-120
fi
# Then SECTIONS=s11d (~4 min): run 58 found the gap is the output head's XLA GEMM (141.5 us a
# step tuned, 342 untuned). The head by the in-place dense kernels instead, batch 1 and 8.
if want s11d; then
  timeout $(left) python3 experiments/bench/decode_probe.py --variants base@on,headgemv@on \
    --batches 1,8 --n_steps 16 --reps 7 --profile base@on,headgemv@on \
    --out $OUT/decode_probe_s11d_head.json 2>&1 | grep '"variant"' | cut -c1-120
fi
# Owed to the next session (SECTIONS=owed12; ~9 min): the Engine at batch 1 and 8 (three
# reps) on `head` "kernel" (the GPU's default since run 59; the Engine never ran on it) and the
# fixed finishing kernel (run 57), then bench_model's decode (roofline, LoRA entries).
if want owed12; then
  timeout ${ENGINE_CAP:-380} python3 experiments/bench/bench_engine.py --reps 3 --batches 8,1 \
    --out $OUT/bench_engine.json 2>&1 | grep -e "^decode" -e "^ttft" -e Error | cut -c1-300
  timeout $(left) python3 experiments/bench/bench_model.py --sections decode \
    --batches 1,8,32 --alt_batches "" --dump_hlo "" --kernels_json experiments/results/bench_kernels.json \
    --out $OUT/bench_model_decode.json 2>&1 | grep -i -e "^decode" -e error | cut -c1-200
fi
# Session of 2026-12-04 (twelfth), SECTIONS=s12a (~9 min): `Forms.lora_b` "staged" (the one-row
# GEMV's launch copies the layer's B; the finish reads it with no layer index) against B read
# in place, decode_probe at batch 1 with profiles of both adapted programs; the same program
# under XLA command buffers around the loops (one process each, a --tag); then the compiled
# kernel tests of the LoRA rows and the finish (staged B's bits), then the GPU model set
# (the forms tests with staged B, the head pinned to "xla" in one test).
if want s12a; then
  timeout 200 python3 experiments/bench/decode_probe.py \
    --variants base,base@on,base@off,bstaged@on,bstaged@off,base@on --batches 1 --n_steps 16 \
    --reps 7 --profile base@on,bstaged@on --out $OUT/decode_probe_s12a_b1.json 2>&1 \
    | grep '"variant"' | cut -c1-120
  for cb in "+WHILE,+CONDITIONAL" "+WHILE,+CONDITIONAL --xla_gpu_graph_min_graph_size=1"; do
    tag=cb$( [[ $cb == *min_graph* ]] && echo 1 || echo 0 )
    XLA_FLAGS="--xla_gpu_enable_command_buffer=$cb" timeout 90 python3 \
      experiments/bench/decode_probe.py --variants base@on --batches 1 --n_steps 16 --reps 7 \
      --tag $tag --out $OUT/decode_probe_s12a_$tag.json 2>&1 | grep -e '"variant"' -e Error \
      | cut -c1-160
  done
  echo "s12a probes done $(( $(date +%s) - t0 )) s"
  GPU_SET=kernels GPU_TESTS="tests/test_finish_kernel.py tests/test_quant_kernel.py" CAP=100 \
    WORKERS=6 bash experiments/bench/gpu_tests.sh | tail -1
  GPU_SET=model CAP=$(left) WORKERS=8 bash experiments/bench/gpu_tests.sh | tail -3
fi
# Then SECTIONS=s12b (~6 min): run 62 found "staged" B level with B in place at batch 1 (the
# finish 2.46 against 2.92 us a call, the GEMV launch 0.17 us slower, steps within spread).
# Batch 8 and 32, where dense_dot takes the rows: B's tile before the K loop ("bstaged") and
# 128-row adapted tiles ("lorabo128") against the default, with profiles at batch 8; then
# the Engine's own program (`sample`) with the attention prologue ("attnpro", opt-in since
# run 43 because the Engine's batch-1 spread hid its 0.8 %; run 61 found that spread gone).
if want s12b; then
  timeout 240 python3 experiments/bench/decode_probe.py \
    --variants base,base@on,bstaged@on,lorabo128@on,base@on --batches 8,32 --n_steps 16 \
    --reps 7 --profile base@on,lorabo128@on --out $OUT/decode_probe_s12b_b8.json 2>&1 \
    | grep '"variant"' | cut -c1-120
  timeout $(left) python3 experiments/bench/decode_probe.py \
    --variants sample@on,sample+attnpro@on,sample@on,sample+attnpro@on --batches 1,8 \
    --n_steps 16 --reps 7 --out $OUT/decode_probe_s12b_attnpro.json 2>&1 \
    | grep '"variant"' | cut -c1-120
fi
# Then SECTIONS=s12c (~7 min): the defaults run 63 chose, dense_dot's adapted programs on 128
# output rows (`LORA_BLOCK_OUT`; `in` tiles of 128, the plain call's split) and the attention
# prologue for bf16: dense_dot's compiled tests (off rows the plain kernel's bits under the
# new tiling), bench_model's decode (roofline, LoRA entries), the GPU model set.
if want s12c; then
  GPU_SET=kernels GPU_TESTS="tests/test_dense_dot_kernel.py" CAP=100 WORKERS=4 \
    bash experiments/bench/gpu_tests.sh | tail -2
  mv $OUT/gpu_tests_kernels.log $OUT/gpu_tests_dense_dot.log 2>/dev/null
  timeout 170 python3 experiments/bench/bench_model.py --sections decode \
    --batches 1,8,32 --alt_batches "" --dump_hlo "" --kernels_json experiments/results/bench_kernels.json \
    --out $OUT/bench_model_decode.json 2>&1 | grep -i -e "^decode" -e error | cut -c1-200
  GPU_SET=model CAP=$(left) WORKERS=8 bash experiments/bench/gpu_tests.sh | tail -3
fi
# Owed to the next session, two calls on run 63's defaults (dense_dot's 128-row adapted tiles,
# the attention prologue for bf16), which no Engine run has measured:
#  SECTIONS=owed13a (~7 min): the Engine at batch 32, 8 and 1 (three reps) with the server;
#  SECTIONS=owed13b (~5 min): bench_spec (a verify step's 5 rows take the new adapted tiles:
#    the switch's cost with MTP was 3.0 % in run 48), then one adapted row through dense_dot
#    (gemv_lora "dot": 5.54 against the GEMV rows form's 3.20 us a layer in run 27, with
#    64-row tiles; the 128-row tiles halved batch 8's cost) against the default at batch 1.
if want owed13a; then
  timeout $(left) python3 experiments/bench/bench_engine.py --reps 3 --batches 32,8,1 \
    --out $OUT/bench_engine.json 2>&1 | grep -e "^decode" -e "^ttft" -e Error | cut -c1-300
fi
if want owed13b; then
  timeout ${SPEC_CAP:-200} python3 experiments/bench/bench_spec.py --ns 2,3,4 \
    --out $OUT/bench_spec.json 2>&1 | tail -4 | cut -c1-300
  timeout $(left) python3 experiments/bench/decode_probe.py \
    --variants base,base@on,loradot@on,base@on,loradot@on --batches 1 --n_steps 16 --reps 7 \
    --out $OUT/decode_probe_owed13_loradot.json 2>&1 | grep '"variant"' | cut -c1-120
fi
# Session of 2026-12-04 (thirteenth): the flash-style prefill attention kernel
# (Forms.attn_prefill "pallas"; the default stays "xla" until this call has timed it):
#  SECTIONS=s13a: its compiled tests and the engine-level forms test; decode_probe's
#    2,500-token prefill by XLA's attention and by the kernel (alternating, each profiled:
#    where a prefill's time goes), then the kernel's tile variants; the Engine at batch 1
#    alone with the kernel (run 65 ran batch 1 after 32 and 8 in one process: 0.916 / 0.875
#    of its program, run 61 alone 0.957 / 0.920) and its TTFT; bench_spec with the kernel in
#    the verify step.
if want s13a; then
  prefill_kernel_tests 150
  PYTEST_ADDOPTS="-k attn_prefill" GPU_SET=model GPU_TESTS="tests/test_forms.py" CAP=120 \
    WORKERS=1 bash experiments/bench/gpu_tests.sh | tail -2
  timeout ${PROBE_CAP:-260} python3 experiments/bench/decode_probe.py --prefill 2500 --reps 5 \
    --variants ${PF_VARIANTS:-attnxla,attnflash,attnxla,attnflash,attnflash+pk64,attnflash+pq128,attnflash+pw4,attnflash+ps3} \
    --profile attnxla,attnflash --out $OUT/decode_probe_prefill_attn.json 2>&1 \
    | grep '"variant"' | cut -c1-150
  timeout ${ENGINE_CAP:-170} python3 experiments/bench/bench_engine.py --reps 3 --batches 1 \
    --forms attn_prefill=pallas --out $OUT/bench_engine_b1_attnflash.json 2>&1 \
    | grep -e "^decode" -e "^ttft" -e Error | cut -c1-300
  timeout $(left) python3 experiments/bench/bench_spec.py --ns 2,3,4 --forms attn_prefill=pallas \
    --summary=false --out $OUT/bench_spec_attnflash.json 2>&1 | tail -4 | cut -c1-300
fi
# Run 67 (s13a): the kernel passed its compiled tests but lost, 98.6 against 92.7 ms a
# 2,500-token prefill: 18.9 ms in 12 calls, the probabilities meeting V as fp32 (TF32) at
# 64-query blocks. SECTIONS=s13b: the kernel with the probabilities in the cache's dtype (bf16
# dots both) and 128 x 64 tiles: compiled tests, the prefill at 2,500 (with XLA's HLO, to name
# the profile's fusions) and 4,096 tokens, tile variants, and the Engine's TTFT with it if it
# wins.
if want s13b; then
  prefill_kernel_tests 100
  timeout ${PROBE_CAP:-200} python3 experiments/bench/decode_probe.py --prefill 2500 --reps 5 \
    --variants ${PF_VARIANTS:-attnxla,attnflash,attnxla,attnflash,attnflash+pk32,attnflash+pq64,attnflash+pq64+pw4,attnflash+ps3} \
    --profile attnflash --dump-hlo $OUT/hlo --out $OUT/decode_probe_prefill_attn.json 2>&1 \
    | grep '"variant"' | cut -c1-150
  timeout 90 python3 experiments/bench/decode_probe.py --prefill 4096 --reps 3 \
    --variants attnxla,attnflash --out $OUT/decode_probe_prefill4096_attn.json 2>&1 \
    | grep '"variant"' | cut -c1-150
  wins=$(python3 -c "import json; r=json.load(open('$OUT/decode_probe_prefill_attn.json'))['results']
ms=lambda v: min([x['ms'] for x in r if x['variant']==v and 'ms' in x] or [1e9])
print(int(ms('attnflash') < ms('attnxla')))")
  if [ "$wins" = 1 ]; then
    timeout $(( $(left) - 10 )) python3 experiments/bench/bench_engine.py --reps 2 --batches 1 \
      --forms attn_prefill=pallas --out $OUT/bench_engine_b1_attnflash.json 2>&1 \
      | grep -e "^decode" -e "^ttft" -e Error | cut -c1-300
  fi
fi
# SECTIONS=s13c (the session's last ~240 s): the Engine at batch 1 on this commit's defaults
# (the prefill attention kernel; the decode attention kernel without its prologue), then, if
# time is left, with the prologue (owed14's A/B, two reps each).
if want s13c; then
  for f in "" attn_decode=pallas_prologue; do
    timeout $(( $(left) - 5 )) python3 experiments/bench/bench_engine.py --reps 2 --batches 1 \
      ${f:+--forms $f} --out $OUT/bench_engine_b1_$(f=${f#attn_decode=}; echo ${f:-defaults}).json \
      2>&1 | grep -e "^decode" -e "^ttft" -e Error | cut -c1-300
  done
fi
# Owed to the next session (after run 69):
#  SECTIONS=owed14b (~4 min): the grouped MoE kernel's tiles in a 2,500-token prefill. Run 68's
#    profile had moe_grouped_up / _down at 12.6 / 7.6 ms, ~1 TB/s of the 19.3 GB of expert weights
#    a prefill reads (every expert is hit): its tiles (64 rows, 64-wide F blocks, 4 warps) were
#    never timed, and each weight tile is read once per 64-row tile of its ~390 rows.
if want owed14b; then
  timeout $(( $(left) - 10 )) python3 experiments/bench/decode_probe.py --prefill 2500 --reps 5 \
    --variants base,grows128+gw8,grows128+gf128+gw8,grows128+gf128+gd256+gw8,base,grows128+gs4+gw8 \
    --profile grows128+gf128+gw8 --out $OUT/decode_probe_prefill_grouped.json 2>&1 \
    | grep '"variant"' | cut -c1-150
fi
#  SECTIONS=owed14 (~7 min): the prefill attention
# kernel's compiled tests (kv_start windows, fp32 at its 64 x 32 tiles), the Engine at batch 1
# alone with the decode kernel alone (the default again) and with the attention prologue, each
# in its own process: runs 65 / 67 had the Engine's decode_sample at 236.6 / 239.2 tok/s with the
# prologue, run 61 at 249.7 without, decode_greedy 249-251 in all three.
if want owed14; then
  prefill_kernel_tests 100   # kv_start windows compiled, fp32 at 64 x 32
  for f in attn_decode=pallas attn_decode=pallas_prologue; do
    timeout $(( ($(left) - 10) / 2 )) python3 experiments/bench/bench_engine.py --reps 3 \
      --batches 1 --forms $f --out $OUT/bench_engine_b1_${f#attn_decode=}.json 2>&1 \
      | grep -e "^decode" -e Error | cut -c1-300
  done
fi
# Owed since the session of 2026-12-05 (fourteenth), which was lent no machine:
#  call A, SECTIONS=owed14b,s14gdn (~9 min, CAP=570): the grouped MoE tiles above, then the
#    chunk-parallel GDN kernel's state pass / intermediates / tiles and the blocked UT inverse
#    (inverse="blocked", never compiled yet) at T = 2,500, 32 heads of 128, bf16 q/k/v
#    (gdn_probe.py --chunked_plan; the default first and last). Adopt a winner as the default
#    only after call B's compiled tests.
#  call B, SECTIONS=s14gdntests,owed14: the blocked inverse's compiled parity tests, then owed14.
if want s14gdntests; then
  GPU_SET=kernels GPU_TESTS="tests/test_gdn_parallel_kernel.py" CAP=150 WORKERS=2 \
    bash experiments/bench/gpu_tests.sh | tail -2
  mv $OUT/gpu_tests_kernels.log $OUT/gpu_tests_gdn_parallel.log 2>/dev/null
fi
if want s14gdn; then
  p=pallas_parallel/64/1/float32
  s=pallas_split/64/2/bfloat16
  timeout $(( $(left) - 5 )) python3 experiments/bench/gdn_probe.py --skip decode,floor,layers,sweep,fla \
    --budget_s $(( $(left) - 30 )) --chunk_steps 5 --reps 5 --out $OUT/gdn_probe_chunked_plan.json \
    --chunked_plan $p,pallas_split/64/2/float32,$s,pallas_split/64/3/bfloat16,$s/bv64,$s/bv64/w8,$s/bv16,$s/iw4,$s/w8,pallas_parallel/64/2/bfloat16,pallas_split/32/2/bfloat16,$s/blocked,$s/blocked/iw4,pallas_parallel/64/1/float32/blocked,$p \
    2>&1 | grep -e "'impl'" -e Error | cut -c1-260
fi
# Session of 2026-12-05 (fifteenth), after run 70: "auto" = "pallas_split" with 2 stages, the
# intra launch at 4 warps and 16-bit intermediates for 16-bit q/k/v; the grouped MoE kernel at
# 8 warps for 64-row tiles. SECTIONS=s15b (~9 min): the compiled GDN parallel and grouped MoE
# tests, the GPU model set (transformers parity with both parallel forms), the 2,500-token
# prefill on this commit's GDN inputs (16-bit, q/k heads unrepeated, the conv state gathered)
# against the old ones (gdnf32in, convcat), and the GDN op beside fla's.
if want s15b; then
  GPU_SET=kernels GPU_TESTS="tests/test_gdn_parallel_kernel.py tests/test_moe_grouped_kernel.py" \
    CAP=170 WORKERS=4 bash experiments/bench/gpu_tests.sh | tail -2
  mv $OUT/gpu_tests_kernels.log $OUT/gpu_tests_gdn_moe.log 2>/dev/null
  GPU_SET=model CAP=200 WORKERS=8 bash experiments/bench/gpu_tests.sh | tail -3
  timeout 170 python3 experiments/bench/decode_probe.py --prefill 2500 --reps 5 \
    --variants base,gdnf32in+convcat,base,gdnf32in,convcat,ggk,gdnparallel --profile base \
    --out $OUT/decode_probe_prefill_s15.json 2>&1 | grep '"variant"' | cut -c1-150
  s=pallas_split/64/2/bfloat16
  timeout $(( $(left) - 5 )) python3 experiments/bench/gdn_probe.py --skip decode,floor,layers,sweep \
    --budget_s $(( $(left) - 30 )) --chunk_steps 5 --reps 5 --out $OUT/gdn_probe_s15.json \
    --chunked_plan $s,pallas_split/64/3/bfloat16,$s/iw8,$s/bv64,pallas_parallel/64/2/bfloat16,$s \
    2>&1 | grep -e "'impl'" -e "^chunked" -e Error | cut -c1-260
fi
# SECTIONS=s15c (the session's last ~8 min): the Engine at batch 1 on the new defaults (TTFT of
# 2,500 tokens beside one prefill program call, decode greedy / sampled), then, if time is left,
# with the attention prologue (owed14's A/B).
if want s15c; then
  for f in "" attn_decode=pallas_prologue; do
    [ $(left) -lt 120 ] && break
    timeout $(( $(left) - 5 )) python3 experiments/bench/bench_engine.py --reps 2 --batches 1 \
      ${f:+--forms $f} --out $OUT/bench_engine_b1_s15_$(f=${f#attn_decode=}; echo ${f:-defaults}).json \
      2>&1 | grep -e "^decode" -e "^ttft" -e Error | cut -c1-300
  done
fi
# Session of 2026-12-05 (seventeenth), after run 71 (an H100) set the grouped MoE kernel's
# gather="kernel" and the GDN "separate" pass's 3 stages as defaults. SECTIONS=s16a (~7 min):
# the compiled tests those defaults run that run 71's capped kernel set did not reach or ran on
# the old defaults, the 2,500-token prefill on the new defaults against the old ones (with
# each variant's logits against the first's), then the Engine at batch 1 (TTFT of 2,500
# tokens, decode greedy / sampled). SECTIONS=s16b (~5 min): the GPU model set (transformers
# parity on the new defaults), which run 71's 200 s cap cut at 44 of 57.
if want s16a; then
  GPU_SET=kernels GPU_TESTS="tests/test_gdn_parallel_kernel.py tests/test_moe_grouped_kernel.py" \
    CAP=130 WORKERS=4 bash experiments/bench/gpu_tests.sh -k "separate or api_vmap or layer_stack or small or gathered" | tail -2
  mv $OUT/gpu_tests_kernels.log $OUT/gpu_tests_gdn_moe.log 2>/dev/null
  timeout 120 python3 experiments/bench/decode_probe.py --prefill 2500 --reps 5 \
    --variants base,gdns2+ggx,gdnf32in+convcat+gdns2+ggx,base,gdns2,ggx --profile base \
    --out $OUT/decode_probe_prefill_s16.json 2>&1 | grep '"variant"' | cut -c1-260
  timeout $(( $(left) - 5 )) python3 experiments/bench/bench_engine.py --reps 2 --batches 1 \
    --out $OUT/bench_engine_b1_s16.json 2>&1 | grep -e "^decode" -e "^ttft" -e Error | cut -c1-300
fi
if want s16b; then
  GPU_SET=model CAP=$(( $(left) - 10 )) WORKERS=8 bash experiments/bench/gpu_tests.sh | tail -3
fi
# Session of 2026-12-06 (eighteenth). SECTIONS=s17a (~9.5 min): the GPU model set on the
# defaults runs 71-72 set (transformers parity; owed since run 72); the 2,500-token prefill at
# the grouped MoE kernel's 64-row tiles (the default) against 128-row tiles (run 70's fastest
# row, "grows128+gw8", was 128-row tiles: its groups average 391 rows, not 40, so the cap did
# change the tile; 64 rows at 8 warps was never timed beside it); the GDN op beside fla in one
# process on the same card (fla was not reached in run 71). SECTIONS=s17b (~4 min): the Engine
# at batch 1 with --profile: where the time from submit to first token of 2,500 tokens goes
# beyond one prefill call (run 72 on an H100: 101.1 against 82.2 ms).
if want s17a; then
  GPU_SET=model CAP=${TEST_CAP:-320} WORKERS=8 bash experiments/bench/gpu_tests.sh | tail -3
  timeout 130 python3 experiments/bench/decode_probe.py --prefill 2500 --reps 5 \
    --variants base,grows128,base,grows128,grows128+gs4 \
    --out $OUT/decode_probe_prefill_s17.json 2>&1 | grep '"variant"' | cut -c1-260
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fla \
    .whl/fla_core-*.whl .whl/flash_linear_attention-*.whl >/dev/null 2>&1
  PYTHONPATH=/tmp/fla:$PYTHONPATH timeout $(( $(left) - 5 )) python3 experiments/bench/gdn_probe.py \
    --skip decode,floor,layers,sweep --budget_s $(( $(left) - 40 )) --chunk_steps 5 --reps 5 \
    --chunked_plan pallas_split/64/3/bfloat16 --out $OUT/gdn_probe_s17.json \
    2>&1 | grep -e "'impl'" -e "^chunked" -e Error | cut -c1-260
fi
if want s17b; then
  timeout $(( $(left) - 5 )) python3 experiments/bench/bench_engine.py --reps 2 --batches 1 \
    --profile --out $OUT/bench_engine_b1_s17_profile.json 2>&1 | grep -e "^decode" -e "^ttft" -e Error | cut -c1-400
fi
# Owed to the next session (after runs 73-74 on an H100 made 128-row grouped MoE tiles the
# default for 16-bit operands). SECTIONS=s18a (~9 min): the compiled grouped MoE tests and the
# GPU model set on 128-row tiles, then the 2,500-token prefill at 128 against 64 rows
# (alternating, one process), then the Engine at batch 1 (TTFT, decode) with the one-pass
# prefill (`Engine(bucket_step=512)`: a 2,500-token prompt as one 2,560-token chunk) and on
# this commit's defaults. Make bucket_step 512 the default if its TTFT wins. On an H200 this
# re-measures summary.json's H200 prefill and TTFT entries.
if want s18a; then
  GPU_SET=kernels GPU_TESTS="tests/test_moe_grouped_kernel.py" CAP=90 WORKERS=4 \
    bash experiments/bench/gpu_tests.sh | tail -2
  mv $OUT/gpu_tests_kernels.log $OUT/gpu_tests_moe_grouped.log 2>/dev/null
  GPU_SET=model CAP=${TEST_CAP:-300} WORKERS=8 bash experiments/bench/gpu_tests.sh | tail -3
  timeout 110 python3 experiments/bench/decode_probe.py --prefill 2500 --reps 5 \
    --variants base,grows64,base,grows64 --out $OUT/decode_probe_prefill_s18.json 2>&1 \
    | grep '"variant"' | cut -c1-260
  for st in 512 ""; do   # the one-pass prefill (Engine(bucket_step=512)), then the default
    [ $(left) -lt 100 ] && break
    timeout $(( $(left) - 5 )) python3 experiments/bench/bench_engine.py --reps 2 --batches 1 \
      ${st:+--bucket-step $st} --out $OUT/bench_engine_b1_s18_step${st:-none}.json 2>&1 \
      | grep -e "^decode" -e "^ttft" -e Error | cut -c1-300
  done
fi
# Session of 2026-12-06 (nineteenth). SECTIONS=s19a (~9.5 min): the prefill's XLA glue, then
# the one-pass prefill. Run 74's prefill profile put ~13 ms of 76.5 in XLA copies and sorts:
# the weights concatenated per call by XLA's dot merger (now `quant_api.apart`), the GDN conv's
# concatenation (now `gdn.CONV_APART`), the expert sort's four radix passes (now a uint8 key,
# `argsort_ids`), and the per-layer weight slices out of the stacks (an XLA flag tried in its
# own process), and the grouped MoE's per-pair rows rounded to bf16 (opt-in "gy16"). Then the Engine at batch 1 with `bucket_step=512` and on the defaults (the
# persistent compilation cache makes the second cheaper). SECTIONS=s19b: the compiled grouped
# MoE tests and the GPU model set on this commit's defaults. (Run 75 ran s19a with a GDN conv
# barrier in base and a "convfused" variant; the barrier is gone, and gy32 now undoes the
# rounded MoE rows made the default after it.)
if want s19a; then
  timeout 190 python3 experiments/bench/decode_probe.py --prefill 2500 --reps 5 \
    --variants base,sort32+merged+gy32,base,sort32,merged,gy32,sort32+merged+gy32 \
    --profile base --out $OUT/decode_probe_prefill_s19.json 2>&1 | grep '"variant"' | cut -c1-330
  XLA_FLAGS="--xla_gpu_enable_dynamic_slice_fusion=true" timeout 75 python3 \
    experiments/bench/decode_probe.py --prefill 2500 --reps 5 --variants base,base \
    --out $OUT/decode_probe_prefill_s19_dsfusion.json 2>&1 | grep -e '"variant"' -e Error | cut -c1-330
  for st in 512 ""; do
    [ $(left) -lt 100 ] && break
    timeout $(( $(left) - 5 )) python3 experiments/bench/bench_engine.py --reps 2 --batches 1 \
      ${st:+--bucket-step $st} --out $OUT/bench_engine_b1_s19_step${st:-none}.json 2>&1 \
      | grep -e "^decode" -e "^ttft" -e "^compiled" -e Error | cut -c1-300
  done
fi
if want s19b; then
  GPU_SET=kernels GPU_TESTS="tests/test_moe_grouped_kernel.py" CAP=90 WORKERS=4 \
    bash experiments/bench/gpu_tests.sh | tail -2
  mv $OUT/gpu_tests_kernels.log $OUT/gpu_tests_moe_grouped.log 2>/dev/null
  GPU_SET=model CAP=${TEST_CAP:-300} WORKERS=8 bash experiments/bench/gpu_tests.sh | tail -3
  [ $(left) -gt 150 ] && timeout $(( $(left) - 5 )) python3 experiments/bench/bench_engine.py \
    --reps 2 --batches 1 --out $OUT/bench_engine_b1_s19_defaults.json 2>&1 \
    | grep -e "^decode" -e "^ttft" -e "^compiled" -e Error | cut -c1-300
fi
# Session of 2026-12-06 (twentieth). SECTIONS=s20a (~8 min): the 2,500-token prefill and the
# batch-1 decode step on this commit's defaults, each with a kernel profile and its optimised
# HLO (to name the fusions the profiles list: the prefill's three input_concatenate_fusions,
# the MoE combine, the weight slices), then the transformers peer on the same card (HF eager,
# fla's kernels) so prefill_vs_transformers compares one card, then the Engine at batch 1.
if want s20a; then
  timeout 150 python3 experiments/bench/decode_probe.py --prefill 2500 --reps 5 --variants base \
    --profile base --dump-hlo $OUT/hlo --out $OUT/decode_probe_prefill_s20.json 2>&1 \
    | grep -e '"variant"' -e Error | cut -c1-330
  timeout 120 python3 experiments/bench/decode_probe.py --batches 1 --n_steps 16 --reps 5 \
    --variants base --profile base --dump-hlo $OUT/hlo --out $OUT/decode_probe_b1_s20.json 2>&1 \
    | grep -e '"variant"' -e Error | cut -c1-330
  peer 200 peer_transformers_s20.json
  engine_b1 bench_engine_b1_s20.json
fi
# Session of 2026-12-06 (twenty-second; run 78). SECTIONS=s22a (~5 min, in place of the
# twenty-first's s20e, which never ran): the two GDN prefill forms (Forms.gdn_conv="taps",
# gdn_gated_norm="in_op") against the then defaults in one process in the 2,500-token prefill,
# with their profile; the batch-1 decode program with its profile (the GDN decode kernels take
# n_new itself: against run 77's 1,156 kernels a step); the gated launch's compiled tests; the
# chunk-parallel forms' transformers parity and greedy decode.
if want s22a; then
  timeout 110 python3 experiments/bench/decode_probe.py --prefill 2500 --reps 5 \
    --variants base,convtaps,gnormop,convtaps+gnormop,base --profile convtaps+gnormop \
    --out $OUT/decode_probe_prefill_s22.json 2>&1 | grep -e '"variant"' -e Error | cut -c1-330
  timeout 90 python3 experiments/bench/decode_probe.py --batches 1 --n_steps 16 --reps 5 \
    --variants base --profile base --out $OUT/decode_probe_b1_s22.json 2>&1 \
    | grep -e '"variant"' -e Error | cut -c1-330
  GPU_SET=kernels GPU_TESTS="tests/test_gdn_parallel_kernel.py" CAP=70 WORKERS=2 \
    bash experiments/bench/gpu_tests.sh -k "gated" | tail -2
  mv $OUT/gpu_tests_kernels.log $OUT/gpu_tests_gdn_parallel.log 2>/dev/null
  GPU_SET=model GPU_TESTS="tests/test_model_parity.py" CAP=$(( $(left) - 8 )) WORKERS=4 \
    bash experiments/bench/gpu_tests.sh -k "parallel or greedy" | tail -2
fi
# Session of 2026-12-07 (twenty-third). SECTIONS=s23a (~8 min): the input norm made by the
# projections' one-row launch (Forms.input_norm="in_proj") and the MoE's norm by the router's
# launch (Forms.moe_norm="in_launch"). First the batch-1 decode A/B in one process (no
# adapter and adapter on, base again last) with its profile, at the Engine's batch-1 capacity
# (2,560 keys), beside the Engine's own program (`sample`) with and without the attention
# prologue (owed14: the prologue won in decode_greedy at 512 keys and lost through the
# Engine; its profile names what grows); then the two forms' compiled tests; on an H200 the
# prefill program and the transformers peer (owed since run 77: one card's
# prefill_vs_transformers); then the Engine at batch 1 on this commit's defaults (owed: the
# gdn_conv "taps" default through the Engine), and with both norms in launches if time is left.
if want s23a; then
  timeout 250 python3 experiments/bench/decode_probe.py --batches 1 --n_steps 16 --reps 5 \
    --max_seq 2560 --variants \
    base,normproj,normmoe,normproj+normmoe,base@on,normproj+normmoe@on,sample,sample+attnpro,base \
    --profile normproj+normmoe,sample+attnpro --out $OUT/decode_probe_b1_s23.json 2>&1 \
    | grep -e '"variant"' -e Error | cut -c1-330
  echo "s23a probe done $(( $(date +%s) - t0 )) s"
  JAX_PLATFORMS=cuda timeout 100 python3 -m pytest -p no:cacheprovider -W ignore -q -rfs \
    tests/test_forms.py -k "norms_in_the_launches" 2>&1 | tee $OUT/gpu_tests_norm_forms.log | tail -3
  JAX_PLATFORMS=cuda timeout 80 python3 -m pytest -p no:cacheprovider -W ignore -q -rfs \
    tests/test_multi_launch_kernel.py -k "norm or gpu_multi" 2>&1 \
    | tee $OUT/gpu_tests_norm_launch.log | tail -3
  h200_prefill_and_peer s23
  engine_b1 bench_engine_b1_s23.json
  engine_b1 bench_engine_b1_s23_norms.json input_norm=in_proj,moe_norm=in_launch
fi
# Session of 2026-12-07 (twenty-fourth). SECTIONS=s24a (~6 min): run 79 (H100) had the
# Engine's sampling program 1.0 % faster with the attention prologue (sample+attnpro 4.442 ms
# against sample 4.487, base run twice 4.439 / 4.444); the Engine itself decides. The Engine
# at batch 1 with the prologue, then on the defaults again in the same call (the A/B), then
# the norm-launch kernel tests (run 79 failed two interpreted cases on the GPU, now held to
# bf16 there as INTERP_BITS rules); on an H200 the prefill program and the transformers peer.
if want s24a; then
  engine_b1 bench_engine_b1_s24_attnpro.json attn_decode=pallas_prologue
  engine_b1 bench_engine_b1_s24.json
  JAX_PLATFORMS=cuda timeout 80 python3 -m pytest -p no:cacheprovider -W ignore -q -rfs \
    tests/test_multi_launch_kernel.py -k "norm or gpu_multi" 2>&1 \
    | tee $OUT/gpu_tests_norm_launch.log | tail -3
  h200_prefill_and_peer s24
fi
# SECTIONS=s24b (~5 min): why the Engine's own decode_greedy (run 80: 199 tok/s at batch 1,
# adapter on, from the engine's prompts) is slower than decode_probe's (run 79: base@on 4.540
# ms, 220 tok/s): the probe decodes from token 0 in an empty state and restarts every call;
# --prompt 128 starts from prefilled distinct prompts and carries the tokens on, as the
# Engine's program. Both with the kernel profile of base@on, to name what differs; and the
# shared expert's GLU row in its down GEMV (Forms.shared_glu="in_down", "gludown") beside base.
# Replanned on 2026-12-07 (twenty-fifth session), with little device time left: s24b now also
# times this session's GDN conv kernel, all at batch 1 from 128-token prompts (the Engine's
# program decodes from prompts; run 79's probe started from token 0): base, gdnconv, gludown,
# adapter on for base and gdnconv, base again last, with gdnconv's kernel profile; then the
# compiled tests of both forms; then the fused GDN decode kernel's tile sweep (s25gdn).
if want s24b; then
  timeout 230 python3 experiments/bench/decode_probe.py --batches 1 --n_steps 16 --reps 5 \
    --max_seq 2560 --prompt 128 --variants base,gdnconv,gludown,base@on,gdnconv@on,base \
    --profile gdnconv --out $OUT/decode_probe_b1_prompt128.json 2>&1 \
    | grep -e '"variant"' -e Error | cut -c1-200
  JAX_PLATFORMS=cuda timeout 120 python3 -m pytest -p no:cacheprovider -W ignore -q -rfs \
    tests/test_gdn_decode_conv_kernel.py tests/test_multi_launch_kernel.py tests/test_forms.py \
    -k "conv or glu" 2>&1 | tee $OUT/gpu_tests_gdn_conv_glu.log | tail -3
  [ $(left) -gt 150 ] && SECTIONS=s25gdn CAP=$(( $(left) - 10 )) bash $0
fi
# Session of 2026-12-07 (twenty-fifth). SECTIONS=s25a (~8 min): Forms.gdn_decode="pallas_conv"
# (the GDN layer's qkv / ba split sums, conv, gates and delta rule in one launch on the fused
# kernel's grid, the conv state stack in the scan's carry, weights read in place) against the
# default fused form, at batch 1 from 128-token prompts at the Engine's 2,560-key capacity, no
# adapter and adapter on, base again last, with its kernel profile; batch 8 beside it; the
# compiled kernel tests; then the Engine at batch 1 with it and on the defaults (the A/B).
if want s25a; then
  timeout 200 python3 experiments/bench/decode_probe.py --batches 1 --n_steps 16 --reps 5 \
    --max_seq 2560 --prompt 128 --variants base,gdnconv,base@on,gdnconv@on,base \
    --profile gdnconv --out $OUT/decode_probe_b1_s25.json 2>&1 \
    | grep -e '"variant"' -e Error | cut -c1-200
  JAX_PLATFORMS=cuda timeout 100 python3 -m pytest -p no:cacheprovider -W ignore -q -rfs \
    tests/test_gdn_decode_conv_kernel.py 2>&1 | tee $OUT/gpu_tests_gdn_conv.log | tail -3
  engine_b1 bench_engine_b1_s25_gdnconv.json gdn_decode=pallas_conv
  engine_b1 bench_engine_b1_s25.json
  [ $(left) -gt 90 ] && timeout $(( $(left) - 5 )) python3 experiments/bench/decode_probe.py \
    --batches 8 --n_steps 16 --reps 3 --max_seq 2560 --prompt 128 \
    --variants base,gdnconv,base --out $OUT/decode_probe_b8_s25.json 2>&1 \
    | grep -e '"variant"' -e Error | cut -c1-200
fi
# SECTIONS=s25gdn (~3 min): the fused GDN decode kernel's tile sweep, never run (its defaults,
# [16, 128] state tiles at 4 warps, are untimed), beside the defaults and fla's decode
# (CUDA graph), each profiled at batch 1 / 8 / 32: gdn_decode_vs_fla is 0.913 at batch 32.
if want s25gdn; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fla \
    .whl/fla_core-*.whl .whl/flash_linear_attention-*.whl >/dev/null 2>&1
  PYTHONPATH=/tmp/fla:$PYTHONPATH timeout 240 python3 experiments/bench/gdn_probe.py \
    --batches 1,8,32 --profile --profile_batches 1,8,32 --skip chunked,layers,ffi,floor \
    --budget_s 200 --out $OUT/gdn_probe_decode_s25.json 2>&1 | grep -i -e error -e done \
    | cut -c1-200
fi
# Session of 2026-12-07 (twenty-sixth). Run 81's files did not survive the session's end, so
# SECTIONS=s26a (~9 min) measures them again, with the profiles that explain the adapter-on
# result (run 81: gdnconv 9.1 % faster than base with no adapter, 1.1 % with the adapter on):
# batch 1 from 128-token prompts, base / gdnconv / base@on / gdnconv@on / base, each of the
# three profiled; the compiled tests of the conv kernel and the GLU form; the GDN tile sweep.
if want s26a; then
  probe_b1 260 decode_probe_b1_s26.json base,gdnconv,base@on,gdnconv@on,base \
    gdnconv,base@on,gdnconv@on
  JAX_PLATFORMS=cuda timeout 120 python3 -m pytest -p no:cacheprovider -W ignore -q -rfs \
    tests/test_gdn_decode_conv_kernel.py tests/test_multi_launch_kernel.py tests/test_forms.py \
    -k "conv or glu" 2>&1 | tee $OUT/gpu_tests_gdn_conv_glu.log | tail -3
  [ $(left) -gt 150 ] && SECTIONS=s25gdn CAP=$(( $(left) - 10 )) bash $0
fi
# SECTIONS=s26b (~8.5 min; the device lent little this session): the conv kernel's compiled
# tests, then the Engine at batch 1 with it and on the defaults (the A/B that decides the
# default), then in what is left batch 1 from 128-token prompts with the adapter on, profiled.
if want s26b; then
  JAX_PLATFORMS=cuda timeout 100 python3 -m pytest -p no:cacheprovider -W ignore -q -rfs \
    tests/test_gdn_decode_conv_kernel.py 2>&1 | tee $OUT/gpu_tests_gdn_conv.log | tail -3
  engine_b1 bench_engine_b1_s26_gdnconv.json gdn_decode=pallas_conv
  engine_b1 bench_engine_b1_s26.json
  [ $(left) -gt 80 ] && probe_b1 $(( $(left) - 5 )) decode_probe_b1_s26_on.json \
    base@on,gdnconv@on base@on,gdnconv@on 3
fi
# Session of 2026-12-07 (twenty-seventh). Run 82 (s26b): the Engine at batch 1 gains 1.0 % with
# the conv kernel (adapter on), and its compiled tests stopped at 23 of 24 at their 100 s cap.
# SECTIONS=s27a (~9.5 min), with `gdn_decode` "auto" = "pallas_conv" on the GPU in the tree:
# the conv kernel's compiled tests in full; batch 8 and 32 from 128-token prompts, adapter on,
# the fused kernel against the conv kernel (the default must not lose there); the GPU model set
# (transformers parity, off bit-identity, greedy decode) on the new default; then batch 1 with
# no adapter, both forms profiled (run 81's 9.1 % against run 82's 1.5 % with the adapter on).
if want s27a; then
  GPU_SET=kernels GPU_TESTS="tests/test_gdn_decode_conv_kernel.py" CAP=170 WORKERS=4 \
    bash experiments/bench/gpu_tests.sh | tail -2
  mv $OUT/gpu_tests_kernels.log $OUT/gpu_tests_gdn_conv.log 2>/dev/null
  timeout 130 python3 experiments/bench/decode_probe.py --batches 8,32 --n_steps 16 --reps 3 \
    --max_seq 2560 --prompt 128 --variants gdnfused@on,gdnconv@on,gdnfused@on \
    --out $OUT/decode_probe_b8_b32_s27_on.json 2>&1 | grep -e '"variant"' -e Error | cut -c1-200
  GPU_SET=model CAP=$(( $(left) > 330 ? 230 : $(left) - 100 )) WORKERS=8 \
    bash experiments/bench/gpu_tests.sh | tail -3
  [ $(left) -gt 80 ] && probe_b1 $(( $(left) - 5 )) decode_probe_b1_s27.json \
    gdnfused,gdnconv,gdnfused gdnfused,gdnconv 3
fi
# SECTIONS=s27b (~9 min; owed by runs 83-84): with "auto" = the conv kernel up to 8 rows, the
# fused one above (`pallas_kernels.gdn.api.decode_form`): the three model tests the caps cut
# (transformers' 32 greedy tokens, prefill-then-decode, the adapter stack's off bit-identity);
# batch 32 from 128-token prompts, adapter on, fused against conv (whether the cut at 8 rows
# may rise); then the fused kernel's tile sweep (s25gdn).
if want s27b; then
  GPU_SET=model GPU_TESTS="tests/test_model_parity.py tests/test_lora_switch.py" CAP=150 \
    WORKERS=3 bash experiments/bench/gpu_tests.sh -k "greedy_32 or longer_prefill or beyond_the_rank" \
    | tail -3
  mv $OUT/gpu_tests_model.log $OUT/gpu_tests_model_rest.log 2>/dev/null
  timeout 170 python3 experiments/bench/decode_probe.py --batches 32 --n_steps 16 --reps 3 \
    --max_seq 2560 --prompt 128 --variants gdnfused@on,gdnconv@on,gdnfused@on \
    --out $OUT/decode_probe_b32_s27_on.json 2>&1 | grep -e '"variant"' -e Error | cut -c1-200
  [ $(left) -gt 150 ] && SECTIONS=s25gdn CAP=$(( $(left) - 10 )) bash $0
fi
# SECTIONS=s28 (~9 min): the quantised launches of the twenty-eighth session
# (`Forms.quant_launch` "fused": a layer's products of one input in one launch, the experts'
# gate with their up): their compiled tests, then the 80B-A3B Q4_K_M's device program at batch
# 1 with and without them (decode_probe's "qlaunch" against base, one process), and the Engine
# at batch 1 with the faster one's forms, adapter on and off.
if want s28; then
  GPU_SET=kernels GPU_TESTS="tests/test_quant_kernel.py" CAP=75 WORKERS=4 \
    bash experiments/bench/gpu_tests.sh -k "one_launch or mixed" | tail -2
  mv $OUT/gpu_tests_kernels.log $OUT/gpu_tests_quant_multi.log 2>/dev/null
  VARIANTS=${VARIANTS:-base,qlaunch} PROBE_CAP=${PROBE_CAP:-170} BATCHES=1 \
    CAP=$(( $(left) - 5 )) bash experiments/bench/a80b_run.sh
fi
# SECTIONS=s28min (~4 min, for a call with little device time left): s28's compiled tests,
# then its A/B on an 8-layer 80B-A3B Q4_K_M (the same layers and shapes, 1/6 of them; batch 1,
# in one process), with the attention prologue beside it and each variant's HLO dumped: run
# 49's 80B profile has 37 XLA fusions in each of the 12 attention layers, 444 launches and
# 725 us of its 4.33 ms step (the 36 GDN layers: 3 each, 162 us), and the HLO says which ops
# they are.
if want s28min; then
  GPU_SET=kernels GPU_TESTS="tests/test_quant_kernel.py" CAP=65 WORKERS=4 \
    bash experiments/bench/gpu_tests.sh -k "one_launch or mixed" | tail -2
  mv $OUT/gpu_tests_kernels.log $OUT/gpu_tests_quant_multi.log 2>/dev/null
  python3 experiments/bench/make_gguf.py --geometry qwen3next-80b-a3b --quant q4_k_m \
    --layers 8 --out /tmp/a8.gguf --no-progress 2>&1 | tail -1
  timeout $(( $(left) - 3 )) python3 experiments/bench/decode_probe.py --gguf /tmp/a8.gguf \
    --variants base,qlaunch,attnpro,qlaunch+attnpro,base --batches 1 --n_steps 8 --reps 3 \
    --dump-hlo $OUT/hlo_a8 --out $OUT/decode_probe_a8_qlaunch.json 2>&1 \
    | grep -e '"variant"' -e Error | cut -c1-250
fi
# Session of 2026-12-07 (twenty-ninth), SECTIONS=s29 (~5 min): speculative decoding through the
# Engine. bench_spec at N = 3 and 4 with its Engine leg at spec_rounds 1 and 4 (greedy MTP
# rounds back to back in one program, `steps.spec_rounds_step`): the Engine's decode
# tokens/s beside the device program's rate for the same rounds, so engine / program is the
# host's share of a round, one round a dispatch against four.
# Then (same section) `Forms.proj_finish="gemv_b"`: the one-row GEMV's launch copies the
# layer's B out, so the finish reads B at a static index (runs 82-83: the index wait is 3/4 of
# the adapter's cost at batch 1). Its compiled test, then bench-a3b's batch-1 step with the
# adapter on, gemv against gemv_b, in one process.
if want s29; then
  GPU_SET=kernels GPU_TESTS="tests/test_quant_kernel.py" CAP=60 WORKERS=4 \
    bash experiments/bench/gpu_tests.sh -k "copies_b" | tail -2
  mv $OUT/gpu_tests_kernels.log $OUT/gpu_tests_finishb.log 2>/dev/null
  timeout 200 python3 experiments/bench/decode_probe.py \
    --variants base@on,finishb@on,base@on,finishb@on,base --batches 1 --reps 3 \
    --out $OUT/decode_probe_finishb.json 2>&1 | grep -e '"variant"' -e Error | cut -c1-250
  timeout $(( $(left) - 5 )) python3 experiments/bench/bench_spec.py --ns 3,4 \
    --engine_rounds 1,4 --out $OUT/bench_spec_rounds.json 2>&1 \
    | grep -e engine -e ratio -e Error | cut -c1-300
fi
# Session of 2026-12-07 (thirtieth), SECTIONS=s30 (~9 min): the 80B-A3B Q4_K_M on this
# commit's defaults (`quant_launch` "fused" on the GPU since run 87; the loader writing each
# stacked leaf in place, `reader.StackInPlace`, since run 85 ran an H100 out of memory
# stacking a 6 GiB leaf): on an H100, whether it now loads; on either card, its batch-1 program
# with the launches fused ("base") against apart, profiled, then the Engine at batch 1 and 8,
# adapter on and off (load_80b: device bytes, host peak, load time).
if want s30; then
  VARIANTS=base,qapart PROFILE=base PROBE_CAP=170 BATCHES=1,8 CAP=$(( $(left) - 5 )) \
    bash experiments/bench/a80b_run.sh
fi
# SECTIONS=s30spec (~4 min): the Engine's speculative rounds after the thirtieth session's host
# changes (the round's inputs go to the program as numpy, its outputs come back in one read;
# on this CPU +10-40 % tok/s at spec_rounds 1, within noise at 4). Run 86 read ~5 ms of host time a dispatch
# on the H100 (Engine 73.4 / 90.0 tok/s against the program's 115.2 at rounds 1 / 4). Since
# the thirty-first session sampled rows take the rejection rule on the device (before: each
# round's [N + 1, 151,936] logits to the host and a float64 softmax per position), and run
# MTP rounds back to back as greedy rows do: temperature 0.8 beside greedy, never timed on a GPU.
if want s30spec; then
  timeout $(( $(left) - 5 )) python3 experiments/bench/bench_spec.py --ns 3 \
    --engine_rounds 1,4 --engine_temperatures 0,0.8 --out $OUT/bench_spec_s30.json 2>&1 \
    | grep -e engine -e Error | cut -c1-300
fi
# SECTIONS=h200peer: what the H200's summary figures owe since run 77 (only on an H200).
if want h200peer; then
  h200_prefill_and_peer s25
fi
rm -rf $OUT/tmp
echo "all done $(( $(date +%s) - t0 )) s"
