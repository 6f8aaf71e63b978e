"""Decode tokens/s of bench-a3b split over two devices (24/24 layers) against one device.

Both runs use the same per-step loop the engine uses for a split (one jitted decode per stage,
the activation handed to the next stage's device, greedy argmax on the last), so the ratio
measures the split itself. Writes experiments/results/split_bench.json.

  python experiments/bench/split_bench.py [--tiny] [--steps 64] [--batch 1]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from strata_jax import steps  # noqa: E402
from strata_jax.parallel.split import make_stages  # noqa: E402
from strata_jax.state import init_state  # noqa: E402


def decode_rate(stages, batch, context, n_steps, dtype):
  states = [jax.device_put(init_state(st.cfg, batch, context, dtype), st.device) for st in stages]
  sw = [jax.device_put(jnp.ones(batch, jnp.int32), st.device) for st in stages]
  act = [jax.device_put(jnp.ones(batch, jnp.int32), st.device) for st in stages]
  argmax = jax.jit(lambda lg: jnp.argmax(lg, axis=-1).astype(jnp.int32))
  tok = jnp.zeros(batch, jnp.int32)

  def step(tok):
    x = tok
    for i, st in enumerate(stages):
      x = jax.device_put(x, st.device)
      x, states[i] = steps.decode(st.cfg, st.params, st.lora, states[i], x, sw[i], act[i])
    return argmax(x)

  for _ in range(3):
    tok = step(tok)
  tok.block_until_ready()
  t = time.perf_counter()
  for _ in range(n_steps):
    tok = step(tok)
  tok.block_until_ready()
  return batch * n_steps / (time.perf_counter() - t)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--tiny", action="store_true")
  ap.add_argument("--steps", type=int, default=64)
  ap.add_argument("--batch", type=int, default=1)
  ap.add_argument("--context", type=int, default=4096)
  args = ap.parse_args()
  devs = jax.devices()
  if len(devs) < 2:
    raise SystemExit("needs two devices")
  dtype = jnp.float32 if args.tiny else jnp.bfloat16
  cfg = common.model_config(common.TINY if args.tiny else common.BENCH_A3B)
  with jax.default_device(devs[0]):
    params = common.device_params(cfg, dtype)
    lora = common.device_lora(cfg, common.LORA_RANK, dtype)
  L = cfg.n_layers
  single = make_stages(cfg, params, lora, [(0, L)], [devs[0]])
  split = make_stages(cfg, params, lora, [(0, L // 2), (L // 2, L)], devs[:2])
  res = {"geometry": "tiny" if args.tiny else "bench-a3b", "batch": args.batch,
         "steps": args.steps, "devices": [str(d) for d in devs[:2]], "lora": "rank 50, on"}
  res["single_tok_s"] = decode_rate(single, args.batch, args.context, args.steps, dtype)
  del single
  res["split_tok_s"] = decode_rate(split, args.batch, args.context, args.steps, dtype)
  res["split_over_single"] = res["split_tok_s"] / res["single_tok_s"]
  os.makedirs(common.RESULTS, exist_ok=True)
  out = os.path.join(common.RESULTS, "split_bench.json" if not args.tiny else "tmp/split_tiny.json")
  os.makedirs(os.path.dirname(out), exist_ok=True)
  with open(out, "w") as f:
    json.dump(res, f, indent=1)
  print(json.dumps(res))


if __name__ == "__main__":
  main()
