"""Quantised matmuls (`pallas_kernels.quant`) on the GPU: time per call against the bytes read.

For each quant type and projection shape, a stack of `--layers` random matrices in the
repacked layout lives on the device (more bytes than L2, so every call reads from HBM). One
jitted program makes `--iters` calls, unrolled, each reading the next layer of the stack in
place (index = i % L), so launches run back to back and no dispatch is timed; time per call =
program time / iters (median of `--reps`). Reported per (type, shape, batch):

  - us: microseconds per call; TBps: (matrix bytes + x + y) / time, the roofline ratio of a
    decode-sized call against the copy bandwidth (bench_kernels.py measures 4.13 TB/s);
  - TFLOPs for the prefill size (compute-bound there);
  - for reference (`--reference`): a dense bf16 XLA matmul of each shape and batch, and at
    batch 1 the "xla" quant path (dequantise in XLA, then a dot);
  - LoRA (`--rank`, both `lora_down` forms): the fused call with every row on / every row off,
    beside the plain call (the off / on overheads the issue's targets are about).

--sweep also times kernel forms and tilings (form, block_out, block_in, num_warps,
num_stages) at batches 1 and 8 of `--sweep_types` on the first shape and prints the fastest,
to choose `kernel.tiling_defaults`.
Each timed program unrolls `--iters` calls of one jitted kernel (lowered once). The run stops
starting measurements after `--budget_s` and always writes what it has (also after every
measurement); split a long run with --types / --shapes / --batches.

  python experiments/bench/quant_probe.py --out=experiments/results/quant_probe.json
  python experiments/bench/quant_probe.py --smoke --out=/tmp/quant_probe.json   # CPU check
"""
from __future__ import annotations

import itertools
import json
import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

flags.DEFINE_bool("smoke", False, "tiny shapes in interpret mode (CPU check of the script)")
flags.DEFINE_string("out", os.path.join(common.RESULTS, "quant_probe.json"), "output JSON")
flags.DEFINE_string("types", "q4_k,q5_k,q6_k,q8_0", "quant types")
# Qwen3-Next-80B-A3B projections: GDN in_proj (qkvz), ssm_out / attn_output, expert down.
flags.DEFINE_string("shapes", "in_proj:12288x2048,ssm_out:2048x4096,ffn_down:2048x512",
                    "name:OUTxIN,...")
flags.DEFINE_string("batches", "1,8,32", "decode batch sizes")
flags.DEFINE_integer("prefill", 2048, "prefill rows (0: skip)")
flags.DEFINE_integer("layers", 0, "matrices in each stack (0: 256 MB and >= --iters)")
flags.DEFINE_integer("iters", 16, "calls per timed program (unrolled)")
flags.DEFINE_integer("reps", 7, "timed programs per measurement (median)")
flags.DEFINE_integer("rank", 50, "LoRA rank")
flags.DEFINE_string("lora_shape", "ssm_out", "shape name the LoRA variants run on ('': none)")
flags.DEFINE_bool("reference", True, "also time the 'xla' quant path (batch 1) and dense bf16")
flags.DEFINE_bool("sweep", False, "also sweep kernel tilings at batches 1 and 8")
flags.DEFINE_string("sweep_types", "q4_k,q8_0", "quant types of the sweep")
flags.DEFINE_integer("sweep_iters", 8, "calls per timed program in the sweep")
flags.DEFINE_float("budget_s", 500.0, "stop starting new measurements after this many seconds")
F = flags.FLAGS


class OutOfTime(Exception):
  """The --budget_s is spent: what was measured so far is written."""


_T0 = common.now()
_RES = {}


def _timer(reps):
  import jax

  def run(fn, args):
    if common.now() - _T0 > F.budget_s:
      raise OutOfTime
    common.write_json(F.out, _RES)  # everything so far, in case the run is killed
    jax.block_until_ready(fn(*args))  # compile + warm
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
      t0 = common.now()
      jax.block_until_ready(fn(*args))
      ts.append(common.now() - t0)
    return common.summarize(ts)["median"]
  return run


def _layers(matrix_bytes):
  """Stack depth: at least --iters (every call of a program reads a different matrix, so XLA
  cannot merge two identical calls) and 256 MB (more than L2)."""
  if F.smoke:
    return 2
  return F.layers or max(F.iters, F.sweep_iters, -(-256 * 2 ** 20 // matrix_bytes))


def _program(call, n_layers, iters, static_layer=False):
  """jit(x, w, *extra) making `iters` unrolled calls on layers i % L; returns a checksum."""
  import jax
  import jax.numpy as jnp

  @jax.jit
  def prog(x, w, *extra):
    tot = jnp.zeros((x.shape[0],), jnp.float32)
    for i in range(iters):
      layer = i % n_layers  # a Python int: dense calls index a tuple with it
      y = call(x, w, layer if static_layer else jnp.int32(layer), *extra)
      tot = tot + y[:, 0].astype(jnp.float32)
    return tot
  return prog


def probe(res):
  import jax
  import jax.numpy as jnp

  from pallas_kernels.quant import qmatmul
  impl = "pallas_interpret" if F.smoke else "pallas"
  bf16 = jnp.bfloat16
  if F.smoke:  # tiny everything, so the script's paths run on CPU in seconds
    F.shapes, F.batches, F.prefill, F.iters, F.reps, F.rank = "tiny:40x256", "1,3", 17, 2, 1, 4
    F.lora_shape, F.types, F.sweep_types = "tiny", "q4_k,q6_k,q8_0", "q4_k"
  shapes = [(s.split(":")[0], *map(int, s.split(":")[1].split("x"))) for s in F.shapes.split(",")]
  batches = [int(b) for b in F.batches.split(",") if b]
  if F.prefill:
    batches.append(F.prefill)
  timer = _timer(F.reps)
  iters = F.iters
  key = jax.random.key(0)
  res["config"] = dict(impl=impl, shapes=shapes, batches=batches, iters=iters, reps=F.reps,
                       rank=F.rank, device=str(jax.devices()[0]))
  rows = res.setdefault("qmatmul", [])
  if F.reference:  # dense bf16 baseline: once per shape and batch
    for name, d_out, d_in in shapes:
      n_layers = _layers(2 * d_out * d_in)
      # Separate arrays, not a stack: a static slice of a stack could be copied before the
      # cuBLAS call, which would time the copy too.
      dense = tuple(jax.random.normal(jax.random.key(k), (d_out, d_in), bf16)
                    for k in range(n_layers))
      for n in batches:
        x = jax.random.normal(jax.random.key(n), (n, d_in), bf16)
        td = timer(_program(lambda x, w, i: jnp.dot(x, w[i].T, preferred_element_type=jnp.float32),
                            n_layers, iters, static_layer=True), (x, dense)) / iters
        r = dict(qtype="bf16", shape=name, out=d_out, d_in=d_in, batch=n, layers=n_layers,
                 matrix_bytes=2 * d_out * d_in, us=td * 1e6,
                 TBps=(2 * d_in * d_out + 2 * n * (d_in + d_out)) / td / 1e12)
        rows.append(r)
        print(json.dumps(r), flush=True)
      del dense
  for qtype, (name, d_out, d_in) in itertools.product(F.types.split(","), shapes):
    one = common.random_qtensor(key, qtype, (1,), d_out, d_in).nbytes
    n_layers = _layers(one)
    w = common.random_qtensor(key, qtype, (n_layers,), d_out, d_in)
    for n in batches:
      x = jax.random.normal(jax.random.key(n), (n, d_in), bf16)
      io = 2 * n * (d_in + d_out)
      r = dict(qtype=qtype, shape=name, out=d_out, d_in=d_in, batch=n, layers=n_layers,
               matrix_bytes=one)
      t = timer(_program(lambda x, w, i: qmatmul(x, w, index=i, implementation=impl),
                         n_layers, iters), (x, w)) / iters
      r.update(us=t * 1e6, TBps=(one + io) / t / 1e12, TFLOPs=2 * n * d_in * d_out / t / 1e12)
      if F.reference and n == 1:
        tx = timer(_program(lambda x, w, i: qmatmul(x, w, index=i, implementation="xla"),
                            n_layers, iters), (x, w)) / iters
        r.update(xla_us=tx * 1e6)
      rows.append(r)
      print(json.dumps(r), flush=True)
      if name == F.lora_shape:
        res.setdefault("lora", []).append(_lora(r, x, w, n_layers, impl, timer))
    del w
  if F.sweep:
    res["sweep"] = _sweep(shapes, impl, timer)


def _lora(r, x, w, n_layers, impl, timer):
  import jax
  import jax.numpy as jnp

  from pallas_kernels.quant import qmatmul_lora
  n, d_in = x.shape
  d_out = w.shape[-2]
  a = (jax.random.normal(jax.random.key(1), (F.rank, d_in)) / d_in ** 0.5).astype(x.dtype)
  b = (jax.random.normal(jax.random.key(2), (d_out, F.rank)) / F.rank ** 0.5).astype(x.dtype)
  out = dict(qtype=r["qtype"], shape=r["shape"], batch=n, plain_us=r["us"])
  for down in ("h", "a"):
    prog = _program(lambda x, w, i, a, b, on: qmatmul_lora(
        x, w, a, b, on, index=i, implementation=impl, lora_down=down), n_layers, F.iters)
    for state, on in (("on", jnp.ones((n,), jnp.int32)), ("off", jnp.zeros((n,), jnp.int32))):
      t = timer(prog, (x, w, a, b, on)) / F.iters
      out[f"{down}_{state}_us"] = t * 1e6
      out[f"{down}_{state}_overhead"] = t * 1e6 / r["us"] - 1
  print(json.dumps(out), flush=True)
  return out


def _sweep(shapes, impl, timer):
  """Tilings at batches 1 and 8 of `--sweep_types` on the first shape.

  Pass 1: form x block_out x block_in at 4 warps, 3 stages; pass 2: warps and stages around
  the best of pass 1. Prints and returns every timing; "best" lines name the fastest.
  """
  import jax

  from pallas_kernels.quant import qmatmul
  name, d_out, d_in = shapes[0]
  grid = dict(form=("rows", "dot"), block_out=(4, 8, 16, 32, 64), block_in=(256, 1024),
              num_warps=(4,), num_stages=(3,))
  if F.smoke:
    grid = dict(form=("rows", "dot"), block_out=(16,), block_in=(256,), num_warps=(4,),
                num_stages=(3,))
  iters = F.sweep_iters
  out = []
  for qtype in F.sweep_types.split(","):
    one = common.random_qtensor(jax.random.key(0), qtype, (1,), d_out, d_in).nbytes
    n_layers = _layers(one)
    w = common.random_qtensor(jax.random.key(0), qtype, (n_layers,), d_out, d_in)
    for n in (1, 8):
      x = jax.random.normal(jax.random.key(n), (n, d_in), "bfloat16")
      best = None

      def run(tiles):
        nonlocal best
        try:
          t = timer(_program(lambda x, w, i: qmatmul(
              x, w, index=i, implementation=impl, tiles=tiles), n_layers, iters),
              (x, w)) / iters
        except OutOfTime:
          raise
        except Exception as e:  # a tiling Triton rejects (shared memory, registers)
          print("sweep", qtype, n, tiles, "failed:", type(e).__name__, str(e)[:200])
          return
        rec = dict(qtype=qtype, shape=name, batch=n, **tiles, us=t * 1e6,
                   TBps=one / t / 1e12)
        out.append(rec)
        print(json.dumps(rec), flush=True)
        if best is None or t < best[0]:
          best = (t, rec)

      for combo in itertools.product(*grid.values()):
        run(dict(zip(grid, combo)))
      if best and not F.smoke:
        base = {k: best[1][k] for k in grid}
        for warps, stages in ((2, 3), (8, 3), (4, 2), (4, 4)):
          run(dict(base, num_warps=warps, num_stages=stages))
      if best:
        print("best", json.dumps(best[1]), flush=True)
  return out


def main(_):
  try:
    probe(_RES)
  except OutOfTime:
    _RES["out_of_time"] = f"stopped after --budget_s={F.budget_s} s; the rest is not measured"
    print(_RES["out_of_time"], flush=True)
  finally:
    common.write_json(F.out, _RES)
    print("wrote", F.out)


if __name__ == "__main__":
  app.run(main)
