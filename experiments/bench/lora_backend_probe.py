"""LoRA delta, Pallas backends on one GPU: Triton lowering vs Mosaic GPU vs plain XLA.

One run does everything (issue 14, part 5):
  1. checks: the Mosaic GPU kernel (`kernel_mosaic.lora_mosaic`) and the Triton kernel
     (`kernel.lora_pallas`) against `lora_reference` (fp32, HIGHEST) on fresh random bf16
     inputs, half the rows on: relative error of the delta on on-rows, and off-rows bit for
     bit equal to base; a ragged case (N = 300, rank 50) too;
  2. timing: each variant inside one jitted, unrolled program of L layers; layer l applies
     the op with its own A_l, B_l (so the weights are not one cached set) and feeds its
     output in as the next base. Per-layer cost = program time / L; program time = median
     of `--rounds` interleaved rounds (every variant once per round) x `--calls` calls,
     each call ended by block_until_ready, after a warm-up. Every row is switched on.

  PYTHONPATH=. python3 experiments/bench/lora_backend_probe.py --out probe.json   # device
  PYTHONPATH=. python3 experiments/bench/lora_backend_probe.py --smoke          # CPU check

Errors (a variant that does not compile) are recorded in the JSON, not raised.
"""
import argparse
import functools
import json
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.lora.api import lora_xla
from pallas_kernels.lora.kernel import lora_pallas
from pallas_kernels.lora.kernel_mosaic import interpret_params, lora_mosaic, mosaic_tiling
from pallas_kernels.lora.reference import lora_reference

BF16 = jnp.bfloat16
RANK = 64


def make_inputs(key, n, d_in, d_out, rank, layers=1, on_frac=0.5, base_dtype=BF16):
  """Random bf16 operands (never zeros); a [L, R, Din], b [L, Dout, R] when layers > 1."""
  k = jax.random.split(key, 5)
  lead = (layers,) if layers > 1 else ()
  x = jax.random.normal(k[0], (n, d_in), jnp.float32).astype(BF16)
  a = (jax.random.normal(k[1], (*lead, rank, d_in)) / d_in ** 0.5).astype(BF16)
  b = (jax.random.normal(k[2], (*lead, d_out, rank)) / rank ** 0.5).astype(BF16)
  base = jax.random.normal(k[3], (n, d_out), jnp.float32).astype(base_dtype)
  on = (jax.random.uniform(k[4], (n,)) < on_frac).astype(jnp.int32)
  if on_frac >= 1.0:
    on = jnp.ones((n,), jnp.int32)
  return base, x, a, b, on


def check(name, fn, key, n, d_in, d_out, rank, base_dtype=BF16):
  """Relative delta error on on-rows and off-row bit identity against lora_reference.

  With a bf16 base the error includes y's rounding to bf16; an fp32 base shows the
  kernel's own arithmetic (expected ~1e-5: bf16 products, fp32 sums, h split hi + lo)."""
  base, x, a, b, on = make_inputs(key, n, d_in, d_out, rank, base_dtype=base_dtype)
  out = {"variant": name, "n": n, "d_in": d_in, "d_out": d_out, "rank": rank,
         "base_dtype": jnp.dtype(base_dtype).name}
  try:
    y = np.asarray(jax.block_until_ready(fn(base, x, a, b, on)))
  except Exception as e:  # noqa: BLE001 - record the failure, keep going
    out["error"] = f"{type(e).__name__}: {e}"[:4000]
    out["traceback"] = traceback.format_exc()[-6000:]
    print(out["traceback"], file=sys.stderr, flush=True)
    return out
  ref = np.asarray(lora_reference(base, x, a, b, on)).astype(np.float32)
  bf = np.asarray(base).astype(np.float32)
  onm = np.asarray(on) != 0
  d_ref, d_out_ = (ref - bf)[onm], (y.astype(np.float32) - bf)[onm]
  out["delta_rel_err"] = float(np.linalg.norm(d_out_ - d_ref) / np.linalg.norm(d_ref))
  out["y_max_abs_err"] = float(np.abs(y.astype(np.float32) - ref).max())
  bits = np.uint16 if y.dtype.itemsize == 2 else np.uint32
  out["off_bit_identical"] = bool(np.array_equal(
      y.view(bits)[~onm], np.asarray(base).view(bits)[~onm]))
  out["finite"] = bool(np.isfinite(y.astype(np.float32)).all())
  return out


def make_program(fn, layers):
  """Unrolled L layers: y = fn(y, x, a[l], b[l], on); no while loop in the timed program."""

  @jax.jit
  def program(base, x, a, b, on):
    y = base
    for layer in range(layers):
      y = fn(y, x, a[layer], b[layer], on)
    return y

  return program


def variants_for(n, d_in, d_out, stages=False):
  """name -> op(base, x, a, b, on): XLA, the Triton kernel, Mosaic at its default G and
  at half / double the Dout splits (where those divide the Dout tiles); with `stages`, also
  Mosaic with 4 down-pipeline buffers (1 up) and with 2."""
  t = mosaic_tiling(n, d_in, d_out, RANK)
  tiles = d_out // t.block_out
  out = {"xla": lora_xla, "triton": lora_pallas, "mosaic": lora_mosaic}
  for g in (t.dout_splits // 2, t.dout_splits * 2):
    if g >= 1 and g <= tiles and tiles % g == 0:
      out[f"mosaic_g{g}"] = functools.partial(lora_mosaic, dout_splits=g)
  if stages:
    out["mosaic_s4o1"] = functools.partial(lora_mosaic, in_stages=4, out_stages=1)
    out["mosaic_s2"] = functools.partial(lora_mosaic, in_stages=2)
  return out, t


def time_shape(key, n, d_in, d_out, layers, rounds, calls, batched=False, stages=False):
  """Per-layer µs of every variant. A sample: `calls` calls each ended by block_until_ready
  (host dispatch + sync in every sample), or with `batched`, `calls` calls dispatched back
  to back and one block_until_ready at the end, divided by `calls` (device throughput: the
  host's dispatch overlaps the device work). Each variant's final y is also compared with
  XLA's (`rel_diff_vs_xla`, relative Frobenius norm after L chained layers)."""
  variants, t = variants_for(n, d_in, d_out, stages=stages)
  base, x, a, b, on = make_inputs(key, n, d_in, d_out, RANK, layers=layers, on_frac=1.0)
  progs, res = {}, {"n": n, "d_in": d_in, "d_out": d_out, "rank": RANK, "layers": layers,
                    "mosaic_default_tiling": t._asdict(), "us_per_layer": {}, "errors": {}}
  for name, fn in variants.items():
    prog = make_program(fn, layers)
    try:
      t0 = time.perf_counter()
      jax.block_until_ready(prog(base, x, a, b, on))
      res.setdefault("compile_s", {})[name] = round(time.perf_counter() - t0, 2)
      for _ in range(2):
        y = jax.block_until_ready(prog(base, x, a, b, on))
      y = np.asarray(y).astype(np.float32)
      if name == "xla":
        y_xla = y
      elif "xla" in progs:
        res.setdefault("rel_diff_vs_xla", {})[name] = float(
            np.linalg.norm(y - y_xla) / np.linalg.norm(y_xla))
      progs[name] = prog
    except Exception as e:  # noqa: BLE001
      res["errors"][name] = f"{type(e).__name__}: {e}"[:2000]
  samples = {name: [] for name in progs}
  for _ in range(rounds):
    for name, prog in progs.items():
      if batched:
        t0 = time.perf_counter()
        for _ in range(calls):
          y = prog(base, x, a, b, on)
        jax.block_until_ready(y)
        samples[name].append((time.perf_counter() - t0) / calls)
        continue
      for _ in range(calls):
        t0 = time.perf_counter()
        jax.block_until_ready(prog(base, x, a, b, on))
        samples[name].append(time.perf_counter() - t0)
  for name, s in samples.items():
    med = statistics.median(s)
    res["us_per_layer"][name] = round(med / layers * 1e6, 2)
    res.setdefault("spread_us_per_layer", {})[name] = [
        round(min(s) / layers * 1e6, 2), round(sorted(s)[int(0.9 * len(s))] / layers * 1e6, 2)]
  return res


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--tokens", default="1,8,32,512,2048")
  p.add_argument("--shapes", default="4096x2048,2048x4096", help="Din x Dout, comma separated")
  p.add_argument("--layers", type=int, default=16)
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--calls", type=int, default=10)
  p.add_argument("--out", default=None)
  p.add_argument("--smoke", action="store_true", help="CPU: interpreter checks only, tiny")
  p.add_argument("--batched", action="store_true", help="time back-to-back calls (see time_shape)")
  p.add_argument("--stages", action="store_true", help="also time Mosaic pipeline depths, N >= 512")
  p.add_argument("--no-checks", action="store_true", help="skip the reference checks")
  args = p.parse_args(argv)
  result = {"jax": jax.__version__,
            "timer": "batched" if args.batched else "per-call sync",
            "devices": [str(d) for d in jax.devices()],
            "backend": jax.default_backend(), "argv": sys.argv[1:], "checks": [], "timing": []}
  key = jax.random.key(0)
  if args.smoke:
    ip = interpret_params()
    mosaic = functools.partial(lora_mosaic, interpret=ip)
    triton = functools.partial(lora_pallas, interpret=True)
    for i, (n, d_in, d_out, r) in enumerate([(8, 256, 256, 64), (70, 192, 320, 50)]):
      for name, fn in (("mosaic", mosaic), ("triton", triton)):
        result["checks"].append(check(name, fn, jax.random.fold_in(key, i), n, d_in, d_out, r))
        print(json.dumps(result["checks"][-1]), flush=True)
    return result
  shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
  tokens = [int(v) for v in args.tokens.split(",")]
  cases = [(n, di, do, RANK, BF16) for di, do in shapes for n in tokens]
  cases += [(300, 4096, 2048, 50, BF16), (64, 4096, 2048, RANK, jnp.float32)]

  def save():  # after every step, so a run cut short still leaves its results
    if args.out:
      with open(args.out, "w") as f:
        json.dump(result, f, indent=1)

  for i, case in enumerate([] if args.no_checks else cases):  # checks first; fresh keys
    for name, fn in (("mosaic", lora_mosaic), ("triton", lora_pallas)):
      c = check(name, fn, jax.random.fold_in(key, 100 + i), *case)
      result["checks"].append(c)
      print(json.dumps({k: v for k, v in c.items() if k != "traceback"}), flush=True)
  save()
  if any("error" in c for c in result["checks"] if c["variant"] == "mosaic"):
    print("mosaic failed its checks (tracebacks above): no timing", flush=True)
    return result  # a failed port ends the run early: the device time is for the fix
  order = sorted(tokens, key=lambda n: -n)  # the large N first: the case Mosaic is for
  for di, do in shapes:
    for n in order:
      r = time_shape(jax.random.fold_in(key, 1000 + n), n, di, do, args.layers, args.rounds,
                     args.calls, batched=args.batched, stages=args.stages and n >= 512)
      result["timing"].append(r)
      print(json.dumps({k: r[k] for k in ("n", "d_in", "d_out", "us_per_layer", "errors")}),
            flush=True)
      save()
  print("\n  N  Din->Dout   " + "  ".join(f"{v:>10}" for v in
                                        ("xla", "triton", "mosaic", "best mosaic")))
  for r in result["timing"]:
    u = r["us_per_layer"]
    ms = {k: v for k, v in u.items() if k.startswith("mosaic")}
    best = min(ms, key=ms.get) if ms else "-"
    print(f"{r['n']:>5} {r['d_in']}->{r['d_out']}  " + "  ".join(
        f"{u.get(k, float('nan')):>10.2f}" for k in ("xla", "triton", "mosaic"))
        + f"  {best}={ms.get(best, float('nan')):.2f}")
  return result


if __name__ == "__main__":
  main()
