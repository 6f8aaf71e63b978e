#!/usr/bin/env bash
# On the device, one call (~8 min): the H200 figures owed after 2026-12-01's third session.
# Results in $OUT.
#  bench_engine.py --reps 3 --profile at batch 32, 8 and 1 (issue 16), run 8: prefix-cache
#     snapshots now copied and cut into blocks by a copier thread (run 7: the GPU idled
#     22-33 ms per 75 MB GDN state while the scheduling thread did it), the server's clients
#     make their connections before the start line, and the profile records the scheduling
#     thread's time per phase and the time-to-first-token request's own profile.
#  decode_probe.py base at batch 1 with --dump-hlo (issue 17): the optimised decode program,
#     to find what the 12 per-step loop_slice_fusion copies (~600 us a step) are.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
t0=$(date +%s)
timeout ${CAP:-470} python3 experiments/bench/bench_engine.py --reps 3 --profile \
  --batches 32,8,1 --merge-summary --out $OUT/bench_engine.json 2>&1 \
  | grep -e "^decode" -e "^ttft" -e "^server" -e Error | cut -c1-600
cp experiments/results/summary.json $OUT/summary_after.json
timeout ${PROBE_CAP:-100} python3 experiments/bench/decode_probe.py --variants base --batches 1 \
  --n_steps 16 --reps 2 --dump-hlo $OUT/hlo --out $OUT/decode_probe_hlo.json 2>&1 | tail -3 | cut -c1-400
echo "all done $(( $(date +%s) - t0 )) s"
