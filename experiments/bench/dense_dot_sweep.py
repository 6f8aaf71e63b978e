"""bench-a3b's dense projections at a few rows (decode batch 8 / 32, a verify step's 5), one
tiling of the in-place tensor-core kernel (pallas_kernels/quant/dense_dot.py) at a time,
against XLA's dot on the matrix taken at a traced index (what the decode step's layer scan
does: XLA copies the matrix out of the stack, then dots).

Each shape's stack holds more matrices than fit in L2 (every call reads HBM). One jitted
program runs `--iters` calls in a `lax.fori_loop`, call i on matrix i % S (a traced index, as
in the layer scan), each output added into a carried fp32 sum (the same add for every
variant). Time per call = program time / iters, median of --reps; TB/s = the matrix's bytes
over that time. The run stops starting new measurements after --budget-s and writes JSON
after each one.

  python experiments/bench/dense_dot_sweep.py --out experiments/results/device/dense_dot_sweep.json
  JAX_PLATFORMS=cpu python experiments/bench/dense_dot_sweep.py --smoke --out /tmp/dd.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.abspath(os.path.join(HERE, "..", "..")))
import common  # noqa: E402

# (name, out, in): bench-a3b's matrices kept whole under Forms.dense_weights="kernel".
SHAPES = [
    ("gdn_qkv", 8192, 2048),
    ("gdn_out", 2048, 4096),
    ("gdn_gate", 4096, 2048),
    ("attn_kv", 512, 2048),
    ("shared_down", 2048, 512),
    ("router", 64, 2048),
]
VARIANTS = [
    {},
    {"block_out": 32},
    {"block_out": 128},
    {"block_in": 128},
    {"block_in": 512},
    {"k_split": 1},
    {"k_split": 2},
    {"k_split": 4},
    {"num_warps": 8},
    {"num_stages": 4},
    {"num_stages": 2},
    "xla",
]


def program(call, n_mats, iters, m, d_out):
  import jax
  import jax.numpy as jnp
  from jax import lax

  @jax.jit
  def prog(x, w):
    def body(i, tot):
      return tot + call(x, w, i % n_mats).astype(jnp.float32)
    return lax.fori_loop(0, iters, body, jnp.zeros((m, d_out), jnp.float32))
  return prog


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--out", required=True)
  ap.add_argument("--rows", default="8,32,5")
  ap.add_argument("--iters", type=int, default=24)
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--budget-s", type=float, default=150.0)
  ap.add_argument("--shapes", default="", help="comma-separated names (default: all)")
  ap.add_argument("--smoke", action="store_true", help="CPU, interpret mode, toy sizes")
  args = ap.parse_args(argv)
  import jax
  import jax.numpy as jnp
  from jax import lax

  from pallas_kernels.quant.api import dense_reference
  from pallas_kernels.quant.dense_dot import dense_dot_call
  from pallas_kernels.quant.gemv import triton_params
  t_start = time.perf_counter()
  shapes = [s for s in SHAPES if not args.shapes or s[0] in args.shapes.split(",")]
  variants = VARIANTS
  if args.smoke:
    shapes = [(n, min(o, 64), min(i, 256)) for n, o, i in shapes[:2]]
    variants = [{"block_in": 64}, {"block_in": 64, "k_split": 2}, "xla"]
    args.iters, args.reps = 2, 1
  res = dict(device=str(jax.devices()[0]), jax=jax.__version__, iters=args.iters,
             reps=args.reps, results=[])
  for m in (int(r) for r in args.rows.split(",")):
    for name, d_out, d_in in shapes:
      one = d_out * d_in * 2
      n_mats = 2 if args.smoke else max(4, -(-256 * 2**20 // one))
      w = jax.random.normal(jax.random.key(1), (n_mats, d_out, d_in), jnp.bfloat16)
      x = jax.random.normal(jax.random.key(2), (m, d_in), jnp.bfloat16)
      for v in variants:
        if time.perf_counter() - t_start > args.budget_s:
          res["out_of_time"] = f"stopped after {args.budget_s} s"
          break
        if v == "xla":
          call = lambda x, w, i: dense_reference(x, w, i)
        else:
          kw = dict(v)
          warps, stages = kw.pop("num_warps", None), kw.pop("num_stages", None)
          params = None if args.smoke else triton_params(warps, stages)
          call = lambda x, w, i, kw=kw, params=params: dense_dot_call(
              x, w, i, interpret=args.smoke, compiler_params=params, **kw)
        rec = dict(shape=name, out=d_out, d_in=d_in, rows=m,
                   variant=v if v == "xla" else json.dumps(v, sort_keys=True))
        try:
          prog = program(call, n_mats, args.iters, m, d_out)
          got = jax.block_until_ready(prog(x, w))
          want = program(lambda x, w, i: dense_reference(x, w, i), n_mats, args.iters, m,
                         d_out)(x, w) if v != "xla" else got
          rec["max_rel_vs_xla"] = float(jnp.max(jnp.abs(got - want)) /
                                        (jnp.max(jnp.abs(want)) + 1e-30))
          us = common.median_call_s(lambda: prog(x, w), args.reps) / args.iters * 1e6
          rec.update(us=us, TBps=one / (us * 1e-6) / 1e12)
        except Exception as e:  # noqa: BLE001 (a tiling Triton refuses, an invalid split)
          rec.update(error=f"{type(e).__name__}: {str(e)[:200]}")
        common.add_result(res, rec, args.out)
  best = {}
  for r in res["results"]:
    key = f"{r['shape']}@{r['rows']}"
    if "us" in r and r["variant"] != "xla" and (key not in best or r["us"] < best[key]["us"]):
      best[key] = r
  res["best"] = best
  res["wall_s"] = time.perf_counter() - t_start
  common.write_json(os.path.abspath(args.out), res)
  for key, r in best.items():
    shape, m = key.split("@")
    pick = lambda v: next((x for x in res["results"] if x["shape"] == shape
                           and x["rows"] == int(m) and x["variant"] == v and "us" in x), None)
    base, xla = pick(json.dumps({})), pick("xla")
    print(f"best {key}: {r['variant']} {r['us']:.1f} us ({r['TBps']:.2f} TB/s)"
          + (f"; default {base['us']:.1f}" if base else "")
          + (f"; xla {xla['us']:.1f}" if xla else ""), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
