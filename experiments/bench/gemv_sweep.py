"""The quantised decode GEMVs of Qwen3-Next-80B-A3B (Q4_K_M) at batch 1, one kernel setting at
a time: which tiling, split along `in` (k_split) or XLA path is fastest for each shape.

Each shape's weight is a stack of random planes larger than L2 (every call reads HBM); one
jitted program makes `--iters` back-to-back calls on matrices i % L (the experts: 10 pairs of
distinct matrices per call), so launch gaps count as they do in the model's step. Time per
call = program time / iters, median of --reps. Shapes run in order of their share of the
80B decode step (decode_probe_a80b_l8.json); the run stops starting new measurements after
--budget-s and writes JSON after each one.

  python experiments/bench/gemv_sweep.py --out experiments/results/device/gemv_sweep.json
  python experiments/bench/gemv_sweep.py --smoke --out /tmp/gemv_sweep.json   # CPU check

--set blocks times the "blocks" form (kernel.py's gemv.py: whole quant blocks a load) at its
tilings against the "rows" form's defaults and XLA; --rows M runs M activation rows a call
(decode batch M; the experts keep one row per pair).
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

# (name, qtype, out, in, groups): groups > 1 are the routed experts' (token, expert) pairs.
SHAPES = [
    ("experts_gate_up", "q4_k", 512, 2048, 10),
    ("shared_gate_up", "q4_k", 512, 2048, 1),
    ("lm_head", "q6_k", 151936, 2048, 1),
    ("ssm_out", "q4_k", 2048, 4096, 1),
    ("gdn_qkv", "q5_k", 8192, 2048, 1),
    ("gdn_z", "q4_k", 4096, 2048, 1),
    ("ssm_ba", "q4_k", 64, 2048, 1),
    ("experts_down", "q4_k", 2048, 512, 10),
    ("experts_down_q6", "q6_k", 2048, 512, 10),
    ("shared_down", "q4_k", 2048, 512, 1),
    ("attn_q", "q4_k", 8192, 2048, 1),
]
VARIANTS = [
    {},
    {"k_split": 2},
    {"block_in": 512, "k_split": 4},
    {"block_in": 256, "k_split": 8},
    {"block_in": 256, "k_split": 2},
    {"block_out": 8},
    {"block_out": 16, "k_split": 2},
    {"block_out": 64},
    {"num_warps": 2},
    {"num_warps": 8},
    {"num_warps": 2, "k_split": 2},
    "xla",
]
BLOCKS_VARIANTS = [
    {"form": "rows"},
    {"form": "blocks"},
    {"form": "blocks", "block_out": 8},
    {"form": "blocks", "block_out": 32},
    {"form": "blocks", "block_in": 1024},
    {"form": "blocks", "block_in": 256},
    {"form": "blocks", "num_warps": 2},
    {"form": "blocks", "num_warps": 8},
    {"form": "blocks", "k_split": 1},
    {"form": "dot"},
    "xla",
]


def program(call, n_mats, groups, iters):
  import jax
  import jax.numpy as jnp

  @jax.jit
  def prog(x, w):
    tot = jnp.zeros((), jnp.float32)
    for i in range(iters):
      idx = (jnp.arange(groups, dtype=jnp.int32) + i * groups) % n_mats
      tot = tot + call(x, w, idx)[..., 0].astype(jnp.float32).sum()
    return tot
  return prog


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--out", required=True)
  ap.add_argument("--iters", type=int, default=16)
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--budget-s", type=float, default=200.0)
  ap.add_argument("--shapes", default="", help="comma-separated names (default: all)")
  ap.add_argument("--smoke", action="store_true", help="CPU, interpret mode, toy sizes")
  ap.add_argument("--set", choices=("rows", "blocks"), default="rows",
                  help="the variants: the \"rows\" form's tilings, or the \"blocks\" form's")
  ap.add_argument("--rows", type=int, default=1, help="activation rows a call (not experts)")
  args = ap.parse_args(argv)
  import jax
  import jax.numpy as jnp

  from pallas_kernels.quant.api import _xla_acc
  from pallas_kernels.quant.kernel import qmatmul_pallas
  from pallas_kernels.quant.layout import flat
  t_start = time.perf_counter()
  impl_kw = dict(interpret=True) if args.smoke else {}
  shapes = [s for s in SHAPES if not args.shapes or s[0] in args.shapes.split(",")]
  if args.smoke:
    shapes = [(n, q, min(o, 64), min(i, 512), g) for n, q, o, i, g in shapes[:3]]
    args.iters, args.reps = 2, 1
  res = dict(device=str(jax.devices()[0]), jax=jax.__version__, iters=args.iters,
             reps=args.reps, set=args.set, rows=args.rows, results=[])
  variants = BLOCKS_VARIANTS if args.set == "blocks" else VARIANTS
  for name, qtype, d_out, d_in, groups in shapes:
    one = common.random_qtensor(jax.random.key(0), qtype, (1,), d_out, d_in).nbytes
    n_mats = 2 if args.smoke else max(args.iters * groups, -(-256 * 2**20 // one))
    w = common.random_qtensor(jax.random.key(1), qtype, (n_mats,), d_out, d_in)
    m = 1 if groups > 1 else args.rows
    x = jax.random.normal(jax.random.key(2), (groups, m, d_in), jnp.bfloat16)
    planes = flat(w)
    for v in variants:
      if time.perf_counter() - t_start > args.budget_s:
        res["out_of_time"] = f"stopped after {args.budget_s} s"
        break
      if v == "xla":
        if groups > 1 or args.smoke:
          continue
        call = lambda x, w, idx: _xla_acc(x[0], w, idx[0], None).astype(x.dtype)[None]
        wt = w
      else:
        call = lambda x, p, idx, v=v: qmatmul_pallas(x, p, idx, qtype=qtype, d_out=d_out,
                                                     **v, **impl_kw)
        wt = planes
      if isinstance(v, dict) and v.get("form") == "dot" and m < 2:
        continue
      rec = dict(shape=name, qtype=qtype, out=d_out, d_in=d_in, groups=groups, rows=m,
                 variant=v if v == "xla" else json.dumps(v, sort_keys=True))
      try:
        prog = program(call, n_mats, groups, args.iters)
        jax.block_until_ready(prog(x, wt))
        us = common.median_call_s(lambda: prog(x, wt), args.reps) / args.iters * 1e6
        rec.update(us=us, TBps=one * groups / (us * 1e-6) / 1e12)
      except Exception as e:  # noqa: BLE001 (an invalid split or a tiling Triton refuses)
        rec.update(error=f"{type(e).__name__}: {str(e)[:160]}")
      common.add_result(res, rec, args.out)
  best = {}
  for r in res["results"]:
    if "us" in r and (r["shape"] not in best or r["us"] < best[r["shape"]]["us"]):
      best[r["shape"]] = r
  res["best"] = best
  res["wall_s"] = time.perf_counter() - t_start
  common.write_json(os.path.abspath(args.out), res)
  for k, r in best.items():
    base_v = json.dumps(variants[0], sort_keys=True)
    base = next((x for x in res["results"] if x["shape"] == k and x["variant"] == base_v
                 and "us" in x), None)
    print(f"best {k}: {r['variant']} {r['us']:.1f} us ({r['TBps']:.2f} TB/s)"
          + (f", {base_v} {base['us']:.1f} us" if base else ""))
  return 0


if __name__ == "__main__":
  sys.exit(main())
