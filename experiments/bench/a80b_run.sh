#!/usr/bin/env bash
# On the device, one call (~9 min): write the 80B-A3B Q4_K_M file, time the device program at
# batch 1 with the quant groups switched and predicated (decode_probe; VARIANTS= other variants,
# parts joined by "+" combine), then load it through the Engine with the fastest variant's forms
# and decode at batch 1 and 8 (BATCHES=), adapter on and off (load_80b). PROFILE=variant
# traces that variant's batch-1 decode call (time by kernel, in the probe's JSON).
# Results in $OUT.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
t0=$(date +%s)
python3 experiments/bench/make_gguf.py --geometry qwen3next-80b-a3b --quant q4_k_m \
  --out /tmp/a80b.gguf --no-progress 2>&1 | tail -2
echo "gguf written $(( $(date +%s) - t0 )) s"
timeout ${PROBE_CAP:-170} python3 experiments/bench/decode_probe.py --gguf /tmp/a80b.gguf --variants ${VARIANTS:-base,qpred} \
  --batches 1 --n_steps 8 --reps 3 ${PROFILE:+--profile $PROFILE} --out $OUT/decode_probe_a80b.json 2>&1 | grep '"variant"' | cut -c1-300
echo "probe done $(( $(date +%s) - t0 )) s"
FORMS=$(python3 - "$OUT/decode_probe_a80b.json" <<'PY'
import json, sys
sys.path.insert(0, "experiments/bench")
try:
  from decode_probe import FORM_VARIANTS   # the variants' forms, as the probe ran them
  r = {x["variant"]: x["ms_per_step"] for x in json.load(open(sys.argv[1]))["results"]}
  best = min(r, key=r.get)
  print(",".join(f"{k}={v}" for part in best.split("+")
                 for k, v in FORM_VARIANTS.get(part, {}).items()))
except Exception:
  print("")
PY
)
echo "engine forms: '${FORMS}'"
timeout $(( ${CAP:-560} - ($(date +%s) - t0) )) python3 experiments/bench/load_80b.py \
  --gguf /tmp/a80b.gguf --no-warm --batches ${BATCHES:-1,8} --forms "$FORMS" --out $OUT/a80b.json 2>&1 \
  | grep -v -e "^W" -e "^I" -e "^\*" -e "^$" | cut -c1-400 | tail -5
echo "all done $(( $(date +%s) - t0 )) s"
